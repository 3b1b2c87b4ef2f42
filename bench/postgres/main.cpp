// idem-bench — what execute_once costs over PostgreSQL, next to the same statements sent raw.
//
//   idem-bench [--db CONNINFO] [--threads 1,4,16] [--seconds N] [--json FILE] [...]
//
// For each thread count and case (new / replay / conflict / replay-cached) it runs, in the same
// process and on the same server, alternating short rounds of these sides:
//   floor:   the same prepared statements over raw libpq, one pipelined connection per thread, one
//            transaction per call (bench/postgres/floor.hpp);
//   ideal:   "ideal grouping": the library's batch statements by hand on one connection, a whole
//            round of `threads` calls in one claim (and one save) statement (bench/postgres/floor.hpp);
//   ideal_threads: the same rounds, but each call made by its own thread, as callers of
//            execute_once are: every round waits until all `threads` callers have arrived (a perfect
//            gather), the last one sends it, and the others are woken with its answer: perfect
//            rounds for blocking callers, handoffs included, never two rounds at once;
//   idem:    execute_once through a PostgresStore (pool size = threads, or P for --threads T/P),
//            no-op effect, group commit off; idem_gc: the same with group commit on
//            (--group-commit); replay-cached: both through a CachedStore (the in-process replay cache);
// and, when pgbench is installed, pgbench with an equivalent script (informational). Then, when
// built with the idem::asio component (IDEM_BENCH_ASYNC), the async points (--in-flight 16,64,256):
//   async:   one io_context thread, one idem::asio::AsyncPostgresStore, N requests in flight
//            (async_execute_once, no-op effect, the store's own group commit; bench/postgres/async_side.hpp),
//            each N a point of its own for new / replay / conflict (replay-cached has no async
//            counterpart), alternated with the floor at min(N, 16) threads and ideal in rounds of N;
//            the targets (new >= 3x the floor's best and >= 0.8x ideal, replay >= 2x the
//            floor's best, p99 at 64 in flight <= the floor's p99 at 16 threads) are printed, met or
//            missed, without failing the run.
// Each side's phases also record WAL bytes and commit records per call (pg_current_wal_lsn,
// pg_walinspect).
// Without --db it uses $IDEM_TEST_DATABASE_URL, else re-executes itself under
// scripts/with-postgres.sh (a throwaway cluster). docs/benchmarks.md explains the method and
// holds the latest figures. --help lists every option.
//
// This file wires the pieces together: options.hpp (the command line), phase.hpp (a timed phase),
// sides.hpp (each side's calls), matrix.hpp (the matrix and its figures), checks.hpp (the checks),
// table_size.hpp (--table-size-check), retention.hpp (--retention-check), output.hpp (the table and
// the JSON); --store redis | tiered hands over to ../redis/redis_main.hpp.
#include <unistd.h>
#include <idem/idem.hpp>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "admin.hpp"
#include "checks.hpp"
#include "floor.hpp"
#include "generations_sizing.hpp"
#include "matrix.hpp"
#include "options.hpp"
#include "output.hpp"
#include "pgbench.hpp"
#include "postgres/sansio/sql.hpp"  // internal: only to check that the floor's copy of the SQL is current
#include "retention.hpp"
#include "seal_check.hpp"
#include "table_size.hpp"
#ifdef IDEM_BENCH_REDIS
#include "../redis/redis_main.hpp"  // --store redis | tiered (bench/redis/)
#endif

#ifndef IDEM_BENCH_WITH_POSTGRES
#define IDEM_BENCH_WITH_POSTGRES ""
#endif

namespace {

using namespace bench;

// No --db and no IDEM_TEST_DATABASE_URL: run again under scripts/with-postgres.sh, which starts a
// throwaway cluster, exports IDEM_TEST_DATABASE_URL, and removes the cluster when we exit.
[[noreturn]] void reexec_under_with_postgres(int argc, char** argv) {
    const char* script = IDEM_BENCH_WITH_POSTGRES;
    if (script[0] == '\0' || ::access(script, X_OK) != 0) {
        std::fprintf(stderr, "idem-bench: no --db given and %s is missing; pass --db CONNINFO\n",
                     script[0] ? script : "scripts/with-postgres.sh");
        std::exit(2);
    }
    char self[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        std::perror("idem-bench: readlink /proc/self/exe");
        std::exit(2);
    }
    self[n] = '\0';
    std::vector<char*> args{const_cast<char*>(script), const_cast<char*>("--"), self};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    std::fprintf(stderr, "idem-bench: no --db: running under %s\n", script);
    std::fflush(stderr);
    ::execv(script, args.data());
    std::perror("idem-bench: exec with-postgres.sh");
    std::exit(2);
}

// The floor's copy of the SQL must be what the library prepares, or the ratio means nothing.
bool floor_sql_is_current() {
    const std::string name = "bench_sql_check";
    const auto defs = idem::pg::statements(idem::pg::TableName::parse(name));
    const FloorSql copy = floor_sql(quote_ident(name));
    bool ok = true;
    const auto check = [&](idem::pg::Stmt s, const std::string& expected_name, const std::string& sql,
                           const std::vector<Oid>& types) {
        if (defs[s].name != expected_name || defs[s].sql != sql || defs[s].param_types != types) {
            std::fprintf(
                stderr,
                "error: bench/postgres/floor.cpp's statement differs from the library's (name, SQL or parameter "
                "types):\n  library: %s: %s\n  floor:   %s: %s\n",
                defs[s].name.c_str(), defs[s].sql.c_str(), expected_name.c_str(), sql.c_str());
            ok = false;
        }
    };
    check(idem::pg::kClaimInsert, copy.claim_name, copy.claim, copy.claim_types);
    check(idem::pg::kSelect, copy.select_name, copy.select, copy.select_types);
    check(idem::pg::kSave, copy.save_name, copy.save, copy.save_types);
    check(idem::pg::kClaimBatchInsert, copy.claim_batch_name, copy.claim_batch, copy.claim_batch_types);
    check(idem::pg::kSelectBatch, copy.select_batch_name, copy.select_batch, copy.select_batch_types);
    check(idem::pg::kSaveBatch, copy.save_batch_name, copy.save_batch, copy.save_batch_types);
    return ok;
}

// The value of --store (postgres when not given).
std::string store_arg(int argc, char** argv) {
    std::string store = "postgres";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--store" && i + 1 < argc) store = argv[++i];
        if (a.rfind("--store=", 0) == 0) store = a.substr(8);
    }
    return store;
}

}  // namespace

