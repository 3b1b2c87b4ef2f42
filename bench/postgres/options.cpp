// idem-bench's command line: the usage text and the parser (see options.hpp).
#include "options.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "../common/case_list.hpp"
#include "../common/util.hpp"

namespace bench {
namespace {

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s",
                 R"(usage: idem-bench [--db CONNINFO] [options]

Throughput matrix (default):
  --threads LIST          thread counts, each T (the idem sides get a pool of T connections) or T/P
                          (a pool of P < T): default 1,4,16,64/8,64/16
  --pool N                no idem side gets more than N connections (T/P entries above N get N)
  --cases LIST            new,replay,conflict,replay-cached (default: all four)
  --group-commit LIST     the idem side(s): off (idem), on (idem_gc); default off,on
  --no-ideal              skip the ideal-grouping floors (ideal, ideal_threads)
  --seconds N             measured seconds per case and side (library / floor), default 6
  --rounds N              alternating floor/library rounds per case, default 3 (ABBA order)
  --preload N             completed and in-progress keys preloaded for replay/conflict (100000)
  --cached-keys N         replay-cached: every side replays the first N preloaded keys (1000), and
                          the cache is filled with them, untimed, before the case
  --in-flight LIST        the async points: N requests in flight on one io_context thread through
                          one idem::asio::AsyncPostgresStore (async_execute_once, no-op effect, its
                          own group commit), each N a point of its own: default 16,64,256; none:
                          skip them. Cases new, replay, conflict (not replay-cached: no replay cache
                          sits in front of AsyncPostgresStore). Each point alternates, in ABBA order,
                          the async side with the floor at min(N, 16) threads (so the point at 64
                          measures the floor's p99 at 16 threads that it is held to) and ideal in
                          rounds of N calls; the targets compare new and replay calls with the
                          floor's best ops/s at any thread count in the run. Only when idem-bench
                          is built with the idem::asio component (Boost >= 1.81)
  --async-pool N          the AsyncPostgresStore's pool_size (default 8)
  --json FILE             write the figures as JSON
  --pgbench PATH          pgbench binary (default /usr/lib/postgresql/15/bin/pgbench, if present)
  --no-pgbench            skip the pgbench column
  --no-checkpoint         do not CHECKPOINT before each phase
  --expect-round-trips    exit 3 unless every call had the expected outcome and round trips per call
                          are exactly new 2, replay 1, conflict 1 (floor, idem), the same per round
                          (ideal; ideal_threads: plus at most T short last rounds), at most one per
                          preloaded key and thread (replay-cached), at most these (async: its
                          group commit) (the CTest smoke test)
  --print-pgbench-scripts print the pgbench scripts and exit
  --only SIDE             floor, ideal, ideal_threads, idem, idem_gc or async: run one side only (to
                          profile it with perf or strace; no ratio)
  --store-per-thread      diagnostic: one PostgresStore (pool of 1) per thread instead of one
                          shared store with a pool of T: isolates the cost of sharing the pool
  --fingerprint-secret    the idem and async sides' stores key fingerprints
                          (PostgresOptions::fingerprint_secret): compare "cpu us" with a run without
Checks (when given, they run instead of the matrix):
  --table-size-check N    claim p50 (new keys), replay p50 (preloaded completed keys) and client
                          CPU per claim (1 thread) on a table with N live rows vs one with 10000,
                          for both layouts: the plain table and generations of 6 h (the rows
                          spread over the current and 3 older generations); ratios full / empty,
                          target <= 1.25 each; warns about sequential scans
  --prewarm               with --table-size-check: read every table, partition and index of the
                          check into shared_buffers (pg_prewarm) before measuring, so that the
                          figures are those of a cache that holds them (warns if it cannot)
  --seal-check N          client CPU per new call and replay with sealed responses off and on
                          (N-byte bodies, 1 thread, --rounds pairs), and seal() / open_sealed()
  --rss-check             RSS after 100k and after --rss-calls calls (default 1000000),
                          --rss-threads threads (default 4), half replays, half new keys
  --retention-check LAYOUT
                          retention under load on LAYOUT (plain or generations): new calls
                          (execute_once, new keys) on --retention-threads threads (16) with
                          ClaimOptions::retention --retention S (60) for --retention-duration S
                          (1200), purge_expired() every --purge-every S (5; plain: DELETE in
                          batches of 1000; generations: of --generation-length S, 15); every
                          --sample-every S (10): table + index size, WAL per call, calls/s,
                          p50/p99, rows purged; pg_waldump --stats=record over the window from
                          --steady-after S (300) to the end (needs $IDEM_PG_BIN and $IDEM_PG_DATA,
                          as scripts/with-postgres.sh sets them); then 45 s of purges alone, each
                          one's WAL. --json FILE: every sample. bench/retention.sh runs both
                          layouts at once and draws docs/retention.svg
  --generations-sizing MS,MS,...
                          for each generation length (ms): new calls on --retention-threads
                          threads (retention --retention S) for --retention-duration S each, on
                          a table of that length with --generation-ahead N (4) ahead, while
                          purge_expired() runs back to back; prints whether maintenance keeps up
                          (no call without a generation, partitions in step).
                          bench/generations-sizing.sh runs it
Other:
  --keep-tables           leave the bench_<pid>_* tables in place
  --store postgres        this matrix (the default); --store redis | tiered: RedisStore vs a raw-hiredis
                          floor, or the Redis replay tier vs PostgresStore (with idem::redis; see
                          idem-bench --store redis --help)
Without --db: $IDEM_TEST_DATABASE_URL if set, else a throwaway cluster (scripts/with-postgres.sh).
)");
    std::exit(code);
}

long long to_int(const std::string& s, const char* what) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0') {
        std::fprintf(stderr, "idem-bench: %s: not an integer: '%s'\n", what, s.c_str());
        usage(2);
    }
    return v;
}

}  // namespace

