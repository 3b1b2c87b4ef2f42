// --table-size-check N: what N live rows cost a claim, against an (almost) empty table, for both
// layouts of idem's table — the plain one and generations (PostgresOptions::generations).
// docs/benchmarks.md ("Flat with table size") explains the method.
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "../common/util.hpp"
#include "admin.hpp"
#include "options.hpp"

namespace bench {

/// One table's figures: claims of new keys (each followed by its save, untimed) and claims of
/// preloaded completed keys (replays), each timed alone, with the calling thread's CPU time.
struct TableSizeFigures {
    std::int64_t rows = 0;  ///< completed keys loaded before the check
    std::string size;       ///< table + indexes after the load (every partition), pretty-printed
    Histogram claim, replay;
    /// The plain layout only: the same replays sent by a FloorClient (the library's statements over
    /// raw libpq): how much of a replay's growth with the table is PostgreSQL's own.
    Histogram floor_replay;
    /// Replays of the last quarter of the keys loaded (generations: the current generation's), as
    /// a retry that comes soon after its claim would be.
    Histogram recent_replay;
    std::uint64_t claim_cpu_ns = 0, claim_calls = 0, replay_cpu_ns = 0, replay_calls = 0;
    long long seq_scans = 0;  ///< sequential scans of the table (any partition) during the check
    [[nodiscard]] double claim_cpu_us() const;
    [[nodiscard]] double replay_cpu_us() const;
};

struct TableSizeLayout {
    std::string name;   ///< "plain" or "generations"
    std::string shape;  ///< how the rows are laid out, for the reader
    double load_seconds = 0;
    TableSizeFigures empty, full;
};

struct TableSizeResult {
    std::int64_t rows = 0;
    long long prewarmed_bytes = 0;  ///< read into shared_buffers before measuring (--prewarm), else 0
    std::vector<TableSizeLayout> layouts;
};

/// The ratios full / empty a layout is held to (each <= kTableSizeTarget).
struct TableSizeRatios {
    double claim_p50 = 0, replay_p50 = 0, claim_cpu = 0, replay_cpu = 0;
    double floor_replay_p50 = 0;  ///< 0: no floor figures (generations)
    double recent_replay_p50 = 0;
};
TableSizeRatios table_size_ratios(const TableSizeLayout& l);
inline constexpr double kTableSizeTarget = 1.25;

/// Runs the check (1 thread) on both layouts and prints it.
TableSizeResult table_size_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                                 const idem::Fingerprint& fp, std::uint64_t seed);

}  // namespace bench
