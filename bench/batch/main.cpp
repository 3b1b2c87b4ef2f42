// idem-batch-bench — messages/s of execute_batch against one-at-a-time execute_once.
//
//   idem-batch-bench [--db CONNINFO] [--messages N] [--batch 64] [--threads 1] [--rounds 3]
//                    [--min-ratio X]
//
// Two cases, with a no-op effect:
//   fresh       every message has a new key: claim, effect, save (execute_once: 2 round trips each)
//   replay      every message was completed before (all duplicates): the claim answers with the
//               stored result (execute_once: 1 round trip each)
// and for each, these methods: execute_once one message at a time, and execute_batch with batches of
// 1, 16, 64, 256 (and --batch, if it is another size). Every phase handles N messages, split over
// --threads threads that share one PostgresStore (pool size = threads). Same process, same server,
// same table; the phases of a round alternate fresh / replay per method, and the order of the methods
// rotates from round to round, so that drift (table growth, checkpoints, caches) hits all alike.
// The figures are the sums over all rounds: messages / seconds, and round trips per message.
//
// Without --db it uses $IDEM_TEST_DATABASE_URL; without that either, it re-executes itself under
// scripts/with-postgres.sh (a throwaway cluster):
//   scripts/with-postgres.sh build/batch-rel/bench/batch/idem-batch-bench --db "$IDEM_TEST_DATABASE_URL"
// --min-ratio X: exit 1 unless fresh messages/s at --batch is at least X times execute_once's.
#include <libpq-fe.h>
#include <unistd.h>
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <latch>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef IDEM_BENCH_WITH_POSTGRES
#define IDEM_BENCH_WITH_POSTGRES ""
#endif

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::string_literals;

struct Options {
    std::string db;
    std::size_t messages = 4000;
    std::size_t batch = 64;
    std::size_t threads = 1;
    std::size_t rounds = 3;
    double min_ratio = 0;
};

[[noreturn]] void usage(const std::string& problem) {
    if (!problem.empty()) std::fprintf(stderr, "idem-batch-bench: %s\n", problem.c_str());
    std::fprintf(stderr,
                 "usage: idem-batch-bench [--db CONNINFO] [--messages N] [--batch 64] [--threads 1] [--rounds 3]\n"
                 "                        [--min-ratio X]\n");
    std::exit(2);
}

std::size_t to_size(const std::string& v, const char* what, std::size_t max) {
    try {
        std::size_t pos = 0;
        const unsigned long long n = std::stoull(v, &pos);
        if (pos == v.size() && n >= 1 && n <= max) return static_cast<std::size_t>(n);
    } catch (const std::exception&) {
    }
    usage(std::string(what) + " must be 1.." + std::to_string(max));
}

Options parse_args(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--messages") {
            o.messages = to_size(value(), "--messages", 10'000'000);
        } else if (arg == "--batch") {
            o.batch = to_size(value(), "--batch", 100'000);
        } else if (arg == "--threads") {
            o.threads = to_size(value(), "--threads", 256);
        } else if (arg == "--rounds") {
            o.rounds = to_size(value(), "--rounds", 1000);
        } else if (arg == "--min-ratio") {
            try {
                o.min_ratio = std::stod(value());
            } catch (const std::exception&) {
                usage("--min-ratio needs a number");
            }
        } else if (arg == "--help" || arg == "-h") {
            usage("");
        } else {
            usage("unknown argument " + arg);
        }
    }
    if (o.messages < o.threads) usage("--messages must be at least --threads");
    return o;
}

// No --db and no IDEM_TEST_DATABASE_URL: run again under scripts/with-postgres.sh, which starts a
// throwaway cluster, exports IDEM_TEST_DATABASE_URL, and removes the cluster when we exit.
[[noreturn]] void reexec_under_with_postgres(int argc, char** argv) {
    const char* script = IDEM_BENCH_WITH_POSTGRES;
    if (script[0] == '\0' || ::access(script, X_OK) != 0) {
        std::fprintf(stderr, "idem-batch-bench: no --db given and scripts/with-postgres.sh is missing\n");
        std::exit(2);
    }
    char self[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        std::perror("idem-batch-bench: readlink /proc/self/exe");
        std::exit(2);
    }
    self[n] = '\0';
    std::vector<char*> args{const_cast<char*>(script), const_cast<char*>("--"), self};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    std::fprintf(stderr, "idem-batch-bench: no --db: running under %s\n", script);
    std::fflush(stderr);
    ::execv(script, args.data());
    std::perror("idem-batch-bench: exec with-postgres.sh");
    std::exit(2);
}

