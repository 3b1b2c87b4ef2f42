// idem-bench — what execute_once costs over PostgreSQL, next to the same statements sent raw.
//
//   idem-bench [--db CONNINFO] [--threads 1,4,16] [--seconds N] [--json FILE] [...]
//
// For each thread count and case (new / replay / conflict / replay-cached) it runs, in the same
// process and on the same server, alternating short rounds of these sides:
//   floor:   the same prepared statements over raw libpq, one pipelined connection per thread, one
//            transaction per call (bench/floor.hpp);
//   ideal:   "ideal grouping": the library's batch statements by hand on one connection, a whole
//            round of `threads` calls in one claim (and one save) statement (bench/floor.hpp);
//   ideal_threads: the same rounds, but each call made by its own thread, as callers of
//            execute_once are: every round waits until all `threads` callers have arrived (a perfect
//            gather), the last one sends it, and the others are woken with its answer: perfect
//            rounds for blocking callers, handoffs included, never two rounds at once;
//   idem:    execute_once through a PostgresStore (pool size = threads), no-op effect, group commit
//            off; idem_gc: the same with group commit on (--group-commit); replay-cached: both
//            through a CachedStore (the in-process replay cache);
// and, when pgbench is installed, pgbench with an equivalent script (informational). Each side's
// phases also record WAL bytes and commit records per call (pg_current_wal_lsn, pg_walinspect).
// Without --db it uses $IDEM_TEST_DATABASE_URL, else re-executes itself under
// scripts/with-postgres.sh (a throwaway cluster). docs/benchmarks.md explains the method and
// holds the latest figures. --help lists every option.
#include <fmt/format.h>
#include <unistd.h>
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "admin.hpp"
#include "floor.hpp"
#include "pgbench.hpp"
#include "postgres/sql.hpp"  // internal: only to check that the floor's copy of the SQL is current
#include "util.hpp"
#ifdef IDEM_BENCH_REDIS
#include "redis.hpp"  // --store redis | tiered (bench/redis.cpp)
#endif

#ifndef IDEM_BENCH_WITH_POSTGRES
#define IDEM_BENCH_WITH_POSTGRES ""
#endif
#ifndef IDEM_BENCH_PGBENCH
#define IDEM_BENCH_PGBENCH "/usr/lib/postgresql/15/bin/pgbench"
#endif

