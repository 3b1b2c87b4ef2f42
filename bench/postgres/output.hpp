// What idem-bench prints: the matrix's table (a header, then each run as it ends) and the --json file.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "checks.hpp"
#include "matrix.hpp"
#include "options.hpp"
#include "table_size.hpp"

namespace bench {

/// The table's column names.
void print_header();
/// The table's lines for `r`: one per side that ran (a note under it when something was off), then
/// pgbench's when it ran.
void print_run(const Run& r);

/// One of the targets for an async point: `value` (a ratio) against `target`.
struct AsyncTarget {
    std::string what;  ///< what is compared with what, and the figures behind the ratio
    int in_flight = 0;
    Case kind = Case::fresh;
    double value = 0, target = 0;
    bool at_least = true;  ///< value >= target meets it (else value <= target)
    [[nodiscard]] bool met() const { return at_least ? value >= target : value <= target; }
};

/// The targets of the async points: new ops/s >= 3x the floor's best (its most ops/s at any thread
/// count in this run) and >= 0.8x ideal in rounds of N; replay ops/s >= 2x the floor's best; p99 at
/// 64 in flight <= the floor's p99 at 16 threads (each case). Empty without async points.
std::vector<AsyncTarget> async_targets(const std::vector<Run>& runs);
/// Prints them, each met or MISSED (a miss is reported, not an error).
void print_async_targets(const std::vector<Run>& runs);

/// Writes every figure of this run of idem-bench to `path` as JSON; throws when it cannot.
void write_json(const std::string& path, const Options& o, const std::string& server, const std::vector<Run>& runs,
                const std::optional<TableSizeResult>& ts, const std::optional<RssResult>& rss, double rss_mb);

}  // namespace bench