/// One plain libpq connection, for set-up and clean-up only.
class Admin {
public:
    explicit Admin(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str()), &PQfinish) {
        if (!conn_ || PQstatus(conn_.get()) != CONNECTION_OK) {
            throw std::runtime_error("cannot connect: " + std::string(conn_ ? PQerrorMessage(conn_.get()) : "?"));
        }
        PQsetNoticeProcessor(
            conn_.get(), [](void*, const char*) {}, nullptr);
    }
    std::string value(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::vector<const char*> values;
        for (const auto& p : params) values.push_back(p.c_str());
        std::unique_ptr<PGresult, decltype(&PQclear)> r(
            PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(), nullptr,
                         nullptr, 0),
            &PQclear);
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            throw std::runtime_error(sql + ": " + PQerrorMessage(conn_.get()));
        }
        return PQntuples(r.get()) > 0 ? std::string(PQgetvalue(r.get(), 0, 0)) : std::string();
    }

private:
    std::unique_ptr<PGconn, decltype(&PQfinish)> conn_;
};

enum class Case { fresh, replay };

struct Method {
    std::string name;
    std::size_t batch = 0;  // 0: execute_once, one message at a time
};

struct Totals {
    std::uint64_t messages = 0, round_trips = 0, wrong = 0;
    double seconds = 0;
    [[nodiscard]] double rate() const { return seconds > 0 ? static_cast<double>(messages) / seconds : 0; }
    [[nodiscard]] double rt_per_message() const {
        return messages ? static_cast<double>(round_trips) / static_cast<double>(messages) : 0;
    }
};

const std::string kScope = "batch-bench";
const idem::Fingerprint& fp() {
    static const idem::Fingerprint f = idem::fingerprint("batch-bench"s);
    return f;
}

/// Handles keys[begin, end) with `method`; returns how many did not end as expected.
std::uint64_t run_slice(idem::IdempotencyStore& store, const Method& method, const std::vector<idem::Key>& keys,
                        std::size_t begin, std::size_t end, Case c) {
    const auto want_once = c == Case::fresh ? idem::Outcome::executed : idem::Outcome::replayed;
    const auto want_batch = c == Case::fresh ? idem::BatchOutcome::executed : idem::BatchOutcome::replayed;
    const auto noop = [] { return "ok"s; };
    std::uint64_t wrong = 0;
    if (method.batch == 0) {
        for (std::size_t i = begin; i < end; ++i) {
            if (idem::execute_once(store, keys[i], fp(), noop).outcome() != want_once) ++wrong;
        }
        return wrong;
    }
    std::vector<idem::Message> batch;
    batch.reserve(method.batch);
    for (std::size_t i = begin; i < end; i += method.batch) {
        batch.clear();
        for (std::size_t j = i; j < std::min(end, i + method.batch); ++j) batch.push_back({keys[j], fp()});
        for (const auto& r : idem::execute_batch(store, batch, [](std::size_t) { return "ok"s; })) {
            if (r.outcome != want_batch) ++wrong;
        }
    }
    return wrong;
}

/// One phase: `keys` split over the threads; wall time from the start signal to the last thread.
void run_phase(idem::PostgresStore& store, const Options& o, const Method& method, const std::vector<idem::Key>& keys,
               Case c, Totals& totals) {
    std::latch ready(static_cast<std::ptrdiff_t>(o.threads));
    std::latch go(1);
    std::atomic<std::uint64_t> wrong{0};
    std::vector<std::thread> threads;
    const std::size_t per = keys.size() / o.threads;
    for (std::size_t t = 0; t < o.threads; ++t) {
        const std::size_t begin = t * per;
        const std::size_t end = t + 1 == o.threads ? keys.size() : begin + per;
        threads.emplace_back([&, begin, end] {
            ready.count_down();
            go.wait();
            wrong += run_slice(store, method, keys, begin, end, c);
        });
    }
    ready.wait();
    const auto rt_before = store.stats().round_trips;
    const auto started = Clock::now();
    go.count_down();
    for (auto& th : threads) th.join();
    totals.seconds += std::chrono::duration<double>(Clock::now() - started).count();
    totals.round_trips += store.stats().round_trips - rt_before;
    totals.messages += keys.size();
    totals.wrong += wrong.load();
}

std::vector<idem::Key> make_keys(const std::string& prefix, std::size_t n) {
    std::vector<idem::Key> keys;
    keys.reserve(n);
    for (std::size_t i = 0; i < n; ++i) keys.emplace_back(kScope, prefix + std::to_string(i));
    return keys;
}

}  // namespace