namespace {

using namespace bench;

const std::string kScope = "bench";
const std::string kResult = "ok";
// What PostgresStore sends with its default options (default_lease 30 s, default_retention 24 h).
constexpr std::int64_t kLeaseMs = 30'000;
constexpr std::int64_t kRetentionS = 86'400;
constexpr int kWarmupCalls = 3;

enum class Case { fresh, replay, conflict, replay_cached };

const char* case_name(Case c) {
    switch (c) {
        case Case::fresh: return "new";
        case Case::replay: return "replay";
        case Case::conflict: return "conflict";
        case Case::replay_cached: return "replay-cached";
    }
    return "?";
}

/// Round trips per call of one transaction per call (floor, idem); replay-cached: the floor's.
std::uint64_t expected_round_trips(Case c) { return c == Case::fresh ? 2 : 1; }

/// The sides of a case (see the top of this file), in the order of a round's first half.
enum class SideKind { floor, ideal, ideal_threads, idem, idem_gc };

const char* side_name(SideKind k) {
    switch (k) {
        case SideKind::floor: return "floor";
        case SideKind::ideal: return "ideal";
        case SideKind::ideal_threads: return "ideal_threads";
        case SideKind::idem: return "idem";
        case SideKind::idem_gc: return "idem_gc";
    }
    return "?";
}

// TODO-MERGE: PostgresOptions::group_commit comes with the group-commit branch. Until it is merged
// the option does not exist and idem-bench runs the idem side only as it is today (group commit
// "off"); once it exists this compiles the assignment in, with no edit here.
template <class Options>
concept HasGroupCommit = requires(Options& o) {
    o.group_commit = true;
};

/// Sets group commit on or off; false when this build of idem cannot do what was asked.
template <class Options>
bool set_group_commit(Options& options, bool on) {
    if constexpr (HasGroupCommit<Options>) {
        options.group_commit = on;
        return true;
    } else {
        return !on;
    }
}

struct Options {
    std::string db;
    std::vector<int> threads{1, 4, 16};
    std::vector<Case> cases{Case::fresh, Case::replay, Case::conflict, Case::replay_cached};
    std::vector<bool> group_commit{false, true};  ///< idem side(s): group commit off (idem), on (idem_gc)
    bool ideal = true;                            ///< run the ideal-grouping floor
    double seconds = 6;
    int rounds = 3;
    std::string json;
    std::string pgbench = IDEM_BENCH_PGBENCH;
    bool use_pgbench = true;
    std::int64_t preload = 100'000;
    std::int64_t cached_keys = 1000;  ///< replay-cached: the hot keys (the first N preloaded completed ones)
    bool checkpoint = true;
    bool keep_tables = false;
    bool expect_round_trips = false;
    std::int64_t table_size_check = 0;
    bool rss_check = false;
    std::int64_t rss_calls = 1'000'000;
    int rss_threads = 4;
    bool print_scripts = false;
    std::string only;               ///< a side name: run that side only (for profiling; no ratio)
    bool store_per_thread = false;  ///< diagnostic: T stores with a pool of 1 instead of one pool of T
};

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s",
                 R"(usage: idem-bench [--db CONNINFO] [options]

Throughput matrix (default):
  --threads LIST          thread counts, e.g. 1,4,16 (default)
  --cases LIST            new,replay,conflict,replay-cached (default: all four)
  --group-commit LIST     the idem side(s): off (idem), on (idem_gc); default off,on. "on" is
                          skipped (with a note) while PostgresOptions::group_commit does not exist
  --no-ideal              skip the ideal-grouping floors (ideal, ideal_threads)
  --seconds N             measured seconds per case and side (library / floor), default 6
  --rounds N              alternating floor/library rounds per case, default 3 (ABBA order)
  --preload N             completed and in-progress keys preloaded for replay/conflict (100000)
  --cached-keys N         replay-cached: every side replays the first N preloaded keys (1000), and
                          the cache is filled with them, untimed, before the case
  --json FILE             write the figures as JSON
  --pgbench PATH          pgbench binary (default /usr/lib/postgresql/15/bin/pgbench, if present)
  --no-pgbench            skip the pgbench column
  --no-checkpoint         do not CHECKPOINT before each phase
  --expect-round-trips    exit 3 unless every call had the expected outcome and round trips per call
                          are exactly new 2, replay 1, conflict 1 (floor, idem), the same per round
                          (ideal; ideal_threads: plus at most T short last rounds), at most one per
                          preloaded key and thread (replay-cached) (the CTest smoke test)
  --print-pgbench-scripts print the pgbench scripts and exit
  --only SIDE             floor, ideal, ideal_threads, idem or idem_gc: run one side only (to
                          profile it with perf or strace; no ratio)
  --store-per-thread      diagnostic: one PostgresStore (pool of 1) per thread instead of one
                          shared store with a pool of T: isolates the cost of sharing the pool
Checks (when given, they run instead of the matrix):
  --table-size-check N    claim p50 (1 thread, new keys) on an empty table vs one with N rows
  --rss-check             RSS after 100k and after --rss-calls calls (default 1000000),
                          --rss-threads threads (default 4), half replays, half new keys
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

Options parse(int argc, char** argv) {
    Options o;
    for (Args args(argc, argv, usage); args.next();) {
        const std::string& arg = args.name();
        const auto value = [&args] { return args.value(); };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--threads") {
            o.threads.clear();
            for (const auto& t : split(value())) o.threads.push_back(static_cast<int>(to_int(t, "--threads")));
            if (o.threads.empty() || std::any_of(o.threads.begin(), o.threads.end(), [](int t) { return t < 1; })) {
                usage(2);
            }
        } else if (arg == "--cases") {
            o.cases.clear();
            for (const auto& c : split(value())) {
                if (c == "new") {
                    o.cases.push_back(Case::fresh);
                } else if (c == "replay") {
                    o.cases.push_back(Case::replay);
                } else if (c == "conflict") {
                    o.cases.push_back(Case::conflict);
                } else if (c == "replay-cached") {
                    o.cases.push_back(Case::replay_cached);
                } else {
                    std::fprintf(stderr, "idem-bench: unknown case '%s'\n", c.c_str());
                    usage(2);
                }
            }
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
        } else if (arg == "--only") {
            o.only = value();
            if (o.only != "idem" && o.only != "floor" && o.only != "ideal" && o.only != "ideal_threads" &&
                o.only != "idem_gc") {
                usage(2);
            }
        } else if (arg == "--store-per-thread") {
            o.store_per_thread = true;
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
    return o;
}

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
            std::fprintf(stderr,
                         "error: bench/floor.cpp's statement differs from the library's (name, SQL or parameter "
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

// ---- phases -------------------------------------------------------------------------------------

struct Counters {
    std::uint64_t round_trips = 0, retries = 0, opened = 0;
    /// Group commit (StoreStats; zeros without it). largest_*: since the store was made.
    std::uint64_t claim_groups = 0, grouped_claims = 0, largest_claim_group = 0;
    std::uint64_t save_groups = 0, grouped_saves = 0, largest_save_group = 0;
    std::uint64_t wal_lsn = 0;  ///< set by run_phase (Admin::wal_lsn), not by the side's snapshot
};

/// after - before for the counts; the largest groups as of `after`.
Counters counters_delta(const Counters& after, const Counters& before) {
    Counters d;
    d.round_trips = after.round_trips - before.round_trips;
    d.retries = after.retries - before.retries;
    d.opened = after.opened - before.opened;
    d.claim_groups = after.claim_groups - before.claim_groups;
    d.grouped_claims = after.grouped_claims - before.grouped_claims;
    d.largest_claim_group = after.largest_claim_group;
    d.save_groups = after.save_groups - before.save_groups;
    d.grouped_saves = after.grouped_saves - before.grouped_saves;
    d.largest_save_group = after.largest_save_group;
    return d;
}

double process_cpu_seconds() {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

struct PhaseResult {
    std::uint64_t calls = 0, unexpected = 0;
    double seconds = 0;
    double cpu_seconds = 0;  ///< this process's CPU time during the phase (client side only)
    Counters delta;
    std::uint64_t lsn_from = 0, lsn_to = 0;  ///< WAL positions when the timed calls began and ended
    Histogram hist;
};

// Runs `op(thread, rng)` (true = the expected outcome) on `threads` threads for `seconds`, after
// kWarmupCalls untimed calls per thread. `snapshot()` is read when every thread is ready and again
// after the last one stopped, so the counters cover exactly the timed calls.
template <class Op, class Snapshot>
PhaseResult run_phase(Admin& admin, int threads, double seconds, std::uint64_t seed, Op& op, Snapshot snapshot) {
    const auto n = static_cast<std::size_t>(threads);
    auto hists = std::make_unique<Histogram[]>(n);
    std::vector<std::uint64_t> calls(n, 0), unexpected(n, 0);
    std::atomic<bool> stop{false};
    std::mutex error_mutex;
    std::string error;
    const auto fail = [&](const char* what) {
        std::lock_guard lock(error_mutex);
        if (error.empty()) error = what;
        stop.store(true);
    };
    Counters before;
    Clock::time_point start;
    double cpu_start = 0;
    std::string wal_error;
    // The WAL position from the admin connection (untimed: read before the clock starts). Only this
    // completion step and the main thread use `admin`, never at once.
    const auto wal_lsn = [&]() noexcept -> std::uint64_t {
        try {
            return admin.wal_lsn();
        } catch (const std::exception& e) {
            wal_error = e.what();
            return 0;
        }
    };
    auto on_ready = [&]() noexcept {
        before = snapshot();
        before.wal_lsn = wal_lsn();
        cpu_start = process_cpu_seconds();
        start = Clock::now();
    };
    std::barrier ready(threads + 1, on_ready);
    // An op whose callers wait for one another (ideal_threads) is told when one stops calling.
    const auto leave = [&op](std::size_t t) noexcept {
        if constexpr (requires { op.leave(0); }) op.leave(static_cast<int>(t));
    };
    std::vector<std::thread> workers;
    workers.reserve(n);
    for (std::size_t t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, t);
            bool ok = true;
            try {
                for (int i = 0; i < kWarmupCalls; ++i) (void)op(static_cast<int>(t), rng);
            } catch (const std::exception& e) {
                fail(e.what());
                ok = false;
                leave(t);  // before the barrier: the others' rounds must not wait for this thread
            }
            ready.arrive_and_wait();
            if (!ok) return;
            std::uint64_t done = 0, bad = 0;
            Histogram& h = hists[t];
            try {
                while (!stop.load(std::memory_order_relaxed)) {
                    const auto t0 = Clock::now();
                    const bool good = op(static_cast<int>(t), rng);
                    const auto t1 = Clock::now();
                    h.record(static_cast<std::uint64_t>(std::chrono::nanoseconds(t1 - t0).count()));
                    ++done;
                    if (!good) ++bad;
                }
            } catch (const std::exception& e) {
                fail(e.what());
            }
            leave(t);
            calls[t] = done;
            unexpected[t] = bad;
        });
    }
    ready.arrive_and_wait();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (!stop.load() && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(10), deadline - Clock::now()));
    }
    stop.store(true);
    for (auto& w : workers) w.join();
    const auto end = Clock::now();
    const double cpu_end = process_cpu_seconds();
    if (!error.empty()) throw std::runtime_error(error);
    Counters after = snapshot();
    after.wal_lsn = wal_lsn();
    if (!wal_error.empty()) throw std::runtime_error(wal_error);

    PhaseResult r;
    r.seconds = seconds_between(start, end);
    r.cpu_seconds = cpu_end - cpu_start;
    for (std::size_t t = 0; t < n; ++t) {
        r.calls += calls[t];
        r.unexpected += unexpected[t];
        r.hist.merge(hists[t]);
    }
    r.delta = counters_delta(after, before);
    r.lsn_from = before.wal_lsn;
    r.lsn_to = after.wal_lsn;
    return r;
}

