// idem-asio-bench — many requests in flight on one event loop thread (issue #13), next to the
// blocking API with a thread per request in flight, in the same run.
//
//   idem-asio-bench [--db CONNINFO] [--requests 10000] [--connections 8] [--threads 64] [--json FILE]
//
// Scenarios, each in its own child process (this program re-executed with --scenario), so that the
// peak RSS of the asynchronous one is its own (wait4's ru_maxrss of that child):
//   async:    one io_context thread, AsyncPostgresStore (pool_size = --connections); N coroutines
//             started at once, each async_execute_once on its own new key with an effect that
//             awaits a steady_timer of --effect-ms and returns a small idem::Response;
//   blocking: --threads threads, PostgresStore (pool_size = --blocking-pool, default = threads), the
//             same N requests on new keys through idem::execute_once, the effect sleeping
//             --effect-ms (std::this_thread::sleep_for).
// Then (unless --no-replay) a replay round of the same N keys in each scenario: every answer
// replayed with the same bytes, no effect run. Every answer is checked (executed, the right status
// and body; the effect ran exactly once per key). Prints one JSON object on stdout (progress on
// stderr): both scenarios' figures, the throughput ratio async / blocking, the async peak RSS, and
// a verdict per target. Exit status: 0 when every answer was right, 3 when one was not, 1 on an
// error, 2 on bad usage — never because of speed (figures are reported, not asserted).
// Without --db: $IDEM_TEST_DATABASE_URL, else a throwaway cluster (scripts/with-postgres.sh).
// docs/benchmarks.md ("Requests in flight: idem::asio") holds the latest figures.
#include <idem/asio.hpp>
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>
#include <libpq-fe.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../util.hpp"

#ifndef IDEM_BENCH_WITH_POSTGRES
#define IDEM_BENCH_WITH_POSTGRES ""
#endif

namespace {

namespace net = boost::asio;
using bench::Clock;
using bench::Histogram;

constexpr const char* kName = "idem-asio-bench";
const std::string kScope = "bench-asio";

struct Options {
    std::string db;
    std::size_t requests = 10'000;
    std::size_t connections = 8;    ///< async: AsyncPostgresStore pool_size
    std::size_t threads = 64;       ///< blocking: threads
    std::size_t blocking_pool = 0;  ///< blocking: PostgresStore pool_size (0: = threads)
    int effect_ms = 20;
    long long statement_timeout_ms = 0;  ///< 0: PostgresOptions' default (both stores)
    int rounds = 1;
    bool replay = true;
    bool keep_tables = false;
    std::string json;
    std::vector<std::string> scenarios{"async", "blocking"};
    // Internal (the parent passes these to a child):
    std::string scenario;
    std::string table;
};

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s",
                 R"(usage: idem-asio-bench [--db CONNINFO] [options]

  --requests N        requests per scenario, all on new keys (default 10000)
  --connections N     async: AsyncPostgresStore pool_size, one io_context thread (default 8)
  --threads N         blocking: threads calling idem::execute_once (default 64)
  --blocking-pool N   blocking: PostgresStore pool_size (default: = --threads)
  --effect-ms N       the effect's wait: an asio steady_timer (async) or sleep_for (blocking) (20)
  --statement-timeout-ms N  PostgresOptions::statement_timeout of both stores (default: the
                      library's, 5000); the async store's answer deadline follows from it
  --rounds N          rounds of both scenarios, order alternating (ABBA); the summary takes each
                      scenario's median throughput and the largest async peak RSS (default 1)
  --scenarios LIST    async,blocking (default both; one alone gives no ratio)
  --no-replay         skip the replay round (the same keys again: replayed, same bytes)
  --json FILE         also write the JSON object to FILE
  --keep-tables       leave the bench_asio_<pid>_* tables in place
Each scenario runs in its own child process; its peak RSS is the child's ru_maxrss (wait4).
Prints one JSON object on stdout. Exit 0: every answer right; 3: some answer wrong; 1: error.
Without --db: $IDEM_TEST_DATABASE_URL if set, else a throwaway cluster (scripts/with-postgres.sh).
)");
    std::exit(code);
}