int main(int argc, char** argv) {
    Options o = parse_args(argc, argv);
    if (o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') reexec_under_with_postgres(argc, argv);
        o.db = env;
    }

    std::vector<Method> methods{{"execute_once", 0}};
    std::vector<std::size_t> sizes{1, 16, 64, 256};
    if (std::find(sizes.begin(), sizes.end(), o.batch) == sizes.end()) sizes.push_back(o.batch);
    std::sort(sizes.begin(), sizes.end());
    for (std::size_t s : sizes) methods.push_back({"execute_batch " + std::to_string(s), s});

    const std::string table = "idem_batch_bench_" + std::to_string(::getpid());
    try {
        Admin admin(o.db);
        const std::string server = admin.value("SHOW server_version");
        const std::string sync = admin.value("SHOW synchronous_commit");
        std::printf(
            "idem-batch-bench %s: %zu messages per phase, %zu thread(s), %zu round(s); PostgreSQL %s, "
            "synchronous_commit=%s\n",
            idem::version_string, o.messages, o.threads, o.rounds, server.c_str(), sync.c_str());
        if (sync != "on") std::printf("WARNING: synchronous_commit is not on: these are not the durable figures\n");
        std::fflush(stdout);

        idem::PostgresOptions options;
        options.table = table;
        options.pool_size = o.threads;
        idem::PostgresStore store(o.db, options);
        store.ensure_schema();

        // Warm-up: every pooled connection connects and prepares its statements; the replay set is
        // completed once (not timed).
        {
            Totals ignored;
            run_phase(store, o, methods.back(), make_keys("warm-batch-", 64 * o.threads), Case::fresh, ignored);
            run_phase(store, o, methods.front(), make_keys("warm-once-", 8 * o.threads), Case::fresh, ignored);
        }
        const std::vector<idem::Key> replay_keys = make_keys("replay-", o.messages);
        {
            Totals setup;
            run_phase(store, o, Method{"setup", 256}, replay_keys, Case::fresh, setup);
            if (setup.wrong) throw std::runtime_error("setting up the replay keys failed");
        }

        std::map<std::pair<int, std::size_t>, Totals> totals;  // (case, method index)
        for (std::size_t round = 0; round < o.rounds; ++round) {
            for (std::size_t k = 0; k < methods.size(); ++k) {
                const std::size_t m = (k + round) % methods.size();  // rotate the order per round
                const auto fresh =
                    make_keys("fresh-" + std::to_string(round) + "-" + std::to_string(m) + "-", o.messages);
                run_phase(store, o, methods[m], fresh, Case::fresh, totals[{0, m}]);
                run_phase(store, o, methods[m], replay_keys, Case::replay, totals[{1, m}]);
            }
        }

        std::uint64_t wrong = 0;
        std::printf("\n%-20s | %35s | %35s\n", "", "fresh keys (no-op effect)", "all duplicates (replays)");
        std::printf("%-20s | %12s %9s %12s | %12s %9s %12s\n", "method", "messages/s", "rt/msg", "vs once",
                    "messages/s", "rt/msg", "vs once");
        for (std::size_t m = 0; m < methods.size(); ++m) {
            const Totals& f = totals[{0, m}];
            const Totals& r = totals[{1, m}];
            wrong += f.wrong + r.wrong;
            std::printf("%-20s | %12.0f %9.3f %11.2fx | %12.0f %9.3f %11.2fx\n", methods[m].name.c_str(), f.rate(),
                        f.rt_per_message(), f.rate() / totals[{0, 0}].rate(), r.rate(), r.rt_per_message(),
                        r.rate() / totals[{1, 0}].rate());
        }
        const auto at =
            std::find_if(methods.begin(), methods.end(), [&](const Method& m) { return m.batch == o.batch; });
        const std::size_t mi = static_cast<std::size_t>(at - methods.begin());
        const double fresh_ratio = totals[{0, mi}].rate() / totals[{0, 0}].rate();
        const double replay_ratio = totals[{1, mi}].rate() / totals[{1, 0}].rate();
        std::printf("\nratio at batch %zu vs execute_once: fresh %.2fx, replays %.2fx (target >= 5x)\n", o.batch,
                    fresh_ratio, replay_ratio);

        Admin(o.db).value("DROP TABLE IF EXISTS " + table);
        Admin(o.db).value("DELETE FROM idem_schema_version WHERE table_name = $1", {table});
        if (wrong) {
            std::printf("ERROR: %llu messages did not end as expected (executed / replayed)\n",
                        static_cast<unsigned long long>(wrong));
            return 1;
        }
        if (o.min_ratio > 0 && fresh_ratio < o.min_ratio) {
            std::printf("FAIL: fresh ratio %.2fx below --min-ratio %.2f\n", fresh_ratio, o.min_ratio);
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-batch-bench: %s\n", e.what());
        try {
            Admin(o.db).value("DROP TABLE IF EXISTS " + table);
        } catch (...) {
        }
        return 1;
    }
}