Counters library_counters(const idem::IdempotencyStore& store) {
    const auto s = store.stats();
    Counters c;
    c.round_trips = s.round_trips;
    c.retries = s.retries;
    c.opened = s.connections_opened;
    c.claim_groups = s.claim_groups;
    c.grouped_claims = s.grouped_claims;
    c.largest_claim_group = s.largest_claim_group;
    c.save_groups = s.save_groups;
    c.grouped_saves = s.grouped_saves;
    c.largest_save_group = s.largest_save_group;
    return c;
}

// Opens the whole pool before anything is timed (the pool opens connections lazily).
void prewarm(idem::PostgresStore& store, int threads) {
    const idem::Key key(kScope, "warm-up");
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&] {
            while (store.stats().connections_opened < static_cast<std::uint64_t>(threads) && Clock::now() < deadline) {
                (void)store.read(key);
            }
        });
    }
    for (auto& w : workers) w.join();
}

struct LibraryOp {
    std::vector<idem::IdempotencyStore*> stores;  // one shared store, or one per thread (diagnostic)
    const idem::Fingerprint& fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int thread, Rng& rng) const {
        idem::IdempotencyStore& store = *stores[static_cast<std::size_t>(thread) % stores.size()];
        const auto effect = [] { return kResult; };  // the no-op effect
        switch (kind) {
            case Case::fresh: {
                const idem::Key key(kScope, random_hex_key(rng));
                return idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::executed;
            }
            case Case::replay:
            case Case::replay_cached: {
                const idem::Key key(kScope,
                                    preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(preloaded))));
                const auto r = idem::execute_once(store, key, fp, effect);
                return r.outcome() == idem::Outcome::replayed && r.response() == kResult;
            }
            case Case::conflict: {
                const idem::Key key(kScope,
                                    preloaded_key(kConflictBase, rng.below(static_cast<std::uint64_t>(preloaded))));
                return idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::in_progress;
            }
        }
        return false;
    }
};

struct FloorOp {
    std::vector<std::unique_ptr<FloorClient>>& clients;
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int thread, Rng& rng) const {
        FloorClient& c = *clients[static_cast<std::size_t>(thread)];
        const std::int64_t fence = random_fence(rng);
        switch (kind) {
            case Case::fresh: {
                const std::string key = random_hex_key(rng);
                if (c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) != FloorClient::Answer::claimed) {
                    return false;
                }
                return c.save(kScope, key, fence, kResult);
            }
            case Case::replay:
            case Case::replay_cached: {
                const std::string key = preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(preloaded)));
                return c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) == FloorClient::Answer::completed;
            }
            case Case::conflict: {
                const std::string key = preloaded_key(kConflictBase, rng.below(static_cast<std::uint64_t>(preloaded)));
                return c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) == FloorClient::Answer::in_progress;
            }
        }
        return false;
    }
};

// The key of one call of the ideal floors: a new random one, or one of the `preloaded` keys of the
// case (an index is drawn for every case, so that the random streams stay the same).
std::string case_key(Case kind, std::int64_t preloaded, Rng& rng) {
    const auto pick = rng.below(static_cast<std::uint64_t>(preloaded));
    return kind == Case::fresh      ? random_hex_key(rng)
           : kind == Case::conflict ? preloaded_key(kConflictBase, pick)
                                    : preloaded_key(kReplayBase, pick);
}

// One round of `group` calls through the ideal-grouping client (run on one thread; run_matrix
// multiplies the calls by `group`).
struct IdealOp {
    IdealClient* client;  // null when --no-ideal (then never called)
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;
    std::size_t group;
    std::vector<std::string>& keys;
    std::vector<std::int64_t>& fences;

    bool operator()(int, Rng& rng) const {
        keys.clear();
        fences.clear();
        for (std::size_t i = 0; i < group; ++i) {
            keys.push_back(case_key(kind, preloaded, rng));
            fences.push_back(random_fence(rng));
        }
        std::sort(keys.begin(), keys.end());  // as PostgresStore sorts a batch
        const auto c = client->claim(kScope, keys, fp, 1, fences, kLeaseMs, kRetentionS);
        switch (kind) {
            case Case::fresh: return c.inserted == group && client->save(kScope, keys, fences, kResult) == group;
            case Case::replay:
            case Case::replay_cached: return c.inserted == 0 && c.completed == group;
            case Case::conflict: return c.inserted == 0 && c.in_progress == group;
        }
        return false;
    }
};

// The ideal rounds made by `threads` blocking callers, one call each (the "ideal_threads" side):
// each caller puts its key into the round and waits; the last to arrive sends the round's statement
// on the one connection and wakes the rest. A caller that stops (the phase is over) leaves, and the
// rounds go on without it, so nobody waits for a caller that will not come.
class IdealGather {
public:
    IdealGather(IdealClient* client, std::size_t callers) : client_(client), callers_(callers) {}

    /// Adds (key, fence) to the current round of `phase` (0 claim, 1 save) and returns once it was
    /// sent: true when the round had the outcome `kind` expects for every call.
    bool arrive(int phase, Case kind, std::string key, std::int64_t fence, std::string_view fp) {
        std::unique_lock lock(mutex_);
        // Callers move in lockstep: a caller a round ahead (a save after the others' claims) cannot
        // exist, since everyone waits for everyone.
        round_.emplace_back(std::move(key), fence);
        phase_ = phase;
        kind_ = kind;
        fp_ = fp;
        const std::uint64_t mine = generation_;
        if (round_.size() == callers_) {
            send(lock);
        } else {
            cv_.wait(lock, [&] { return generation_ != mine; });
        }
        if (!error_.empty()) throw std::runtime_error(error_);
        return good_;
    }

    /// This caller makes no more calls (also after an error).
    void leave() noexcept {
        std::unique_lock lock(mutex_);
        --callers_;
        if (!round_.empty() && round_.size() == callers_) send(lock);
    }

private:
    // Sends the round (the caller holds the lock) and wakes its callers; a failure reaches each of them.
    void send(std::unique_lock<std::mutex>&) noexcept {
        const std::size_t n = round_.size();
        try {
            std::sort(round_.begin(), round_.end());  // as PostgresStore sorts a batch
            keys_.clear();
            fences_.clear();
            for (auto& [k, f] : round_) {
                keys_.push_back(k);
                fences_.push_back(f);
            }
            if (phase_ == 0) {
                const auto c = client_->claim(kScope, keys_, fp_, 1, fences_, kLeaseMs, kRetentionS);
                good_ = kind_ == Case::fresh      ? c.inserted == n
                        : kind_ == Case::conflict ? c.inserted == 0 && c.in_progress == n
                                                  : c.inserted == 0 && c.completed == n;
            } else {
                good_ = client_->save(kScope, keys_, fences_, kResult) == n;
            }
        } catch (const std::exception& e) {
            error_ = e.what();
        }
        round_.clear();
        ++generation_;
        cv_.notify_all();
    }