long long to_int(const std::string& s, const char* what, long long min) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0' || v < min) {
        std::fprintf(stderr, "%s: %s: not an integer >= %lld: '%s'\n", kName, what, min, s.c_str());
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
                std::fprintf(stderr, "%s: %s needs a value\n", kName, arg.c_str());
                usage(2);
            }
            return args[++i];
        };
        const auto size = [&](const char* what, long long min) {
            return static_cast<std::size_t>(to_int(value(), what, min));
        };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--requests") {
            o.requests = size("--requests", 1);
        } else if (arg == "--connections") {
            o.connections = size("--connections", 1);
        } else if (arg == "--threads") {
            o.threads = size("--threads", 1);
        } else if (arg == "--blocking-pool") {
            o.blocking_pool = size("--blocking-pool", 1);
        } else if (arg == "--effect-ms") {
            o.effect_ms = static_cast<int>(to_int(value(), "--effect-ms", 0));
        } else if (arg == "--statement-timeout-ms") {
            o.statement_timeout_ms = to_int(value(), "--statement-timeout-ms", 1);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value(), "--rounds", 1));
        } else if (arg == "--scenarios") {
            o.scenarios.clear();
            std::stringstream in(value());
            for (std::string s; std::getline(in, s, ',');) {
                if (s != "async" && s != "blocking") usage(2);
                if (std::find(o.scenarios.begin(), o.scenarios.end(), s) == o.scenarios.end()) o.scenarios.push_back(s);
            }
            if (o.scenarios.empty()) usage(2);
        } else if (arg == "--no-replay") {
            o.replay = false;
        } else if (arg == "--json") {
            o.json = value();
        } else if (arg == "--keep-tables") {
            o.keep_tables = true;
        } else if (arg == "--scenario") {
            o.scenario = value();
            if (o.scenario != "async" && o.scenario != "blocking") usage(2);
        } else if (arg == "--table") {
            o.table = value();
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "%s: unknown argument '%s'\n", kName, arg.c_str());
            usage(2);
        }
    }
    if (o.blocking_pool == 0) o.blocking_pool = o.threads;
    return o;
}

std::string self_path() {
    char self[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) throw std::runtime_error(std::string("readlink /proc/self/exe: ") + std::strerror(errno));
    self[n] = '\0';
    return self;
}

// No --db and no IDEM_TEST_DATABASE_URL: run again under scripts/with-postgres.sh, which starts a
// throwaway cluster, exports IDEM_TEST_DATABASE_URL, and removes the cluster when we exit.
[[noreturn]] void reexec_under_with_postgres(int argc, char** argv) {
    const char* script = IDEM_BENCH_WITH_POSTGRES;
    if (script[0] == '\0' || ::access(script, X_OK) != 0) {
        std::fprintf(stderr, "%s: no --db given and %s is missing; pass --db CONNINFO\n", kName,
                     script[0] ? script : "scripts/with-postgres.sh");
        std::exit(2);
    }
    std::string self = self_path();
    std::vector<char*> args{const_cast<char*>(script), const_cast<char*>("--"), self.data()};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    std::fprintf(stderr, "%s: no --db: running under %s\n", kName, script);
    std::fflush(stderr);
    ::execv(script, args.data());
    std::perror("idem-asio-bench: exec with-postgres.sh");
    std::exit(2);
}

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
            out += c;
        }
    }
    return out + "\"";
}

std::string load_average() {
    std::ifstream in("/proc/loadavg");
    std::string a, b, c;
    in >> a >> b >> c;
    return a.empty() ? "?" : a + " " + b + " " + c;
}

// ---- the child: one scenario ----------------------------------------------------------------------

std::string body_for(const idem::Key& key) { return "ok " + key.value(); }
constexpr int kStatus = 201;

/// Figures of one round (new keys, or the replay of them) of one scenario.
struct Round {
    std::unique_ptr<Histogram> hist = std::make_unique<Histogram>();
    double wall_s = 0;
    std::uint64_t answered = 0;  ///< calls that completed (with a result or an exception)
    std::uint64_t correct = 0;   ///< right outcome, status and body
    std::uint64_t wrong_outcome = 0;
    std::uint64_t wrong_body = 0;
    std::uint64_t errors = 0;  ///< calls that threw
    std::string first_error;
    std::uint64_t in_flight_max = 0;  ///< calls started and not yet answered, at most
    std::uint64_t effects_max = 0;    ///< effects running at once, at most

