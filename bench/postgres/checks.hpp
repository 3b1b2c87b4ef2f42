// The checks: --rss-check (runs instead of the matrix; --table-size-check is table_size.hpp), and
// --expect-round-trips (on the matrix's figures).
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "../common/util.hpp"
#include "admin.hpp"
#include "matrix.hpp"
#include "options.hpp"

namespace bench {

struct RssResult {
    std::uint64_t first = 100'000, total = 0, unexpected = 0;
    Memory at_first, at_total;
    double first_seconds = 0, total_seconds = 0;
};

/// RSS after 100k calls and after --rss-calls (half replays, half new keys); prints it.
RssResult rss_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                    const idem::Fingerprint& fp, std::uint64_t seed);

/// --expect-round-trips: false (with a FAIL line on stderr for each side that missed) unless every
/// call had the expected outcome and the round trips per call are what --help says.
bool round_trips_as_expected(const Options& o, const std::vector<Run>& runs);

}  // namespace bench