    IdealClient* client_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::size_t callers_;
    std::vector<std::pair<std::string, std::int64_t>> round_;
    std::vector<std::string> keys_;
    std::vector<std::int64_t> fences_;
    std::uint64_t generation_ = 0;
    int phase_ = 0;
    Case kind_ = Case::fresh;
    std::string_view fp_;
    bool good_ = false;
    std::string error_;
};

struct IdealThreadsOp {
    IdealGather& gather;
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int, Rng& rng) const {
        std::string key = case_key(kind, preloaded, rng);
        const std::int64_t fence = random_fence(rng);
        const bool claimed = gather.arrive(0, kind, key, fence, fp);
        if (kind != Case::fresh) return claimed;
        return gather.arrive(1, kind, std::move(key), fence, fp) && claimed;  // the no-op effect, then the save
    }
    void leave(int) const noexcept { gather.leave(); }
};

struct Side {
    SideKind kind = SideKind::floor;
    std::uint64_t calls = 0, unexpected = 0;
    std::uint64_t wal_bytes = 0;
    std::optional<std::uint64_t> commits;  ///< commit records (pg_walinspect), if available
    double seconds = 0, cpu_seconds = 0;
    Counters counters;
    Histogram hist;

    void add(const PhaseResult& r) {
        calls += r.calls;
        unexpected += r.unexpected;
        seconds += r.seconds;
        cpu_seconds += r.cpu_seconds;
        counters.round_trips += r.delta.round_trips;
        counters.retries += r.delta.retries;
        counters.opened += r.delta.opened;
        counters.claim_groups += r.delta.claim_groups;
        counters.grouped_claims += r.delta.grouped_claims;
        counters.largest_claim_group = std::max(counters.largest_claim_group, r.delta.largest_claim_group);
        counters.save_groups += r.delta.save_groups;
        counters.grouped_saves += r.delta.grouped_saves;
        counters.largest_save_group = std::max(counters.largest_save_group, r.delta.largest_save_group);
        hist.merge(r.hist);
    }
    [[nodiscard]] bool ran() const { return calls > 0 || seconds > 0; }
    [[nodiscard]] double per_call(double total) const { return calls > 0 ? total / static_cast<double>(calls) : 0; }
    [[nodiscard]] double wal_bytes_per_call() const { return per_call(static_cast<double>(wal_bytes)); }
    /// Mean calls per shared transaction (group commit); 0 without it.
    [[nodiscard]] double mean_claim_group() const {
        return counters.claim_groups
                   ? static_cast<double>(counters.grouped_claims) / static_cast<double>(counters.claim_groups)
                   : 0;
    }
    [[nodiscard]] double mean_save_group() const {
        return counters.save_groups
                   ? static_cast<double>(counters.grouped_saves) / static_cast<double>(counters.save_groups)
                   : 0;
    }
    [[nodiscard]] double ops() const { return seconds > 0 ? static_cast<double>(calls) / seconds : 0; }
    /// Client CPU (this process: the workers and the library or libpq) per call, microseconds.
    [[nodiscard]] double cpu_us_per_call() const {
        return calls > 0 ? cpu_seconds * 1e6 / static_cast<double>(calls) : 0;
    }
    [[nodiscard]] double rt_per_call() const {
        return calls > 0 ? static_cast<double>(counters.round_trips) / static_cast<double>(calls) : 0;
    }
};

struct Run {
    int threads = 0;
    Case kind = Case::fresh;
    std::vector<Side> sides;  ///< in SideKind order; only the sides that ran
    std::optional<double> pgbench_tps;

    [[nodiscard]] const Side* find(SideKind k) const {
        for (const Side& side : sides) {
            if (side.kind == k && side.ran()) return &side;
        }
        return nullptr;
    }
    /// The side the ratio column compares with the floor: idem (group commit off), else idem_gc.
    [[nodiscard]] const Side* lib() const {
        const Side* s = find(SideKind::idem);
        return s ? s : find(SideKind::idem_gc);
    }
    [[nodiscard]] double ratio(SideKind k) const {
        const Side* a = find(k);
        const Side* f = find(SideKind::floor);
        return a && f && f->ops() > 0 ? a->ops() / f->ops() : NAN;
    }
};

std::string hex(std::string_view bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    for (const char ch : bytes) {
        const auto b = static_cast<unsigned char>(ch);
        s += digits[b >> 4];
        s += digits[b & 0xF];
    }
    return s;
}

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

// ---- the matrix ---------------------------------------------------------------------------------

struct Tables {
    Admin& admin;
    std::vector<std::string> names;
    bool keep;
    ~Tables() {
        if (keep) return;
        for (const auto& n : names) {
            try {
                admin.drop_table(n);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "warning: could not drop %s: %s\n", n.c_str(), e.what());
            }
        }
    }
    std::string add(const std::string& name) {
        admin.create_table(name);
        names.push_back(name);
        return name;
    }
};

void print_header() {
    std::printf("%-7s %-13s %-13s %11s %6s %8s %8s %7s %7s %9s %10s %11s %11s\n", "threads", "case", "side", "ops/s",
                "/floor", "p50 us", "p99 us", "RT/call", "cpu us", "commits", "WAL B", "claim grp", "save grp");
}

void print_run(const Run& r) {
    for (const Side& side : r.sides) {
        if (!side.ran()) continue;
        const std::string commits =
            side.commits ? fmt::format("{:.3f}", side.per_call(static_cast<double>(*side.commits))) : "-";
        const std::string claim_grp = side.counters.claim_groups ? fmt::format("{:.1f}/{}", side.mean_claim_group(),
                                                                               side.counters.largest_claim_group)
                                                                 : "-";
        const std::string save_grp = side.counters.save_groups ? fmt::format("{:.1f}/{}", side.mean_save_group(),
                                                                             side.counters.largest_save_group)
                                                               : "-";
        std::printf("%-7d %-13s %-13s %11.0f %6.3f %8.0f %8.0f %7.3f %7.1f %9s %10.0f %11s %11s\n", r.threads,
                    case_name(r.kind), side_name(side.kind), side.ops(), r.ratio(side.kind),
                    side.hist.percentile_us(0.50), side.hist.percentile_us(0.99), side.rt_per_call(),
                    side.cpu_us_per_call(), commits.c_str(), side.wal_bytes_per_call(), claim_grp.c_str(),
                    save_grp.c_str());
        if (side.unexpected || side.counters.retries || side.counters.opened) {
            std::printf("        note: %s: unexpected outcomes %llu; retries %llu; connections opened %llu\n",
                        side_name(side.kind), static_cast<unsigned long long>(side.unexpected),
                        static_cast<unsigned long long>(side.counters.retries),
                        static_cast<unsigned long long>(side.counters.opened));
        }
    }
    if (r.pgbench_tps)
        std::printf("%-7d %-13s %-13s %11.0f  (informational)\n", r.threads, case_name(r.kind), "pgbench",
                    *r.pgbench_tps);
    std::fflush(stdout);
}