    void merge(const Round& r) {
        hist->merge(*r.hist);
        answered += r.answered, correct += r.correct, wrong_outcome += r.wrong_outcome, wrong_body += r.wrong_body;
        errors += r.errors;
        if (first_error.empty()) first_error = r.first_error;
    }
    void check(const idem::Result<idem::Response>& r, idem::Outcome want, const idem::Key& key) {
        if (r.outcome() != want) {
            ++wrong_outcome;
        } else if (r.response().status != kStatus || r.response().body != body_for(key)) {
            ++wrong_body;
        } else {
            ++correct;
        }
    }
    void error(const char* what) {
        ++errors;
        if (first_error.empty()) first_error = what;
    }
    void print(const std::string& prefix, std::size_t n) const {
        std::printf("%s_requests %zu\n", prefix.c_str(), n);
        std::printf("%s_wall_s %.6f\n", prefix.c_str(), wall_s);
        std::printf("%s_ops_per_s %.3f\n", prefix.c_str(), wall_s > 0 ? static_cast<double>(n) / wall_s : 0.0);
        std::printf("%s_p50_ms %.3f\n", prefix.c_str(), hist->percentile_us(0.5) / 1000);
        std::printf("%s_p99_ms %.3f\n", prefix.c_str(), hist->percentile_us(0.99) / 1000);
        std::printf("%s_max_ms %.3f\n", prefix.c_str(), hist->percentile_us(1.0) / 1000);
        std::printf("%s_answered %llu\n", prefix.c_str(), static_cast<unsigned long long>(answered));
        std::printf("%s_correct %llu\n", prefix.c_str(), static_cast<unsigned long long>(correct));
        std::printf("%s_wrong_outcome %llu\n", prefix.c_str(), static_cast<unsigned long long>(wrong_outcome));
        std::printf("%s_wrong_body %llu\n", prefix.c_str(), static_cast<unsigned long long>(wrong_body));
        std::printf("%s_errors %llu\n", prefix.c_str(), static_cast<unsigned long long>(errors));
        std::printf("%s_in_flight_max %llu\n", prefix.c_str(), static_cast<unsigned long long>(in_flight_max));
        std::printf("%s_effects_max %llu\n", prefix.c_str(), static_cast<unsigned long long>(effects_max));
        std::printf("%s_vmhwm_mb %.2f\n", prefix.c_str(), bench::memory_now().peak_mb);
        if (!first_error.empty()) {
            std::string one_line = first_error;
            std::replace(one_line.begin(), one_line.end(), '\n', ' ');
            std::printf("%s_first_error %s\n", prefix.c_str(), one_line.c_str());
        }
    }
};

