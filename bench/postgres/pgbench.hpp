// pgbench with a custom script equivalent to one idem call (informational column).
//
// pgbench 15 has no Sync inside a pipeline (\syncpipeline came in 17), so the claim pair is sent as
// \startpipeline INSERT; SELECT \endpipeline: one round trip, one transaction (the SELECT is
// read-only, so the number of commits and WAL flushes is the same as idem's two-Sync claim).
//   new:      claim pair on a random key, then the save UPDATE   (2 round trips, 2 commits)
//   replay:   claim pair on a preloaded completed key            (1 round trip)
//   conflict: claim pair on a preloaded in-progress key          (1 round trip)
// Parameters are sent by pgbench (-M prepared) in text format, idem's in binary.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace bench {

struct PgbenchRun {
    std::string pgbench;  ///< path to the binary
    std::string conninfo;
    std::string table;  ///< unquoted table name
    std::string kind;   ///< "new", "replay" or "conflict"
    int clients = 1;
    int seconds = 1;
    std::int64_t preloaded = 0;  ///< keys preloaded per state (replay / conflict)
    std::string fp_hex;          ///< fingerprint as hex digits
};

/// The script pgbench runs for `run` (also printed by --print-pgbench-scripts).
std::string pgbench_script(const PgbenchRun& run);

/// Runs pgbench; its tps (excluding connection time), or nullopt (with a warning) if it failed.
std::optional<double> run_pgbench(const PgbenchRun& run);

}  // namespace bench
