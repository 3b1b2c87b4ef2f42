// The command line of idem-bench --store redis | tiered (see options.hpp).
#include "options.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "../common/case_list.hpp"
#include "../common/util.hpp"

namespace bench::redis {
namespace {

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s", R"(usage: idem-bench --store redis|tiered [options]

  --store redis           execute_once over a RedisStore (new, replay, conflict) vs a raw-hiredis
                          floor sending the same EVALSHA commands, one connection per thread
  --store tiered          replays: PostgresStore vs CachedStore{RedisReplayCache} and
                          CachedStore{ReplayCache, RedisReplayCache} in front of it (needs PostgreSQL:
                          --db CONNINFO or $IDEM_TEST_DATABASE_URL, e.g. under scripts/with-postgres.sh)
  --redis-socket PATH     the server's unix socket (default $IDEM_TEST_REDIS_SOCKET, e.g. under
                          scripts/with-redis.sh)
  --redis-host H, --redis-port P   TCP instead (127.0.0.1, 6379)
  --threads LIST          thread counts (default 1,4,16)
  --cases LIST            redis: new,replay,conflict (default all)
  --seconds N             measured seconds per case and side (default 6)
  --rounds N              alternating rounds per case (default 3)
  --preload N             completed (and, redis, in-progress) keys per side (default 100000)
  --json FILE             the figures as JSON
  --only SIDE             run one side only, to profile it (redis: floor, idem; tiered: postgres,
                          redis, memory+redis); no ratio
  --expect-round-trips    exit 3 unless every call had the expected outcome and round trips per call
                          are new 2 / replay 1 / conflict 1 (redis), 1 for PostgresStore's replays and
                          0 to the primary for the tiers (tiered)
)");
    std::exit(code);
}

long long to_int(const std::string& s) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (end == s.c_str() || *end != '\0') usage(2);
    return v;
}

}  // namespace

Options parse(int argc, char** argv) {
    Options o;
    for (Args args(argc, argv, usage); args.next();) {
        const std::string& arg = args.name();
        const auto value = [&args] { return args.value(); };
        if (arg == "--store") {
            o.store = value();
        } else if (arg == "--redis-socket") {
            o.socket = value();
        } else if (arg == "--redis-host") {
            o.host = value();
        } else if (arg == "--redis-port") {
            o.port = static_cast<int>(to_int(value()));
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--threads") {
            o.threads.clear();
            for (const auto& t : split(value())) o.threads.push_back(static_cast<int>(to_int(t)));
            if (o.threads.empty() || std::any_of(o.threads.begin(), o.threads.end(), [](int t) { return t < 1; }))
                usage(2);
        } else if (arg == "--cases") {
            std::string unknown;
            auto cases = parse_cases(value(), kCases, unknown);
            if (!cases) usage(2);
            o.cases = std::move(*cases);
        } else if (arg == "--seconds") {
            o.seconds = std::strtod(value().c_str(), nullptr);
            if (!(o.seconds > 0)) usage(2);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value()));
            if (o.rounds < 1) usage(2);
        } else if (arg == "--preload") {
            o.preload = to_int(value());
            if (o.preload < 1) usage(2);
        } else if (arg == "--json") {
            o.json = value();
        } else if (arg == "--expect-round-trips") {
            o.expect_round_trips = true;
        } else if (arg == "--only") {
            o.only = value();
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "idem-bench --store %s: unknown argument '%s'\n", o.store.c_str(), arg.c_str());
            usage(2);
        }
    }
    if (o.store != "redis" && o.store != "tiered") usage(2);
    return o;
}

idem::RedisOptions redis_options(const Options& o) {
    idem::RedisOptions r;
    r.unix_socket = o.socket;
    r.host = o.host;
    r.port = o.port;
    return r;
}

}  // namespace bench::redis