std::uint64_t ns_since(Clock::time_point start) {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

std::vector<idem::Key> make_keys(std::size_t n, const std::string& tag) {
    bench::Rng rng(static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                   (static_cast<std::uint64_t>(::getpid()) << 32));
    std::vector<idem::Key> keys;
    keys.reserve(n);
    for (std::size_t i = 0; i < n; ++i) keys.emplace_back(kScope, tag + bench::random_hex_key(rng));
    return keys;
}

/// What every scenario prints after its rounds: the effect count per key, the process's figures.
void print_common(const std::vector<std::uint32_t>& runs_per_key, const idem::StoreStats& stats) {
    std::uint64_t total = 0, not_once = 0;
    for (const auto r : runs_per_key) total += r, not_once += r != 1;
    rusage self{};
    ::getrusage(RUSAGE_SELF, &self);
    const auto secs = [](const timeval& t) {
        return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
    };
    std::printf("effects_run %llu\n", static_cast<unsigned long long>(total));
    std::printf("keys_not_run_once %llu\n", static_cast<unsigned long long>(not_once));
    std::printf("round_trips %llu\n", static_cast<unsigned long long>(stats.round_trips));
    std::printf("retries %llu\n", static_cast<unsigned long long>(stats.retries));
    std::printf("connections_opened %llu\n", static_cast<unsigned long long>(stats.connections_opened));
    std::printf("cpu_s %.3f\n", secs(self.ru_utime) + secs(self.ru_stime));
    std::printf("vmhwm_mb %.2f\n", bench::memory_now().peak_mb);
}

// ---- async: one io_context thread, N coroutines at once -------------------------------------------

struct AsyncRun {
    idem::asio::AsyncPostgresStore& store;
    const std::vector<idem::Key>& keys;
    const idem::Fingerprint& fp;
    std::chrono::milliseconds effect;
    std::vector<std::uint32_t>& runs_per_key;
    Round& round;
    std::uint64_t in_flight = 0;
    std::uint64_t effects = 0;
    Clock::time_point last_done{};
};

net::awaitable<void> async_request(AsyncRun& run, std::size_t i, bool replay) {
    const auto start = Clock::now();
    run.round.in_flight_max = std::max(run.round.in_flight_max, ++run.in_flight);
    try {
        const idem::Key& key = run.keys[i];
        auto r = co_await idem::asio::async_execute_once(
            run.store, key, run.fp,
            [&run, i]() -> net::awaitable<idem::Response> {
                run.round.effects_max = std::max(run.round.effects_max, ++run.effects);
                net::steady_timer timer(co_await net::this_coro::executor, run.effect);
                co_await timer.async_wait(net::use_awaitable);
                --run.effects;
                ++run.runs_per_key[i];
                co_return idem::Response{kStatus, body_for(run.keys[i])};
            },
            net::use_awaitable);
        run.round.check(r, replay ? idem::Outcome::replayed : idem::Outcome::executed, key);
    } catch (const std::exception& e) {
        run.round.error(e.what());
    }
    --run.in_flight;
    ++run.round.answered;
    run.round.hist->record(ns_since(start));
    run.last_done = Clock::now();
}

void async_round(net::io_context& io, AsyncRun& run, bool replay) {
    const auto t0 = Clock::now();
    // Every request is started before the loop runs: all N are in flight at once.
    for (std::size_t i = 0; i < run.keys.size(); ++i) net::co_spawn(io, async_request(run, i, replay), net::detached);
    io.run();  // returns when every request has completed (an idle store keeps no work)
    io.restart();
    run.round.wall_s = bench::seconds_between(t0, run.last_done);
}

int run_async(const Options& o) {
    net::io_context io(1);
    idem::PostgresOptions po;
    po.table = o.table;
    po.pool_size = o.connections;
    if (o.statement_timeout_ms > 0) po.statement_timeout = std::chrono::milliseconds(o.statement_timeout_ms);
    idem::asio::AsyncPostgresStore store(io.get_executor(), o.db, po);
    store.blocking().ensure_schema();
    const idem::Fingerprint fp = idem::fingerprint("idem-asio-bench", 1);
    const std::chrono::milliseconds effect(o.effect_ms);

    // Warm-up, untimed: as many requests at once as connections, so every connection is open.
    {
        const auto warm_keys = make_keys(o.connections, "warm-");
        std::vector<std::uint32_t> warm_runs(warm_keys.size());
        Round warm;
        AsyncRun run{store, warm_keys, fp, effect, warm_runs, warm};
        async_round(io, run, false);
        if (warm.correct != warm_keys.size()) {
            std::fprintf(stderr, "%s: async warm-up failed: %s\n", kName, warm.first_error.c_str());
            return 1;
        }
    }

    const auto keys = make_keys(o.requests, "");
    std::printf("rss_before_mb %.2f\n", bench::memory_now().rss_mb);
    std::vector<std::uint32_t> runs_per_key(keys.size());
    Round fresh;
    AsyncRun run_new{store, keys, fp, effect, runs_per_key, fresh};
    async_round(io, run_new, false);
    fresh.print("new", keys.size());
    if (o.replay) {
        Round again;
        AsyncRun run_replay{store, keys, fp, effect, runs_per_key, again};
        async_round(io, run_replay, true);
        again.print("replay", keys.size());
    }
    print_common(runs_per_key, store.stats());
    return 0;
}

// ---- blocking: T threads, execute_once --------------------------------------------------------------

int run_blocking(const Options& o) {
    idem::PostgresOptions po;
    po.table = o.table;
    po.pool_size = o.blocking_pool;
    if (o.statement_timeout_ms > 0) po.statement_timeout = std::chrono::milliseconds(o.statement_timeout_ms);
    idem::PostgresStore store(o.db, po);
    store.ensure_schema();
    const idem::Fingerprint fp = idem::fingerprint("idem-asio-bench", 1);
    const std::chrono::milliseconds effect(o.effect_ms);
    const auto keys = make_keys(o.requests, "");
    const auto warm_keys = make_keys(o.threads, "warm-");
    std::vector<std::atomic<std::uint32_t>> runs(keys.size());
    std::atomic<std::uint64_t> in_flight{0}, effects{0}, in_flight_max{0}, effects_max{0};
    const auto raise = [](std::atomic<std::uint64_t>& max, std::uint64_t v) {
        for (auto m = max.load(); v > m && !max.compare_exchange_weak(m, v);) {
        }
    };

    const int phases = o.replay ? 2 : 1;
    std::vector<Round> rounds(o.threads * static_cast<std::size_t>(phases));  // [phase * threads + thread]
    std::atomic<std::size_t> next{0};
    std::atomic<bool> warm_ok{true};
    // The barrier's completion stamps the time before any thread is released: start and end of
    // each phase as the workers see them (the main thread may be scheduled late).
    std::vector<Clock::time_point> marks;
    marks.reserve(static_cast<std::size_t>(1 + 2 * phases));
    const auto mark = [&marks]() noexcept { marks.push_back(Clock::now()); };
    std::barrier sync(static_cast<std::ptrdiff_t>(o.threads + 1), mark);
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < o.threads; ++t) {
        workers.emplace_back([&, t] {
            try {
                // Warm-up, untimed: one call per thread at once, so every connection is open.
                auto w = idem::execute_once(store, warm_keys[t], fp, [] { return idem::Response{kStatus, "warm"}; });
                if (w.outcome() != idem::Outcome::executed) warm_ok = false;
            } catch (const std::exception& e) {
                std::fprintf(stderr, "%s: blocking warm-up: %s\n", kName, e.what());
                warm_ok = false;
            }
            sync.arrive_and_wait();  // warmed up
            for (int phase = 0; phase < phases; ++phase) {
                const bool replay = phase == 1;
                Round& round = rounds[static_cast<std::size_t>(phase) * o.threads + t];
                sync.arrive_and_wait();  // start
                for (std::size_t i = next.fetch_add(1); i < keys.size(); i = next.fetch_add(1)) {
                    const auto start = Clock::now();
                    raise(in_flight_max, ++in_flight);
                    try {
                        auto r = idem::execute_once(store, keys[i], fp, [&, i] {
                            raise(effects_max, ++effects);
                            std::this_thread::sleep_for(effect);
                            --effects;
                            runs[i].fetch_add(1);
                            return idem::Response{kStatus, body_for(keys[i])};
                        });
                        round.check(r, replay ? idem::Outcome::replayed : idem::Outcome::executed, keys[i]);
                    } catch (const std::exception& e) {
                        round.error(e.what());
                    }
                    --in_flight;
                    ++round.answered;
                    round.hist->record(ns_since(start));
                }
                sync.arrive_and_wait();  // done
            }
        });
    }
    sync.arrive_and_wait();  // every thread warmed up
    std::printf("rss_before_mb %.2f\n", bench::memory_now().rss_mb);
    for (int phase = 0; phase < phases; ++phase) {
        next = 0;
        in_flight_max = 0, effects_max = 0;
        sync.arrive_and_wait();
        sync.arrive_and_wait();
        const auto p = static_cast<std::size_t>(1 + 2 * phase);  // marks[0]: the warm-up's end
        const double wall = bench::seconds_between(marks[p], marks[p + 1]);
        Round total;
        for (std::size_t t = 0; t < o.threads; ++t)
            total.merge(rounds[static_cast<std::size_t>(phase) * o.threads + t]);
        total.wall_s = wall;
        total.in_flight_max = in_flight_max;
        total.effects_max = effects_max;
        total.print(phase == 0 ? "new" : "replay", keys.size());
    }
    for (auto& w : workers) w.join();
    if (!warm_ok) {
        std::fprintf(stderr, "%s: blocking warm-up failed\n", kName);
        return 1;
    }
    std::vector<std::uint32_t> runs_per_key(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) runs_per_key[i] = runs[i].load();
    print_common(runs_per_key, store.stats());
    return 0;
}

