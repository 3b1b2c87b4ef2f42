// idem-bench — what execute_once costs over PostgreSQL, next to the same statements sent raw.
//
//   idem-bench [--db CONNINFO] [--threads 1,4,16] [--seconds N] [--json FILE] [...]
//
// For each thread count and case (new / replay / conflict) it runs, in the same process and on the
// same server, alternating short rounds of
//   library: execute_once through a PostgresStore (pool size = threads) with a no-op effect;
//   floor:   the same prepared statements over raw libpq, one pipelined connection per thread;
// and, when pgbench is installed, pgbench with an equivalent script (informational).
// Without --db it uses $IDEM_TEST_DATABASE_URL, else re-executes itself under
// scripts/with-postgres.sh (a throwaway cluster). docs/benchmarks.md explains the method and
// holds the latest figures. --help lists every option.
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <climits>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

enum class Case { fresh, replay, conflict };

const char* case_name(Case c) {
    switch (c) {
        case Case::fresh: return "new";
        case Case::replay: return "replay";
        case Case::conflict: return "conflict";
    }
    return "?";
}

std::uint64_t expected_round_trips(Case c) { return c == Case::fresh ? 2 : 1; }

struct Options {
    std::string db;
    std::vector<int> threads{1, 4, 16};
    std::vector<Case> cases{Case::fresh, Case::replay, Case::conflict};
    double seconds = 6;
    int rounds = 3;
    std::string json;
    std::string pgbench = IDEM_BENCH_PGBENCH;
    bool use_pgbench = true;
    std::int64_t preload = 100'000;
    bool checkpoint = true;
    bool keep_tables = false;
    bool expect_round_trips = false;
    std::int64_t table_size_check = 0;
    bool rss_check = false;
    std::int64_t rss_calls = 1'000'000;
    int rss_threads = 4;
    bool print_scripts = false;
    std::string only;  ///< "idem" or "floor": run one side only (for profiling; no ratio)
    bool store_per_thread = false;  ///< diagnostic: T stores with a pool of 1 instead of one pool of T
};

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s",
                 R"(usage: idem-bench [--db CONNINFO] [options]

Throughput matrix (default):
  --threads LIST          thread counts, e.g. 1,4,16 (default)
  --cases LIST            new,replay,conflict (default: all three)
  --seconds N             measured seconds per case and side (library / floor), default 6
  --rounds N              alternating floor/library rounds per case, default 3 (ABBA order)
  --preload N             completed and in-progress keys preloaded for replay/conflict (100000)
  --json FILE             write the figures as JSON
  --pgbench PATH          pgbench binary (default /usr/lib/postgresql/15/bin/pgbench, if present)
  --no-pgbench            skip the pgbench column
  --no-checkpoint         do not CHECKPOINT before each phase
  --expect-round-trips    exit 3 unless round trips per call are exactly new 2, replay 1,
                          conflict 1 and every call had the expected outcome (the CTest smoke test)
  --print-pgbench-scripts print the pgbench scripts and exit
  --only idem|floor       run one side only (to profile it with perf or strace; no ratio)
  --store-per-thread      diagnostic: one PostgresStore (pool of 1) per thread instead of one
                          shared store with a pool of T: isolates the cost of sharing the pool
Checks (when given, they run instead of the matrix):
  --table-size-check N    claim p50 (1 thread, new keys) on an empty table vs one with N rows
  --rss-check             RSS after 100k and after --rss-calls calls (default 1000000),
                          --rss-threads threads (default 4), half replays, half new keys
Other:
  --keep-tables           leave the bench_<pid>_* tables in place