// The library side of one group-commit setting at one thread count: its store(s), and a CachedStore
// in front of each for replay-cached.
struct LibrarySide {
    SideKind kind;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores;
    std::vector<std::unique_ptr<idem::CachedStore>> cached;

    [[nodiscard]] std::vector<idem::IdempotencyStore*> for_case(Case c) const {
        std::vector<idem::IdempotencyStore*> out;
        if (c == Case::replay_cached) {
            for (const auto& s : cached) out.push_back(s.get());
        } else {
            for (const auto& s : stores) out.push_back(s.get());
        }
        return out;
    }
    [[nodiscard]] Counters counters() const {
        Counters c;
        for (const auto& st : stores) {
            const Counters one = library_counters(*st);
            c.round_trips += one.round_trips;
            c.retries += one.retries;
            c.opened += one.opened;
            c.claim_groups += one.claim_groups;
            c.grouped_claims += one.grouped_claims;
            c.largest_claim_group = std::max(c.largest_claim_group, one.largest_claim_group);
            c.save_groups += one.save_groups;
            c.grouped_saves += one.grouped_saves;
            c.largest_save_group = std::max(c.largest_save_group, one.largest_save_group);
        }
        return c;
    }
};

std::vector<Run> run_matrix(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                            const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string fp_bytes(fp.bytes());
    const std::string lib_table = tables.add(prefix + "_lib");
    const std::string floor_table = tables.add(prefix + "_floor");
    const std::string ideal_table = o.ideal ? tables.add(prefix + "_ideal") : std::string();
    const std::string ideal_threads_table = o.ideal ? tables.add(prefix + "_ideal_threads") : std::string();
    const bool pgbench = o.use_pgbench && ::access(o.pgbench.c_str(), X_OK) == 0;
    const std::string pgb_table = pgbench ? tables.add(prefix + "_pgb") : std::string();
    if (o.use_pgbench && !pgbench) std::fprintf(stderr, "note: %s not found; no pgbench column\n", o.pgbench.c_str());
    const bool walinspect = admin.enable_walinspect();

    // The idem side(s) this build can run: group commit off is today's behaviour; on needs the option.
    std::vector<std::pair<SideKind, bool>> lib_sides;
    for (const bool gc : o.group_commit) {
        idem::PostgresOptions probe;
        if (set_group_commit(probe, gc)) {
            lib_sides.emplace_back(gc ? SideKind::idem_gc : SideKind::idem, gc);
        } else {
            std::fprintf(stderr, "note: this build of idem has no PostgresOptions::group_commit: no idem_gc side\n");
        }
    }

    std::fprintf(stderr, "preloading %lld completed + %lld in-progress keys per table...\n",
                 static_cast<long long>(o.preload), static_cast<long long>(o.preload));
    // No autovacuum on the benchmark's tables: a background VACUUM or ANALYZE of one side's table
    // (the `new` rounds add tens of thousands of rows, past autovacuum's thresholds) lands in
    // whichever rounds happen to run then, on one side only. Instead every table is vacuumed and
    // analyzed, untimed, before every case (vacuum_all below).
    const std::string all_tables[] = {lib_table, floor_table, ideal_table, ideal_threads_table, pgb_table};
    for (const std::string& t : all_tables) {
        if (t.empty()) continue;
        admin.exec("ALTER TABLE " + quote_ident(t) + " SET (autovacuum_enabled = false)");
        admin.preload(t, Admin::Preload::completed, kReplayBase, o.preload, fp_bytes, false);
        admin.preload(t, Admin::Preload::in_progress, kConflictBase, o.preload, fp_bytes, false);
        admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
    }
    const auto vacuum_all = [&] {
        for (const std::string& t : all_tables) {
            if (!t.empty()) admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
        }
    };

    std::vector<Run> runs;
    print_header();
    for (const int threads : o.threads) {
        // Each idem side: normally one store, pool size = threads. --store-per-thread (a diagnostic):
        // one store with a pool of 1 per thread, so each thread keeps its own connection, like the floor.
        std::vector<LibrarySide> libs;
        for (const auto& [kind, gc] : lib_sides) {
            idem::PostgresOptions options;
            options.table = lib_table;
            options.pool_size = o.store_per_thread ? 1 : static_cast<std::size_t>(threads);
            options.application_name = std::string("idem-bench-") + side_name(kind);
            (void)set_group_commit(options, gc);
            LibrarySide side{kind, {}, {}};
            for (int i = 0; i < (o.store_per_thread ? threads : 1); ++i) {
                side.stores.push_back(std::make_unique<idem::PostgresStore>(o.db, options));
                prewarm(*side.stores.back(), static_cast<int>(options.pool_size));
                side.cached.push_back(std::make_unique<idem::CachedStore>(*side.stores.back()));
            }
            libs.push_back(std::move(side));
        }
        std::vector<std::unique_ptr<FloorClient>> clients;
        for (int t = 0; t < threads; ++t) clients.push_back(std::make_unique<FloorClient>(o.db, floor_table));
        std::unique_ptr<IdealClient> ideal, ideal_threads;
        if (o.ideal) {
            ideal = std::make_unique<IdealClient>(o.db, ideal_table);
            ideal_threads = std::make_unique<IdealClient>(o.db, ideal_threads_table);
        }
        const auto floor_counters = [&clients]() noexcept {
            Counters c;
            for (const auto& client : clients) c.round_trips += client->round_trips();
            return c;
        };
        const auto counters_of = [](const std::unique_ptr<IdealClient>& client) {
            return [&client]() noexcept {
                Counters c;
                c.round_trips = client ? client->round_trips() : 0;
                return c;
            };
        };
        const auto ideal_counters = counters_of(ideal);
        const auto ideal_threads_counters = counters_of(ideal_threads);
        std::vector<std::string> ideal_keys;
        std::vector<std::int64_t> ideal_fences;

        for (const Case kind : o.cases) {
            Run run;
            run.threads = threads;
            run.kind = kind;
            std::vector<SideKind> order{SideKind::floor};
            if (ideal) {
                order.push_back(SideKind::ideal);
                order.push_back(SideKind::ideal_threads);
            }
            for (const auto& lib : libs) order.push_back(lib.kind);
            if (!o.only.empty()) {
                std::erase_if(order, [&](SideKind k) { return o.only != side_name(k); });
            }
            for (const SideKind k : order) {
                run.sides.emplace_back();
                run.sides.back().kind = k;
            }
            // replay-cached: every side replays the same hot keys; the caches hold them before timing.
            const std::int64_t keys = kind == Case::replay_cached ? std::min(o.cached_keys, o.preload) : o.preload;
            if (kind == Case::replay_cached) {
                for (const LibrarySide& lib : libs) {
                    for (const auto& cached : lib.cached) {
                        for (std::int64_t i = 0; i < keys; ++i) {
                            (void)cached->claim(
                                idem::Key(kScope, preloaded_key(kReplayBase, static_cast<std::uint64_t>(i))), fp);
                        }
                    }
                }
            }
            FloorOp floor_op{clients, fp_bytes, kind, keys};
            IdealOp ideal_op{ideal.get(), fp_bytes,    kind, keys, static_cast<std::size_t>(threads),
                             ideal_keys,  ideal_fences};
            vacuum_all();
            const double per_round = o.seconds / o.rounds;
            for (int round = 0; round < o.rounds; ++round) {
                // ABC… then …CBA: alternating the order cancels a linear drift (ABBA for two sides).
                for (std::size_t step = 0; step < run.sides.size(); ++step) {
                    const std::size_t i = round % 2 == 0 ? step : run.sides.size() - 1 - step;
                    Side& side = run.sides[i];
                    if (o.checkpoint) admin.checkpoint();
                    seed += 0x632BE59BD9B4E019ull;
                    PhaseResult r;
                    if (side.kind == SideKind::floor) {
                        r = run_phase(admin, threads, per_round, seed, floor_op, floor_counters);
                    } else if (side.kind == SideKind::ideal) {
                        // One connection; each op is a round of `threads` calls.
                        r = run_phase(admin, 1, per_round, seed, ideal_op, ideal_counters);
                        r.calls *= static_cast<std::uint64_t>(threads);
                        r.unexpected *= static_cast<std::uint64_t>(threads);
                    } else if (side.kind == SideKind::ideal_threads) {
                        IdealGather gather(ideal_threads.get(), static_cast<std::size_t>(threads));
                        IdealThreadsOp op{gather, fp_bytes, kind, keys};
                        r = run_phase(admin, threads, per_round, seed, op, ideal_threads_counters);
                    } else {
                        const LibrarySide& lib = *std::find_if(
                            libs.begin(), libs.end(), [&](const LibrarySide& l) { return l.kind == side.kind; });
                        LibraryOp lib_op{lib.for_case(kind), fp, kind, keys};
                        r = run_phase(admin, threads, per_round, seed, lib_op,
                                      [&lib]() noexcept { return lib.counters(); });
                    }
                    side.add(r);
                    side.wal_bytes += r.lsn_to - r.lsn_from;
                    if (walinspect)
                        side.commits = side.commits.value_or(0) + admin.commit_records(r.lsn_from, r.lsn_to);
                }
            }
            runs.push_back(std::move(run));
        }
        // pgbench (informational) after every case of this thread count, not between them: the
        // rounds of a case never follow another program's load (with pgbench between the cases,
        // replay/conflict ratios at 16 threads came out ~0.1 lower than without).
        for (std::size_t i = runs.size() - o.cases.size(); i < runs.size(); ++i) {
            Run& run = runs[i];
            if (pgbench && run.kind != Case::replay_cached) {
                if (o.checkpoint) admin.checkpoint();
                run.pgbench_tps = run_pgbench(PgbenchRun{o.pgbench, o.db, pgb_table, case_name(run.kind), threads,
                                                         std::max(1, static_cast<int>(std::lround(o.seconds / 2))),
                                                         o.preload, hex(fp_bytes)});
            }
            print_run(run);
        }
    }
    return runs;
}