int run_child(const Options& o) {
    try {
        const int rc = o.scenario == "async" ? run_async(o) : run_blocking(o);
        std::fflush(stdout);
        return rc;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s --scenario %s: %s\n", kName, o.scenario.c_str(), e.what());
        return 1;
    }
}

// ---- the parent ---------------------------------------------------------------------------------------

/// A child's figures ("key value" lines) and the parent's view of it.
struct ScenarioRun {
    std::string scenario;
    std::map<std::string, std::string> figures;
    int exit_code = -1;
    double peak_rss_mb = 0;  ///< the child's ru_maxrss (wait4)

    [[nodiscard]] double num(const std::string& key) const {
        const auto it = figures.find(key);
        return it == figures.end() ? NAN : std::strtod(it->second.c_str(), nullptr);
    }
    [[nodiscard]] std::string str(const std::string& key) const {
        const auto it = figures.find(key);
        return it == figures.end() ? std::string() : it->second;
    }
    /// Every answer right, in every round this child ran.
    [[nodiscard]] bool correct(std::size_t n, bool replay) const {
        if (exit_code != 0) return false;
        const auto round_ok = [&](const std::string& p) {
            return num(p + "_correct") == static_cast<double>(n) && num(p + "_answered") == static_cast<double>(n);
        };
        return round_ok("new") && (!replay || round_ok("replay")) && num("effects_run") == static_cast<double>(n) &&
               num("keys_not_run_once") == 0;
    }
};