Without --db: $IDEM_TEST_DATABASE_URL if set, else a throwaway cluster (scripts/with-postgres.sh).
)");
    std::exit(code);
}

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= s.size()) {
        const auto comma = s.find(',', start);
        const auto end = comma == std::string::npos ? s.size() : comma;
        if (end > start) out.push_back(s.substr(start, end - start));
        start = end + 1;
    }
    return out;
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
    std::vector<std::string> args(argv + 1, argv + argc);
    for (std::size_t i = 0; i < args.size(); ++i) {
        std::string arg = args[i];
        std::optional<std::string> inline_value;
        if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
            inline_value = arg.substr(eq + 1);
            arg = arg.substr(0, eq);
        }
        const auto value = [&]() -> std::string {
            if (inline_value) return *inline_value;
            if (i + 1 >= args.size()) {
                std::fprintf(stderr, "idem-bench: %s needs a value\n", arg.c_str());
                usage(2);
            }
            return args[++i];
        };
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
                } else {
                    std::fprintf(stderr, "idem-bench: unknown case '%s'\n", c.c_str());
                    usage(2);
                }
            }
        } else if (arg == "--seconds") {
            o.seconds = std::strtod(value().c_str(), nullptr);
            if (!(o.seconds > 0)) usage(2);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value(), "--rounds"));
            if (o.rounds < 1) usage(2);
        } else if (arg == "--preload") {
            o.preload = to_int(value(), "--preload");
            if (o.preload < 1) usage(2);
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
            if (o.only != "idem" && o.only != "floor") usage(2);
        } else if (arg == "--store-per-thread") {
            o.store_per_thread = true;
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
    return ok;
}

// ---- phases -------------------------------------------------------------------------------------

struct Counters {
    std::uint64_t round_trips = 0, retries = 0, opened = 0;
};

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
    Histogram hist;
};

// Runs `op(thread, rng)` (true = the expected outcome) on `threads` threads for `seconds`, after
// kWarmupCalls untimed calls per thread. `snapshot()` is read when every thread is ready and again
// after the last one stopped, so the counters cover exactly the timed calls.
template <class Op, class Snapshot>
PhaseResult run_phase(int threads, double seconds, std::uint64_t seed, Op& op, Snapshot snapshot) {
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
    auto on_ready = [&]() noexcept {
        before = snapshot();
        cpu_start = process_cpu_seconds();
        start = Clock::now();
    };
    std::barrier ready(threads + 1, on_ready);
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
    const Counters after = snapshot();

    PhaseResult r;
    r.seconds = seconds_between(start, end);
    r.cpu_seconds = cpu_end - cpu_start;
    for (std::size_t t = 0; t < n; ++t) {
        r.calls += calls[t];
        r.unexpected += unexpected[t];
        r.hist.merge(hists[t]);
    }
    r.delta = {after.round_trips - before.round_trips, after.retries - before.retries, after.opened - before.opened};
    return r;
}