int main(int argc, char** argv) {
    if (const std::string store = store_arg(argc, argv); store != "postgres") {
#ifdef IDEM_BENCH_REDIS
        return bench::redis_main(argc, argv);
#else
        std::fprintf(stderr, "idem-bench: --store %s needs the idem::redis component (-DIDEM_REDIS=ON)\n",
                     store.c_str());
        return 2;
#endif
    }
    Options o = parse(argc, argv);
    if (o.print_scripts) {
        for (const char* kind : {"new", "replay", "conflict"}) {
            std::printf("-- %s\n%s\n", kind,
                        pgbench_script(PgbenchRun{o.pgbench, "", "idem_keys", kind, 1, 1, o.preload, ""}).c_str());
        }
        return 0;
    }
    if (o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') reexec_under_with_postgres(argc, argv);
        o.db = env;
    }
    if (!floor_sql_is_current()) return 3;

    try {
        Admin admin(o.db);
        const std::string server = admin.server_summary();
        std::printf("idem-bench %s — %s\n", idem::version_string, server.c_str());
        if (admin.setting("synchronous_commit") != "on") {
            std::printf(
                "WARNING: synchronous_commit is not on: acknowledged claims can be lost in a crash, and "
                "these figures are not the durable ones\n");
        }
        if (o.retention_check.empty() && o.generations_sizing.empty()) {
            std::printf("%u CPUs; %.1f s per case and side in %d alternating rounds; pool size = threads\n",
                        std::thread::hardware_concurrency(), o.seconds, o.rounds);
        } else {
            std::printf("%u CPUs\n", std::thread::hardware_concurrency());
        }
        if (o.fingerprint_secret) std::printf("idem and async sides: keyed fingerprints (--fingerprint-secret)\n");
        std::fflush(stdout);

        const idem::Fingerprint fp = idem::fingerprint("idem-bench", 1);
        const std::string prefix = "bench_" + std::to_string(::getpid());
        std::uint64_t seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                             (static_cast<std::uint64_t>(::getpid()) << 32);
        Tables tables{admin, {}, o.keep_tables};

        if (!o.retention_check.empty()) {
            retention_check(o, admin, tables, prefix, fp, seed);  // writes its own --json
            return 0;
        }
        if (!o.generations_sizing.empty()) {
            generations_sizing(o, admin, tables, prefix, fp, seed);
            return 0;
        }
        std::vector<Run> runs;
        std::optional<TableSizeResult> ts;
        std::optional<RssResult> rss;
        if (o.table_size_check > 0 || o.rss_check || o.seal_check > 0) {
            if (o.seal_check > 0) seal_check(o, admin, tables, prefix, seed);
            if (o.table_size_check > 0) ts = table_size_check(o, admin, tables, prefix, fp, seed);
            if (o.rss_check) rss = rss_check(o, admin, tables, prefix, fp, seed ^ 0xABCDEFull);
        } else {
            runs = run_matrix(o, admin, tables, prefix, fp, seed);
            print_async_targets(runs);
        }
        const double rss_mb = memory_now().peak_mb;
        std::printf("peak RSS of idem-bench: %.1f MB\n", rss_mb);
        if (!o.json.empty()) write_json(o.json, o, server, runs, ts, rss, rss_mb);

        if (o.expect_round_trips) {
            if (!round_trips_as_expected(o, runs)) return 3;
            std::printf(
                "round trips per call as expected (new 2, replay 1, conflict 1; ideal per round; replay-cached at most "
                "one per key; async at most these)\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-bench: %s\n", e.what());
        return 1;
    }
    return 0;
}