ScenarioRun spawn_scenario(const Options& o, const std::string& scenario, const std::string& table) {
    const std::string self = self_path();
    // The conninfo goes by the environment (it may hold a password: not on a command line).
    std::vector<std::string> args{self,
                                  "--scenario",
                                  scenario,
                                  "--table",
                                  table,
                                  "--requests",
                                  std::to_string(o.requests),
                                  "--connections",
                                  std::to_string(o.connections),
                                  "--threads",
                                  std::to_string(o.threads),
                                  "--blocking-pool",
                                  std::to_string(o.blocking_pool),
                                  "--effect-ms",
                                  std::to_string(o.effect_ms)};
    if (o.statement_timeout_ms > 0) {
        args.emplace_back("--statement-timeout-ms");
        args.push_back(std::to_string(o.statement_timeout_ms));
    }
    if (!o.replay) args.emplace_back("--no-replay");
    const bench::ChildRun child = bench::run_child(args, false);  // its stderr is ours: its progress lines show
    if (child.status < 0) throw std::runtime_error("idem-asio-bench: " + child.output);
    const int status = child.status;
    const rusage& ru = child.usage;
    const std::string& out = child.output;
    ScenarioRun r;
    r.scenario = scenario;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    r.peak_rss_mb = static_cast<double>(ru.ru_maxrss) / 1024.0;  // kilobytes on Linux
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
        const auto sp = line.find(' ');
        if (sp != std::string::npos) r.figures[line.substr(0, sp)] = line.substr(sp + 1);
    }
    return r;
}

/// libpq on the side: server settings, and dropping the scenarios' tables.
class Db {
public:
    explicit Db(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str())) {
        if (PQstatus(conn_) != CONNECTION_OK) {
            const std::string why = PQerrorMessage(conn_);
            PQfinish(conn_);
            throw std::runtime_error("cannot connect: " + why);
        }
    }
    ~Db() { PQfinish(conn_); }
    Db(const Db&) = delete;
    Db& operator=(const Db&) = delete;
    std::string exec(const std::string& sql) {
        PGresult* r = PQexec(conn_, sql.c_str());
        const auto st = PQresultStatus(r);
        std::string v = st == PGRES_TUPLES_OK && PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "";
        const std::string err = PQresultErrorMessage(r);
        PQclear(r);
        if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK) throw std::runtime_error(sql + ": " + err);
        return v;
    }

private:
    PGconn* conn_;
};

std::string json_round(const ScenarioRun& r, const std::string& p) {
    std::string s = fmt::format(
        "{{\"ops_per_s\": {}, \"wall_s\": {}, \"p50_ms\": {}, \"p99_ms\": {}, \"max_ms\": {}, \"answered\": {}, "
        "\"correct\": {}, \"wrong_outcome\": {}, \"wrong_body\": {}, \"errors\": {}, \"in_flight_max\": {}, "
        "\"effects_at_once_max\": {}, \"vmhwm_mb_after\": {}",
        json_number(r.num(p + "_ops_per_s")), json_number(r.num(p + "_wall_s")), json_number(r.num(p + "_p50_ms")),
        json_number(r.num(p + "_p99_ms")), json_number(r.num(p + "_max_ms")), json_number(r.num(p + "_answered")),
        json_number(r.num(p + "_correct")), json_number(r.num(p + "_wrong_outcome")),
        json_number(r.num(p + "_wrong_body")), json_number(r.num(p + "_errors")),
        json_number(r.num(p + "_in_flight_max")), json_number(r.num(p + "_effects_max")),
        json_number(r.num(p + "_vmhwm_mb")));
    if (const auto e = r.str(p + "_first_error"); !e.empty()) s += ", \"first_error\": " + json_string(e);
    return s + "}";
}