// ---- checks -------------------------------------------------------------------------------------

struct TableSizeResult {
    std::int64_t rows = 0;
    double load_seconds = 0;
    std::string full_size;
    Histogram empty_claim, full_claim, empty_call, full_call;
};

// Claim (timed on its own) then save, single thread, new random keys.
struct TimedClaimOp {
    idem::PostgresStore& store;
    const idem::Fingerprint& fp;
    Histogram& claims;

    bool operator()(int, Rng& rng) const {
        const idem::Key key(kScope, random_hex_key(rng));
        const auto t0 = Clock::now();
        const idem::Claim c = store.claim(key, fp);
        claims.record(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count()));
        if (c.status != idem::ClaimStatus::claimed) return false;
        store.save(key, c.fence, kResult);
        return true;
    }
};

TableSizeResult table_size_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                                 const idem::Fingerprint& fp, std::uint64_t seed) {
    TableSizeResult r;
    r.rows = o.table_size_check;
    const std::string empty = tables.add(prefix + "_ts_empty");
    const std::string full = tables.add(prefix + "_ts_full");
    std::fprintf(stderr, "table-size check: loading %lld rows (md5 keys, completed) into %s...\n",
                 static_cast<long long>(r.rows), full.c_str());
    const auto t0 = Clock::now();
    admin.preload(full, Admin::Preload::completed, 0, r.rows, fp.bytes(), true);
    admin.exec("VACUUM (ANALYZE) " + quote_ident(full));
    // The empty table is left as ensure_schema() made it: never analyzed. ANALYZE on an empty table
    // records 0 rows, the prepared statements' generic plans become sequential scans, and they stay
    // cached while the table grows (see docs/benchmarks.md): that would measure the plan, not the size.
    admin.checkpoint();
    r.load_seconds = seconds_between(t0, Clock::now());
    r.full_size = admin.exec("SELECT pg_size_pretty(pg_total_relation_size($1::regclass))", {quote_ident(full)});
    std::fprintf(stderr, "  loaded in %.0f s; %s with indexes\n", r.load_seconds, r.full_size.c_str());

    idem::PostgresOptions options;
    options.pool_size = 1;
    options.table = empty;
    idem::PostgresStore empty_store(o.db, options);
    options.table = full;
    idem::PostgresStore full_store(o.db, options);
    prewarm(empty_store, 1);
    prewarm(full_store, 1);
    const auto seq_scans = [&admin](const std::string& t) {
        // Statistics reach pg_stat_* up to a second late: wait that long first.
        std::this_thread::sleep_for(std::chrono::milliseconds(1100));
        return admin.exec("SELECT coalesce(seq_scan, 0) FROM pg_stat_user_tables WHERE relid = $1::regclass",
                          {quote_ident(t)});
    };
    const long long seq_before[2] = {std::stoll(seq_scans(empty)), std::stoll(seq_scans(full))};
    const auto none = []() noexcept { return Counters{}; };
    TimedClaimOp empty_op{empty_store, fp, r.empty_claim};
    TimedClaimOp full_op{full_store, fp, r.full_claim};
    const double per_round = o.seconds / o.rounds;
    for (int round = 0; round < o.rounds; ++round) {
        for (int half = 0; half < 2; ++half) {
            const bool is_full = (half == 0) == (round % 2 == 0);
            seed += 0x632BE59BD9B4E019ull;
            if (is_full) {
                r.full_call.merge(run_phase(admin, 1, per_round, seed, full_op, none).hist);
            } else {
                r.empty_call.merge(run_phase(admin, 1, per_round, seed, empty_op, none).hist);
            }
        }
    }
    std::printf("table-size check (1 thread, new keys, %d x %.1f s per table, alternating):\n", o.rounds, per_round);
    std::printf("  %-22s %10s %10s %10s %10s %9s\n", "table", "claim p50", "claim p99", "call p50", "call p99",
                "calls");
    const auto line = [](const char* name, const Histogram& claim, const Histogram& call) {
        std::printf("  %-22s %10.0f %10.0f %10.0f %10.0f %9llu\n", name, claim.percentile_us(0.5),
                    claim.percentile_us(0.99), call.percentile_us(0.5), call.percentile_us(0.99),
                    static_cast<unsigned long long>(call.count()));
    };
    line("empty", r.empty_claim, r.empty_call);
    line(fmt::format("{} rows", r.rows).c_str(), r.full_claim, r.full_call);
    std::printf("  claim p50 ratio (full / empty): %.3f   (target <= 1.2); load took %.0f s, table %s\n",
                r.full_claim.percentile_us(0.5) / r.empty_claim.percentile_us(0.5), r.load_seconds,
                r.full_size.c_str());
    // Every statement should have been an index scan; a sequential scan means a bad cached plan.
    for (std::size_t i = 0; i < 2; ++i) {
        const long long seq = std::stoll(seq_scans(i == 0 ? empty : full)) - seq_before[i];
        std::printf("  %s: %lld sequential scans during the check%s\n", (i == 0 ? empty : full).c_str(), seq,
                    seq > 0 ? "  <- WARNING: a cached plan scans the table" : "");
    }
    std::fflush(stdout);
    return r;
}

