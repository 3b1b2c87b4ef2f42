// --generations-sizing LENGTHS: can maintenance keep up? For each generation length (ms, a comma
// list), new calls (execute_once, new keys, --retention S of retention) on --retention-threads
// threads for --retention-duration S on a table of that length and --generation-ahead N
// generations ahead, while one purger calls purge_expired() back to back (a pause of half a
// length between calls). Per length it prints calls/s, the calls that failed and why (no
// generation covering now is maintenance falling behind), purge_expired's p50 and longest call,
// and the most partitions seen against retention / length + ahead + 2 (retirement in step).
// bench/generations-sizing.sh runs it (docs/design.md, "Generations", has the figure).
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>

#include "admin.hpp"
#include "options.hpp"

namespace bench {

void generations_sizing(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                        const idem::Fingerprint& fp, std::uint64_t seed);

}  // namespace bench
