// idem-bench --store redis | tiered: see bench/redis/redis_main.hpp and docs/benchmarks.md ("Redis").
//
// redis: for each thread count T and case, alternating rounds (ABBA) of two sides:
//   floor: T hiredis connections, each sending by hand what RedisStore sends: EVALSHA of the
//          library's claim script (and, for new keys, of its save script) with the same keys and
//          arguments, the scripts loaded with SCRIPT LOAD from src/redis/scripts.hpp;
//   idem:  execute_once through one RedisStore (pool_size = T), no-op effect.
// Each side writes under its own key prefix; both are preloaded with the same completed and
// in-progress records (the hashes the scripts write).
// tiered: replays of preloaded completed keys through PostgresStore alone, CachedStore{RedisReplayCache}
// (the tier filled, untimed, before the first case) and CachedStore{ReplayCache, RedisReplayCache}
// with the memory tier empty at the start of every phase and each key asked once (a hit in Redis,
// copied into memory: the first replay in this process of a key some instance cached).
//
// This file reads the command line and the server, then hands over to the pieces in bench/redis/:
// options.hpp (the command line), raw.hpp (raw hiredis and the housekeeping), sides.hpp (the
// floor's and the library's calls), phase.hpp (a timed phase), stores.hpp (the two runs),
// output.hpp (the table and the JSON).
#include "redis_main.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <idem/idem.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "options.hpp"
#include "output.hpp"
#include "phase.hpp"
#include "raw.hpp"
#include "stores.hpp"

namespace bench {

int redis_main(int argc, char** argv) {
    using namespace redis;  // the pieces in bench/redis/
    Options o = parse(argc, argv);
    if (o.socket.empty() && o.host == "127.0.0.1" && o.port == 6379) {
        if (const char* env = std::getenv("IDEM_TEST_REDIS_SOCKET"); env != nullptr && env[0] != '\0') o.socket = env;
    }
    if (o.store == "tiered" && o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') {
            std::fprintf(stderr,
                         "idem-bench --store tiered needs PostgreSQL: --db CONNINFO or $IDEM_TEST_DATABASE_URL "
                         "(scripts/with-postgres.sh scripts/with-redis.sh idem-bench --store tiered)\n");
            return 2;
        }
        o.db = env;
    }
    try {
        Raw probe(o);
        const Reply info = probe.command({"INFO", "server"});
        const std::string_view server = text(*info);
        const auto version_at = server.find("redis_version:");
        const std::string version(
            version_at == std::string_view::npos
                ? std::string_view("?")
                : server.substr(version_at + 14, server.find('\r', version_at) - version_at - 14));
        const Reply aof = probe.command({"CONFIG", "GET", "appendfsync"});
        const std::string fsync(aof->elements == 2 ? text(*aof->element[1]) : "?");
        std::printf(
            "idem-bench --store %s — Redis %s at %s, appendfsync %s; %u CPUs; %.1f s per case and side in %d "
            "alternating rounds; pool size = threads\n",
            o.store.c_str(), version.c_str(),
            o.socket.empty() ? fmt::format("{}:{}", o.host, o.port).c_str() : o.socket.c_str(), fsync.c_str(),
            std::thread::hardware_concurrency(), o.seconds, o.rounds);
        if (fsync != "always") std::printf("WARNING: appendfsync is not always: not the durable figures\n");
        std::fflush(stdout);
        const idem::Fingerprint fp = idem::fingerprint("idem-bench", 1);
        const std::uint64_t seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                                   (static_cast<std::uint64_t>(::getpid()) << 32);
        const std::vector<Run> runs = o.store == "redis" ? run_redis(o, fp, seed) : run_tiered(o, fp, seed);
        if (!o.json.empty()) write_json(o.json, o, runs);
        if (o.expect_round_trips) {
            if (!(o.store == "redis" ? check_redis(runs) : check_tiered(runs))) return 3;
            std::printf("round trips per call as expected\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-bench: %s\n", e.what());
        return 1;
    }
    return 0;
}

}  // namespace bench