struct RssResult {
    std::uint64_t first = 100'000, total = 0, unexpected = 0;
    Memory at_first, at_total;
    double first_seconds = 0, total_seconds = 0;
};

RssResult rss_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                    const idem::Fingerprint& fp, std::uint64_t seed) {
    RssResult r;
    r.total = static_cast<std::uint64_t>(o.rss_calls);
    const std::string table = tables.add(prefix + "_rss");
    admin.preload(table, Admin::Preload::completed, kReplayBase, o.preload, fp.bytes(), false);
    admin.exec("VACUUM (ANALYZE) " + quote_ident(table));
    idem::PostgresOptions options;
    options.pool_size = static_cast<std::size_t>(o.rss_threads);
    options.table = table;
    idem::PostgresStore store(o.db, options);
    const LibraryOp fresh{{&store}, fp, Case::fresh, o.preload};
    const LibraryOp replay{{&store}, fp, Case::replay, o.preload};

    std::atomic<std::uint64_t> tickets{0};
    std::atomic<std::uint64_t> unexpected{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;
    std::barrier sync(o.rss_threads + 1);
    const auto work = [&](Rng& rng, std::uint64_t limit) {
        while (!failed.load(std::memory_order_relaxed) && tickets.fetch_add(1) < limit) {
            const bool is_new = (rng.next() & 1) != 0;
            const bool ok = is_new ? fresh(0, rng) : replay(0, rng);
            if (!ok && unexpected.fetch_add(1, std::memory_order_relaxed) < 5) {
                std::fprintf(stderr, "  unexpected outcome for a %s call\n", is_new ? "new" : "replay");
            }
        }
    };
    std::vector<std::thread> workers;
    const auto t0 = Clock::now();
    std::fprintf(stderr, "rss check: %llu calls on %d threads (half new, half replay)...\n",
                 static_cast<unsigned long long>(r.total), o.rss_threads);
    for (int t = 0; t < o.rss_threads; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, static_cast<std::uint64_t>(t));
            for (int stage = 0; stage < 2; ++stage) {
                try {
                    work(rng, stage == 0 ? r.first : r.total);
                } catch (const std::exception& e) {
                    std::lock_guard lock(error_mutex);
                    if (error.empty()) error = e.what();
                    failed.store(true);
                }
                if (stage == 0) {
                    sync.arrive_and_wait();  // main reads the RSS
                    sync.arrive_and_wait();  // and lets us go on
                }
            }
        });
    }
    sync.arrive_and_wait();
    r.first_seconds = seconds_between(t0, Clock::now());
    r.at_first = memory_now();
    std::fprintf(stderr, "  %llu calls in %.1f s: RSS %.2f MB\n", static_cast<unsigned long long>(r.first),
                 r.first_seconds, r.at_first.rss_mb);
    tickets.store(r.first);
    sync.arrive_and_wait();
    for (auto& w : workers) w.join();
    r.total_seconds = seconds_between(t0, Clock::now());
    r.at_total = memory_now();
    r.unexpected = unexpected.load();
    if (!error.empty()) throw std::runtime_error(error);
    std::printf("rss check (%d threads, half new / half replay):\n", o.rss_threads);
    std::printf("  after %9llu calls: RSS %7.2f MB  peak %7.2f MB  (%.1f s)\n",
                static_cast<unsigned long long>(r.first), r.at_first.rss_mb, r.at_first.peak_mb, r.first_seconds);
    std::printf("  after %9llu calls: RSS %7.2f MB  peak %7.2f MB  (%.1f s)\n",
                static_cast<unsigned long long>(r.total), r.at_total.rss_mb, r.at_total.peak_mb, r.total_seconds);
    std::printf("  RSS ratio: %.3f   (target 0.95..1.05); unexpected outcomes: %llu\n",
                r.at_total.rss_mb / r.at_first.rss_mb, static_cast<unsigned long long>(r.unexpected));
    std::fflush(stdout);
    return r;
}

// ---- output -------------------------------------------------------------------------------------

std::string json_side(const Side& side, const Run& run) {
    return fmt::format(
        "{{\"ops_per_s\": {}, \"ratio_to_floor\": {}, \"p50_us\": {}, \"p99_us\": {}, \"calls\": {}, "
        "\"unexpected_outcomes\": {}, \"round_trips_per_call\": {}, \"client_cpu_us_per_call\": {}, "
        "\"commits_per_call\": {}, \"wal_bytes_per_call\": {}, \"claim_group_mean\": {}, "
        "\"claim_group_max\": {}, \"save_group_mean\": {}, \"save_group_max\": {}}}",
        json_number(side.ops()), json_number(run.ratio(side.kind)), json_number(side.hist.percentile_us(0.5)),
        json_number(side.hist.percentile_us(0.99)), side.calls, side.unexpected, json_number(side.rt_per_call()),
        json_number(side.cpu_us_per_call()),
        side.commits ? json_number(side.per_call(static_cast<double>(*side.commits))) : "null",
        json_number(side.wal_bytes_per_call()), json_number(side.mean_claim_group()), side.counters.largest_claim_group,
        json_number(side.mean_save_group()), side.counters.largest_save_group);
}