Counters library_counters(const idem::PostgresStore& store) {
    const auto s = store.stats();
    return {s.round_trips, s.retries, s.connections_opened};
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
    std::vector<idem::PostgresStore*> stores;  // one shared store, or one per thread (diagnostic)
    const idem::Fingerprint& fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int thread, Rng& rng) const {
        idem::PostgresStore& store = *stores[static_cast<std::size_t>(thread) % stores.size()];
        const auto effect = [] { return kResult; };  // the no-op effect
        switch (kind) {
            case Case::fresh: {
                const idem::Key key(kScope, random_hex_key(rng));
                return idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::executed;
            }
            case Case::replay: {
                const idem::Key key(kScope, preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(preloaded))));
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
            case Case::replay: {
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

struct Side {
    std::uint64_t calls = 0, unexpected = 0;
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
        hist.merge(r.hist);
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
    Side lib, floor;
    std::optional<double> pgbench_tps;
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
    std::printf("%-7s %-8s %11s %11s %6s %11s %8s %8s %9s %9s %7s %7s %7s %7s\n", "threads", "case", "idem ops/s",
                "floor ops/s", "ratio", "pgbench tps", "p50 us", "p99 us", "floor p50", "floor p99", "RT/call",
                "floorRT", "cpu us", "floorcpu");
}

void print_run(const Run& r) {
    const std::string pgb = r.pgbench_tps ? fmt::format("{:.0f}", *r.pgbench_tps) : "-";
    std::printf("%-7d %-8s %11.0f %11.0f %6.3f %11s %8.0f %8.0f %9.0f %9.0f %7.3f %7.3f %7.1f %7.1f\n", r.threads,
                case_name(r.kind), r.lib.ops(), r.floor.ops(), r.lib.ops() / r.floor.ops(), pgb.c_str(),
                r.lib.hist.percentile_us(0.50), r.lib.hist.percentile_us(0.99), r.floor.hist.percentile_us(0.50),
                r.floor.hist.percentile_us(0.99), r.lib.rt_per_call(), r.floor.rt_per_call(), r.lib.cpu_us_per_call(),
                r.floor.cpu_us_per_call());
    if (r.lib.unexpected || r.floor.unexpected || r.lib.counters.retries || r.lib.counters.opened) {
        std::printf("        note: unexpected outcomes idem %llu floor %llu; retries %llu; connections opened %llu\n",
                    static_cast<unsigned long long>(r.lib.unexpected),
                    static_cast<unsigned long long>(r.floor.unexpected),
                    static_cast<unsigned long long>(r.lib.counters.retries),
                    static_cast<unsigned long long>(r.lib.counters.opened));
    }
    std::fflush(stdout);
}

std::vector<Run> run_matrix(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                            const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string fp_bytes(fp.bytes());
    const std::string lib_table = tables.add(prefix + "_lib");
    const std::string floor_table = tables.add(prefix + "_floor");
    const bool pgbench = o.use_pgbench && ::access(o.pgbench.c_str(), X_OK) == 0;
    const std::string pgb_table = pgbench ? tables.add(prefix + "_pgb") : std::string();
    if (o.use_pgbench && !pgbench) std::fprintf(stderr, "note: %s not found; no pgbench column\n", o.pgbench.c_str());

    std::fprintf(stderr, "preloading %lld completed + %lld in-progress keys per table...\n",
                 static_cast<long long>(o.preload), static_cast<long long>(o.preload));
    // No autovacuum on the benchmark's tables: a background VACUUM or ANALYZE of one side's table
    // (the `new` rounds add tens of thousands of rows, past autovacuum's thresholds) lands in
    // whichever rounds happen to run then, on one side only. Instead both tables are vacuumed and
    // analyzed, untimed, before every case (vacuum_both below).
    for (const std::string& t : {lib_table, floor_table, pgb_table}) {
        if (t.empty()) continue;
        admin.exec("ALTER TABLE " + quote_ident(t) + " SET (autovacuum_enabled = false)");
        admin.preload(t, Admin::Preload::completed, kReplayBase, o.preload, fp_bytes, false);
        admin.preload(t, Admin::Preload::in_progress, kConflictBase, o.preload, fp_bytes, false);
        admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
    }
    const auto vacuum_both = [&] {
        for (const std::string& t : {lib_table, floor_table, pgb_table}) {
            if (!t.empty()) admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
        }
    };

    std::vector<Run> runs;
    print_header();
    for (const int threads : o.threads) {
        idem::PostgresOptions options;
        options.table = lib_table;
        options.pool_size = static_cast<std::size_t>(threads);
        // Normally one store, pool size = threads. --store-per-thread (a diagnostic): one store
        // with a pool of 1 per thread, so each thread keeps its own connection, like the floor.
        std::vector<std::unique_ptr<idem::PostgresStore>> stores;
        if (o.store_per_thread) options.pool_size = 1;
        for (int i = 0; i < (o.store_per_thread ? threads : 1); ++i) {
            stores.push_back(std::make_unique<idem::PostgresStore>(o.db, options));
            prewarm(*stores.back(), static_cast<int>(options.pool_size));
        }
        std::vector<idem::PostgresStore*> store_ptrs;
        for (const auto& st : stores) store_ptrs.push_back(st.get());
        std::vector<std::unique_ptr<FloorClient>> clients;
        for (int t = 0; t < threads; ++t) clients.push_back(std::make_unique<FloorClient>(o.db, floor_table));
        const auto floor_counters = [&clients]() noexcept {
            Counters c;
            for (const auto& client : clients) c.round_trips += client->round_trips();
            return c;
        };
        const auto lib_counters = [&stores]() noexcept {
            Counters c;
            for (const auto& st : stores) {
                const Counters one = library_counters(*st);
                c.round_trips += one.round_trips;
                c.retries += one.retries;
                c.opened += one.opened;
            }
            return c;
        };

        for (const Case kind : o.cases) {
            Run run;
            run.threads = threads;
            run.kind = kind;
            LibraryOp lib_op{store_ptrs, fp, kind, o.preload};
            FloorOp floor_op{clients, fp_bytes, kind, o.preload};
            vacuum_both();
            const double per_round = o.seconds / o.rounds;
            for (int round = 0; round < o.rounds; ++round) {
                // ABBA: floor, idem | idem, floor | floor, idem ... cancels a linear drift.
                for (int half = 0; half < 2; ++half) {
                    const bool floor_first = round % 2 == 0;
                    const bool is_floor = (half == 0) == floor_first;
                    if (!o.only.empty() && (o.only == "floor") != is_floor) continue;
                    if (o.checkpoint) admin.checkpoint();
                    seed += 0x632BE59BD9B4E019ull;
                    if (is_floor) {
                        run.floor.add(run_phase(threads, per_round, seed, floor_op, floor_counters));
                    } else {
                        run.lib.add(run_phase(threads, per_round, seed, lib_op, lib_counters));
                    }
                }
            }
            runs.push_back(std::move(run));
        }
        // pgbench (informational) after every case of this thread count, not between them: the
        // idem/floor rounds of a case never follow another program's load (with pgbench between
        // the cases, replay/conflict ratios at 16 threads came out ~0.1 lower than without).
        for (std::size_t i = runs.size() - o.cases.size(); i < runs.size(); ++i) {
            Run& run = runs[i];
            if (pgbench) {
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
                r.full_call.merge(run_phase(1, per_round, seed, full_op, none).hist);
            } else {
                r.empty_call.merge(run_phase(1, per_round, seed, empty_op, none).hist);
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

void write_json(const std::string& path, const Options& o, const std::string& server, const std::vector<Run>& runs,
                const std::optional<TableSizeResult>& ts, const std::optional<RssResult>& rss, double rss_mb) {
    std::string s = "{\n  \"runs\": [";
    for (std::size_t i = 0; i < runs.size(); ++i) {
        const Run& r = runs[i];
        s += i ? ",\n    " : "\n    ";
        s += fmt::format(
            "{{\"threads\": {}, \"case\": \"{}\", \"ops_per_s\": {}, \"floor_ops_per_s\": {}, \"ratio\": {}, "
            "\"p50_us\": {}, \"p99_us\": {}, \"round_trips_per_call\": {}, \"floor_p50_us\": {}, "
            "\"floor_p99_us\": {}, \"floor_round_trips_per_call\": {}, \"pgbench_tps\": {}, \"calls\": {}, "
            "\"floor_calls\": {}, \"unexpected_outcomes\": {}, \"client_cpu_us_per_call\": {}, "
            "\"floor_client_cpu_us_per_call\": {}}}",
            r.threads, case_name(r.kind), json_number(r.lib.ops()), json_number(r.floor.ops()),
            json_number(r.lib.ops() / r.floor.ops()), json_number(r.lib.hist.percentile_us(0.5)),
            json_number(r.lib.hist.percentile_us(0.99)), json_number(r.lib.rt_per_call()),
            json_number(r.floor.hist.percentile_us(0.5)), json_number(r.floor.hist.percentile_us(0.99)),
            json_number(r.floor.rt_per_call()), r.pgbench_tps ? json_number(*r.pgbench_tps) : "null", r.lib.calls,
            r.floor.calls, r.lib.unexpected + r.floor.unexpected, json_number(r.lib.cpu_us_per_call()),
            json_number(r.floor.cpu_us_per_call()));
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
            o.rss_threads, rss->first, json_number(rss->at_first.rss_mb), rss->total,
            json_number(rss->at_total.rss_mb), json_number(rss->at_total.rss_mb / rss->at_first.rss_mb),
            json_number(rss->at_total.peak_mb));
    }
    s += fmt::format("  \"seconds_per_case\": {}, \"rounds\": {}, \"server\": \"{}\"\n}}\n", json_number(o.seconds),
                     o.rounds, server);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + path);
    }
}

}  // namespace

int main(int argc, char** argv) {
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
            std::printf("WARNING: synchronous_commit is not on: acknowledged claims can be lost in a crash, and "
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
                if (r.lib.calls == 0 || r.lib.counters.round_trips != want * r.lib.calls || r.lib.unexpected != 0 ||
                    r.floor.unexpected != 0 || r.floor.counters.round_trips != want * r.floor.calls) {
                    std::fprintf(stderr,
                                 "FAIL: %s at %d threads: %llu round trips for %llu calls (want %llu per call), "
                                 "unexpected outcomes idem %llu floor %llu\n",
                                 case_name(r.kind), r.threads, static_cast<unsigned long long>(r.lib.counters.round_trips),
                                 static_cast<unsigned long long>(r.lib.calls), static_cast<unsigned long long>(want),
                                 static_cast<unsigned long long>(r.lib.unexpected),
                                 static_cast<unsigned long long>(r.floor.unexpected));
                    ok = false;
                }
            }
            if (!ok) return 3;
            std::printf("round trips per call as expected (new 2, replay 1, conflict 1)\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-bench: %s\n", e.what());
        return 1;
    }
    return 0;
}