std::string json_scenario(const ScenarioRun& r, const Options& o) {
    const bool async = r.scenario == "async";
    std::string s = fmt::format(
        "{{\"threads\": {}, \"connections\": {}, \"requests\": {}, \"correct\": {}, \"exit_code\": {}, \"new\": {}",
        async ? 1 : o.threads, async ? o.connections : o.blocking_pool, o.requests,
        r.correct(o.requests, o.replay) ? "true" : "false", r.exit_code, json_round(r, "new"));
    if (o.replay) s += ", \"replay\": " + json_round(r, "replay");
    s += fmt::format(
        ", \"effects_run\": {}, \"keys_not_run_once\": {}, \"round_trips\": {}, \"retries\": {}, "
        "\"connections_opened\": {}, \"cpu_s\": {}, \"rss_before_mb\": {}, \"peak_rss_mb\": {}, \"vmhwm_mb\": {}}}",
        json_number(r.num("effects_run")), json_number(r.num("keys_not_run_once")), json_number(r.num("round_trips")),
        json_number(r.num("retries")), json_number(r.num("connections_opened")), json_number(r.num("cpu_s")),
        json_number(r.num("rss_before_mb")), json_number(r.peak_rss_mb), json_number(r.num("vmhwm_mb")));
    return s;
}