void write_json(const std::string& path, const Options& o, const std::string& server, const std::vector<Run>& runs,
                const std::optional<TableSizeResult>& ts, const std::optional<RssResult>& rss, double rss_mb) {
    std::string s = "{\n  \"runs\": [";
    const Side none;
    for (std::size_t i = 0; i < runs.size(); ++i) {
        const Run& r = runs[i];
        // The flat fields (idem = group commit off, vs the floor) as before; every side in "sides".
        const Side& lib = r.lib() ? *r.lib() : none;
        const Side& floor = r.find(SideKind::floor) ? *r.find(SideKind::floor) : none;
        s += i ? ",\n    " : "\n    ";
        s += fmt::format(
            "{{\"threads\": {}, \"case\": \"{}\", \"ops_per_s\": {}, \"floor_ops_per_s\": {}, \"ratio\": {}, "
            "\"p50_us\": {}, \"p99_us\": {}, \"round_trips_per_call\": {}, \"floor_p50_us\": {}, "
            "\"floor_p99_us\": {}, \"floor_round_trips_per_call\": {}, \"pgbench_tps\": {}, \"calls\": {}, "
            "\"floor_calls\": {}, \"unexpected_outcomes\": {}, \"client_cpu_us_per_call\": {}, "
            "\"floor_client_cpu_us_per_call\": {}, \"sides\": {{",
            r.threads, case_name(r.kind), json_number(lib.ops()), json_number(floor.ops()),
            json_number(floor.ops() > 0 ? lib.ops() / floor.ops() : NAN), json_number(lib.hist.percentile_us(0.5)),
            json_number(lib.hist.percentile_us(0.99)), json_number(lib.rt_per_call()),
            json_number(floor.hist.percentile_us(0.5)), json_number(floor.hist.percentile_us(0.99)),
            json_number(floor.rt_per_call()), r.pgbench_tps ? json_number(*r.pgbench_tps) : "null", lib.calls,
            floor.calls, lib.unexpected + floor.unexpected, json_number(lib.cpu_us_per_call()),
            json_number(floor.cpu_us_per_call()));
        bool first = true;
        for (const Side& side : r.sides) {
            if (!side.ran()) continue;
            s += fmt::format("{}\"{}\": {}", first ? "" : ", ", side_name(side.kind), json_side(side, r));
            first = false;
        }
        s += "}}";
    }
    s += runs.empty() ? "],\n" : "\n  ],\n";
    s += fmt::format("  \"rss_mb\": {},\n", json_number(rss_mb));
    if (ts) {
        s += fmt::format(
            "  \"table_size_check\": {{\"rows\": {}, \"load_seconds\": {}, \"empty_claim_p50_us\": {}, "
            "\"full_claim_p50_us\": {}, \"ratio\": {}, \"empty_claim_p99_us\": {}, \"full_claim_p99_us\": {}}},\n",
            ts->rows, json_number(ts->load_seconds), json_number(ts->empty_claim.percentile_us(0.5)),
            json_number(ts->full_claim.percentile_us(0.5)),
            json_number(ts->full_claim.percentile_us(0.5) / ts->empty_claim.percentile_us(0.5)),
            json_number(ts->empty_claim.percentile_us(0.99)), json_number(ts->full_claim.percentile_us(0.99)));
    }
    if (rss) {
        s += fmt::format(
            "  \"rss_check\": {{\"threads\": {}, \"calls_first\": {}, \"rss_mb_first\": {}, \"calls_total\": {}, "
            "\"rss_mb_total\": {}, \"ratio\": {}, \"peak_mb\": {}}},\n",
            o.rss_threads, rss->first, json_number(rss->at_first.rss_mb), rss->total, json_number(rss->at_total.rss_mb),
            json_number(rss->at_total.rss_mb / rss->at_first.rss_mb), json_number(rss->at_total.peak_mb));
    }
    s += fmt::format("  \"seconds_per_case\": {}, \"rounds\": {}, \"server\": \"{}\"\n}}\n", json_number(o.seconds),
                     o.rounds, server);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + path);
    }
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
        std::printf("%u CPUs; %.1f s per case and side in %d alternating rounds; pool size = threads\n",
                    std::thread::hardware_concurrency(), o.seconds, o.rounds);
        std::fflush(stdout);

        const idem::Fingerprint fp = idem::fingerprint("idem-bench", 1);
        const std::string prefix = "bench_" + std::to_string(::getpid());
        std::uint64_t seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                             (static_cast<std::uint64_t>(::getpid()) << 32);
        Tables tables{admin, {}, o.keep_tables};

        std::vector<Run> runs;
        std::optional<TableSizeResult> ts;
        std::optional<RssResult> rss;
        if (o.table_size_check > 0 || o.rss_check) {
            if (o.table_size_check > 0) ts = table_size_check(o, admin, tables, prefix, fp, seed);
            if (o.rss_check) rss = rss_check(o, admin, tables, prefix, fp, seed ^ 0xABCDEFull);
        } else {
            runs = run_matrix(o, admin, tables, prefix, fp, seed);
        }
        const double rss_mb = memory_now().peak_mb;
        std::printf("peak RSS of idem-bench: %.1f MB\n", rss_mb);
        if (!o.json.empty()) write_json(o.json, o, server, runs, ts, rss, rss_mb);

        if (o.expect_round_trips) {
            bool ok = true;
            for (const Run& r : runs) {
                const std::uint64_t want = expected_round_trips(r.kind);
                for (const Side& side : r.sides) {
                    const std::uint64_t rt = side.counters.round_trips;
                    bool good = side.calls > 0 && side.unexpected == 0;
                    if (r.kind == Case::replay_cached &&
                        (side.kind == SideKind::idem || side.kind == SideKind::idem_gc)) {
                        // The cache was filled before timing: at most one miss per hot key and thread
                        // (an entry evicted, or threads missing the same key at once).
                        good = good && rt <= static_cast<std::uint64_t>(std::min(o.cached_keys, o.preload)) *
                                                 static_cast<std::uint64_t>(r.threads);
                    } else if (side.kind == SideKind::ideal) {
                        good = good && rt * static_cast<std::uint64_t>(r.threads) == want * side.calls;  // per round
                    } else if (side.kind == SideKind::ideal_threads) {
                        // Per round of T callers, plus the smaller rounds while the callers stop: each
                        // caller makes at most one call after the phase ends, so at most T of them.
                        const auto threads = static_cast<std::uint64_t>(r.threads);
                        good = good && rt * threads >= want * side.calls &&
                               rt * threads <= want * side.calls + want * threads * threads;
                    } else if (side.kind != SideKind::idem_gc) {
                        good = good && rt == want * side.calls;
                    }
                    if (!good) {
                        std::fprintf(stderr,
                                     "FAIL: %s at %d threads, %s: %llu round trips for %llu calls (want %llu per "
                                     "call), %llu unexpected outcomes\n",
                                     case_name(r.kind), r.threads, side_name(side.kind),
                                     static_cast<unsigned long long>(rt), static_cast<unsigned long long>(side.calls),
                                     static_cast<unsigned long long>(want),
                                     static_cast<unsigned long long>(side.unexpected));
                        ok = false;
                    }
                }
            }
            if (!ok) return 3;
            std::printf(
                "round trips per call as expected (new 2, replay 1, conflict 1; ideal per round; replay-cached at most "
                "one per key)\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-bench: %s\n", e.what());
        return 1;
    }
    return 0;
}
