// idem-bench --store redis | tiered (bench/redis/; built only with the idem::redis component).
//
//   redis:  execute_once over a RedisStore, new / replay / conflict, next to a raw-hiredis floor
//           that sends the same EVALSHA commands (the library's own Lua scripts) by hand, one
//           connection per thread.
//   tiered: replays through CachedStore{RedisReplayCache} and CachedStore{ReplayCache,
//           RedisReplayCache} in front of PostgresStore, next to PostgresStore's own replays.
// docs/benchmarks.md, section "Redis", explains the method and holds the figures.
#pragma once

namespace bench {

/// Runs idem-bench with `--store redis` or `--store tiered` (argv as main's). Returns the exit code.
int redis_main(int argc, char** argv);

}  // namespace bench