double median(std::vector<double> v) {
    v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

int run_parent(const Options& o) {
    std::string server;
    {
        Db db(o.db);
        server = fmt::format("server_version={}, synchronous_commit={}, fsync={}, max_connections={}",
                             db.exec("SHOW server_version"), db.exec("SHOW synchronous_commit"), db.exec("SHOW fsync"),
                             db.exec("SHOW max_connections"));
    }
    const std::string load_before = load_average();
    std::fprintf(stderr,
                 "%s: %zu requests per scenario, effect %d ms; async: 1 thread, %zu connections; blocking: "
                 "%zu threads, %zu connections; %u CPUs, load %s; %s\n",
                 kName, o.requests, o.effect_ms, o.connections, o.threads, o.blocking_pool,
                 std::thread::hardware_concurrency(), load_before.c_str(), server.c_str());

    const std::string prefix = "bench_asio_" + std::to_string(::getpid());
    std::vector<std::string> tables;
    std::vector<std::vector<ScenarioRun>> rounds;
    for (int round = 0; round < o.rounds; ++round) {
        std::vector<std::string> order = o.scenarios;
        if (round % 2 == 1) std::reverse(order.begin(), order.end());  // ABBA
        std::vector<ScenarioRun> runs;
        for (const auto& scenario : order) {
            const std::string table = fmt::format("{}_{}_{}", prefix, scenario, round);
            tables.push_back(table);
            ScenarioRun r = spawn_scenario(o, scenario, table);
            std::fprintf(stderr,
                         "%s: round %d %-8s %8.0f req/s  wall %.2f s  p50 %.1f ms  p99 %.1f ms  in flight max %.0f  "
                         "peak RSS %.1f MB  %s\n",
                         kName, round + 1, scenario.c_str(), r.num("new_ops_per_s"), r.num("new_wall_s"),
                         r.num("new_p50_ms"), r.num("new_p99_ms"), r.num("new_in_flight_max"), r.peak_rss_mb,
                         r.exit_code != 0                  ? fmt::format("FAILED (exit {})", r.exit_code).c_str()
                         : r.correct(o.requests, o.replay) ? "all answers right"
                                                           : "WRONG ANSWERS");
            runs.push_back(std::move(r));
        }
        rounds.push_back(std::move(runs));
    }
    if (!o.keep_tables) {
        try {
            Db db(o.db);
            for (const auto& t : tables) db.exec("DROP TABLE IF EXISTS " + t);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "%s: dropping the tables: %s\n", kName, e.what());
        }
    }
    const std::string load_after = load_average();

    // Summary: medians over rounds; the largest async peak RSS.
    bool all_correct = true;
    std::vector<double> async_ops, blocking_ops;
    double async_rss = NAN;
    std::uint64_t answers = 0;
    for (const auto& runs : rounds) {
        for (const auto& r : runs) {
            all_correct = all_correct && r.correct(o.requests, o.replay);
            answers += o.requests * (o.replay ? 2 : 1);
            (r.scenario == "async" ? async_ops : blocking_ops).push_back(r.num("new_ops_per_s"));
            if (r.scenario == "async")
                async_rss = std::isfinite(async_rss) ? std::max(async_rss, r.peak_rss_mb) : r.peak_rss_mb;
        }
    }
    const double a = median(async_ops), b = median(blocking_ops);
    const double ratio = a / b;
    const bool ratio_ok = std::isfinite(ratio) && ratio >= 1.0;
    const bool rss_ok = std::isfinite(async_rss) && async_rss <= 100.0;

    std::vector<std::string> verdicts;
    verdicts.push_back(
        fmt::format("{} correctness: {} of {} answers right (executed or replayed, right bytes; each "
                    "effect ran exactly once)",
                    all_correct ? "PASS" : "FAIL", all_correct ? answers : 0, answers));
    verdicts.push_back(std::isfinite(ratio) ? fmt::format("{} throughput: async / blocking = {:.2f} (target >= 1.0)",
                                                          ratio_ok ? "PASS" : "FAIL", ratio)
                                            : std::string("SKIP throughput: needs both scenarios"));
    verdicts.push_back(std::isfinite(async_rss) ? fmt::format("{} memory: async peak RSS {:.1f} MB (target <= 100 MB)",
                                                              rss_ok ? "PASS" : "FAIL", async_rss)
                                                : std::string("SKIP memory: the async scenario did not run"));

    std::string s = "{\n";
    s += fmt::format("  \"requests\": {}, \"effect_ms\": {}, \"rounds\": {}, \"replay\": {},\n", o.requests,
                     o.effect_ms, o.rounds, o.replay ? "true" : "false");
    s += fmt::format("  \"cpus\": {}, \"load_before\": {}, \"load_after\": {}, \"server\": {},\n",
                     std::thread::hardware_concurrency(), json_string(load_before), json_string(load_after),
                     json_string(server));
    s += "  \"runs\": [";
    for (std::size_t i = 0; i < rounds.size(); ++i) {
        s += i ? ",\n    {" : "\n    {";
        for (std::size_t j = 0; j < rounds[i].size(); ++j) {
            s +=
                fmt::format("{}\"{}\": {}", j ? ",\n     " : "", rounds[i][j].scenario, json_scenario(rounds[i][j], o));
        }
        s += "}";
    }
    s += "\n  ],\n";
    s += fmt::format(
        "  \"async_ops_per_s\": {}, \"blocking_ops_per_s\": {}, \"ratio\": {}, \"async_peak_rss_mb\": {},\n",
        json_number(a), json_number(b), json_number(ratio), json_number(async_rss));
    s += fmt::format("  \"targets\": {{\"all_correct\": {}, \"ratio_ge_1\": {}, \"async_rss_le_100_mb\": {}}},\n",
                     all_correct ? "true" : "false", std::isfinite(ratio) ? (ratio_ok ? "true" : "false") : "null",
                     std::isfinite(async_rss) ? (rss_ok ? "true" : "false") : "null");
    s += "  \"verdicts\": [";
    for (std::size_t i = 0; i < verdicts.size(); ++i) s += (i ? ",\n    " : "\n    ") + json_string(verdicts[i]);
    s += "\n  ]\n}\n";

    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    for (const auto& v : verdicts) std::fprintf(stderr, "%s: %s\n", kName, v.c_str());
    if (!o.json.empty()) {
        std::FILE* f = std::fopen(o.json.c_str(), "w");
        if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
            std::fprintf(stderr, "%s: cannot write %s\n", kName, o.json.c_str());
            return 1;
        }
    }
    return all_correct ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
    Options o = parse(argc, argv);
    if (!o.scenario.empty()) {
        // A child: the parent passes the conninfo in the environment.
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (o.db.empty() && env != nullptr) o.db = env;
        if (o.db.empty() || o.table.empty()) usage(2);
        return run_child(o);
    }
    if (o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') reexec_under_with_postgres(argc, argv);
        o.db = env;
    }
    ::setenv("IDEM_TEST_DATABASE_URL", o.db.c_str(), 1);  // for the children
    try {
        return run_parent(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", kName, e.what());
        return 1;
    }
}