Options parse(int argc, char** argv) {
    Options o;
    int pool_cap = 0;  // --pool N: no idem side gets more than N connections
    for (Args args(argc, argv, usage); args.next();) {
        const std::string& arg = args.name();
        const auto value = [&args] { return args.value(); };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--threads") {
            o.threads.clear();
            o.pools.clear();
            for (const auto& t : split(value())) {
                const auto slash = t.find('/');
                o.threads.push_back(static_cast<int>(to_int(t.substr(0, slash), "--threads")));
                o.pools.push_back(
                    slash == std::string::npos ? 0 : static_cast<int>(to_int(t.substr(slash + 1), "--threads")));
            }
            for (std::size_t i = 0; i < o.threads.size(); ++i) {
                if (o.threads[i] < 1 || o.pools[i] < 0 || o.pools[i] > o.threads[i]) usage(2);
            }
            if (o.threads.empty()) usage(2);
        } else if (arg == "--pool") {
            pool_cap = static_cast<int>(to_int(value(), "--pool"));
            if (pool_cap < 1) usage(2);
        } else if (arg == "--cases") {
            std::string unknown;
            auto cases = parse_cases(value(), kCases, unknown);
            if (!cases) {
                std::fprintf(stderr, "idem-bench: unknown case '%s'\n", unknown.c_str());
                usage(2);
            }
            o.cases = std::move(*cases);
        } else if (arg == "--group-commit") {
            o.group_commit.clear();
            for (const auto& v : split(value())) {
                if (v != "on" && v != "off") usage(2);
                o.group_commit.push_back(v == "on");
            }
            if (o.group_commit.empty()) usage(2);
        } else if (arg == "--no-ideal") {
            o.ideal = false;
        } else if (arg == "--seconds") {
            o.seconds = std::strtod(value().c_str(), nullptr);
            if (!(o.seconds > 0)) usage(2);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value(), "--rounds"));
            if (o.rounds < 1) usage(2);
        } else if (arg == "--preload") {
            o.preload = to_int(value(), "--preload");
            if (o.preload < 1) usage(2);
        } else if (arg == "--cached-keys") {
            o.cached_keys = to_int(value(), "--cached-keys");
            if (o.cached_keys < 1) usage(2);
        } else if (arg == "--in-flight") {
            o.in_flight.clear();
            const std::string v = value();
            if (v != "none") {
                for (const auto& n : split(v)) o.in_flight.push_back(static_cast<int>(to_int(n, "--in-flight")));
                if (o.in_flight.empty()) usage(2);
                for (const int n : o.in_flight) {
                    if (n < 1) usage(2);
                }
#ifndef IDEM_BENCH_ASYNC
                std::fprintf(stderr,
                             "idem-bench: --in-flight needs the idem::asio component (Boost >= 1.81); this "
                             "idem-bench is built without it\n");
                std::exit(2);
#endif
            }
        } else if (arg == "--async-pool") {
            o.async_pool = static_cast<int>(to_int(value(), "--async-pool"));
            if (o.async_pool < 1) usage(2);
        } else if (arg == "--json") {
            o.json = value();
        } else if (arg == "--pgbench") {
            o.pgbench = value();
        } else if (arg == "--no-pgbench") {
            o.use_pgbench = false;
        } else if (arg == "--no-checkpoint") {
            o.checkpoint = false;
        } else if (arg == "--keep-tables") {
            o.keep_tables = true;
        } else if (arg == "--expect-round-trips") {
            o.expect_round_trips = true;
        } else if (arg == "--table-size-check") {
            o.table_size_check = to_int(value(), "--table-size-check");
            if (o.table_size_check < 1) usage(2);
        } else if (arg == "--prewarm") {
            o.table_size_prewarm = true;
        } else if (arg == "--seal-check") {
            o.seal_check = to_int(value(), "--seal-check");
            if (o.seal_check < 0) usage(2);
        } else if (arg == "--rss-check") {
            o.rss_check = true;
        } else if (arg == "--rss-calls") {
            o.rss_calls = to_int(value(), "--rss-calls");
            if (o.rss_calls < 200'000) {
                std::fprintf(stderr, "idem-bench: --rss-calls must be at least 200000\n");
                usage(2);
            }
        } else if (arg == "--rss-threads") {
            o.rss_threads = static_cast<int>(to_int(value(), "--rss-threads"));
            if (o.rss_threads < 1) usage(2);
        } else if (arg == "--retention-check") {
            o.retention_check = value();
            if (o.retention_check != "plain" && o.retention_check != "generations") usage(2);
        } else if (arg == "--retention-duration") {
            o.retention_duration = std::strtod(value().c_str(), nullptr);
            if (!(o.retention_duration > 0)) usage(2);
        } else if (arg == "--retention-threads") {
            o.retention_threads = static_cast<int>(to_int(value(), "--retention-threads"));
            if (o.retention_threads < 1) usage(2);
        } else if (arg == "--retention") {
            o.retention_seconds = static_cast<int>(to_int(value(), "--retention"));
            if (o.retention_seconds < 1) usage(2);
        } else if (arg == "--generations-sizing") {
            o.generations_sizing.clear();
            for (const auto& ms : split(value())) {
                o.generations_sizing.push_back(static_cast<int>(to_int(ms, "--generations-sizing")));
                if (o.generations_sizing.back() < 1) usage(2);
            }
        } else if (arg == "--generation-ahead") {
            o.generation_ahead = static_cast<std::size_t>(to_int(value(), "--generation-ahead"));
            if (o.generation_ahead < 1) usage(2);
        } else if (arg == "--generation-length") {
            o.generation_seconds = std::strtod(value().c_str(), nullptr);
            if (!(o.generation_seconds >= 1)) usage(2);
        } else if (arg == "--purge-every") {
            o.purge_every = std::strtod(value().c_str(), nullptr);
            if (!(o.purge_every > 0)) usage(2);
        } else if (arg == "--sample-every") {
            o.sample_every = std::strtod(value().c_str(), nullptr);
            if (!(o.sample_every > 0)) usage(2);
        } else if (arg == "--steady-after") {
            o.steady_after = std::strtod(value().c_str(), nullptr);
            if (!(o.steady_after >= 0)) usage(2);
        } else if (arg == "--only") {
            o.only = value();
            if (o.only != "idem" && o.only != "floor" && o.only != "ideal" && o.only != "ideal_threads" &&
                o.only != "idem_gc" && o.only != "async") {
                usage(2);
            }
        } else if (arg == "--store-per-thread") {
            o.store_per_thread = true;
        } else if (arg == "--fingerprint-secret") {
            o.fingerprint_secret = true;
        } else if (arg == "--store") {
            if (value() != "postgres") usage(2);  // redis / tiered: main() hands over to redis_main
        } else if (arg == "--print-pgbench-scripts") {
            o.print_scripts = true;
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "idem-bench: unknown argument '%s'\n", arg.c_str());
            usage(2);
        }
    }
    if (o.table_size_prewarm && o.table_size_check == 0) {
        std::fprintf(stderr, "idem-bench: --prewarm goes with --table-size-check\n");
        usage(2);
    }
    if (pool_cap > 0) {
        for (std::size_t i = 0; i < o.threads.size(); ++i) {
            const int pool = o.pools[i] > 0 ? o.pools[i] : o.threads[i];
            o.pools[i] = pool > pool_cap ? pool_cap : o.pools[i];
        }
    }
    return o;
}

}  // namespace bench
