// Races on the same keys — between threads of one process, and between OS processes — on
// PostgreSQL. The effect records itself in an `effects` table over its own connection, so "exactly
// once" is checked by the database, not only by counters in this process. Needs
// IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "store_env.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

extern char** environ;

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

namespace {

std::string require_db() {
    const auto url = idem_test::database_url();
    if (url.empty())
        FAIL(idem_test::kNoDatabaseMessage);
    return url;
}

/// An idem table and an effects table, both dropped at the end.
struct Tables {
    std::string conninfo;
    std::string idem = idem_test::unique_name("idem_t");
    std::string effects = idem_test::unique_name("idem_effects");

    explicit Tables(std::string url) : conninfo(std::move(url)) {
        // No unique constraint on purpose: a second run of an effect must show up as a second row.
        PgConn(conninfo).exec(
            "CREATE TABLE " + effects +
            " (scope text NOT NULL, key text NOT NULL, pid int NOT NULL, tid int NOT NULL, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())");
    }
    ~Tables() {
        try {
            PgConn conn(conninfo);
            conn.exec("DROP TABLE IF EXISTS " + idem + ", " + effects);
            conn.exec("DELETE FROM idem_schema_version WHERE table_name = $1", {idem});
        } catch (...) {
        }
    }
    Tables(const Tables&) = delete;
    Tables& operator=(const Tables&) = delete;

    idem::PostgresOptions options(std::size_t pool_size) const {
        idem::PostgresOptions o;
        o.table = idem;
        o.pool_size = pool_size;
        o.application_name = "idem_concurrency_test";
        return o;
    }
};

void insert_effect(PgConn& conn, const std::string& table, const std::string& scope,
                   const std::string& key, int tid) {
    conn.exec("INSERT INTO " + table + " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
              {scope, key, std::to_string(::getpid()), std::to_string(tid)});
}

void rethrow_first(const std::vector<std::exception_ptr>& errors) {
    for (const auto& e : errors) {
        if (e)
            std::rethrow_exception(e);
    }
}

} // namespace

TEST_CASE("64 threads, one key, one start: the effect runs exactly once", "[concurrency]") {
    const auto url = require_db();
    Tables tables(url);
    idem::PostgresStore store(url, idem_test::env_options(tables.options(16)));
    store.ensure_schema();
    const auto scope = idem_test::unique_name("one");
    const idem::Key key(scope, "the-key");
    const auto fp = idem::fingerprint("POST /charges"s, 25000);

    constexpr int kThreads = 64;
    std::atomic<int> runs{0};
    std::latch ready(kThreads);
    std::mutex mutex;
    std::vector<idem::Outcome> outcomes;
    std::vector<std::string> bodies; // replayed bodies
    std::optional<Response> executed;
    std::vector<std::exception_ptr> errors(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                ready.arrive_and_wait();
                const auto r = idem::execute_once(store, key, fp, [&] {
                    ++runs;
                    PgConn conn(url);
                    insert_effect(conn, tables.effects, scope, key.value(), t);
                    std::this_thread::sleep_for(20ms); // let the others pile up on the key
                    return Response{201,
                                    "charged by thread " + std::to_string(t) + "\0!"s,
                                    {{"X-Thread", std::to_string(t)}}};
                });
                std::lock_guard lock(mutex);
                outcomes.push_back(r.outcome());
                if (r.outcome() == Outcome::executed)
                    executed = r.response();
                if (r.outcome() == Outcome::replayed)
                    bodies.push_back(idem::codec<Response>::encode(r.response()));
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& th : threads)
        th.join();
    rethrow_first(errors);

    CHECK(runs == 1);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::executed) == 1);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::mismatch) == 0);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::replayed) +
              std::count(outcomes.begin(), outcomes.end(), Outcome::in_progress) ==
          kThreads - 1);
    REQUIRE(executed.has_value());
    const auto stored = idem::codec<Response>::encode(*executed);
    for (const auto& body : bodies)
        CHECK(body == stored);

    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == 1);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem) == 1);
    // afterwards, everyone gets the same bytes
    const auto again = idem::execute_once(store, key, fp, [&] {
        ++runs;
        return Response{};
    });
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(idem::codec<Response>::encode(again.response()) == stored);
    CHECK(runs == 1);
    CHECK(store.stats().claims_won == 1);
}

TEST_CASE("64 threads over 1,000 keys: each key's effect exactly once", "[concurrency]") {
    const auto url = require_db();
    Tables tables(url);
    idem::PostgresStore store(url, idem_test::env_options(tables.options(16)));
    store.ensure_schema();
    const auto scope = idem_test::unique_name("many");
    const auto fp = idem::fingerprint("POST /transfers"s);

    constexpr int kThreads = 64;
    constexpr int kKeys = 1000;
    std::array<std::atomic<int>, kKeys> runs{};
    std::mutex mutex;
    std::map<int, std::string> executed_body;
    std::atomic<int> executed{0};
    std::atomic<int> in_progress{0};
    std::atomic<int> mismatched{0};
    std::vector<std::vector<std::pair<int, std::string>>> replays(kThreads);
    std::vector<std::exception_ptr> errors(kThreads);
    std::latch ready(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                PgConn conn(url); // this thread's connection for its effects
                std::vector<int> order(kKeys);
                std::iota(order.begin(), order.end(), 0);
                std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
                auto& mine = replays[static_cast<std::size_t>(t)];
                mine.reserve(kKeys);
                ready.arrive_and_wait();
                for (int k : order) {
                    const idem::Key key(scope, "k" + std::to_string(k));
                    const auto r = idem::execute_once(store, key, fp, [&] {
                        ++runs[static_cast<std::size_t>(k)];
                        insert_effect(conn, tables.effects, scope, key.value(), t);
                        return "key " + std::to_string(k) + " done by thread " + std::to_string(t);
                    });
                    switch (r.outcome()) {
                    case Outcome::executed: {
                        ++executed;
                        std::lock_guard lock(mutex);
                        executed_body[k] = r.response();
                        break;
                    }
                    case Outcome::replayed:
                        mine.emplace_back(k, r.response());
                        break;
                    case Outcome::in_progress:
                        ++in_progress;
                        break;
                    case Outcome::mismatch:
                        ++mismatched;
                        break;
                    }
                }
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& th : threads)
        th.join();
    rethrow_first(errors);

    CHECK(executed == kKeys);
    CHECK(mismatched == 0);
    CHECK(executed_body.size() == static_cast<std::size_t>(kKeys));
    int multi = 0;
    for (int k = 0; k < kKeys; ++k) {
        if (runs[static_cast<std::size_t>(k)] != 1)
            ++multi;
    }
    CHECK(multi == 0);
    std::size_t replayed = 0;
    std::size_t wrong_bytes = 0;
    for (const auto& mine : replays) {
        for (const auto& [k, body] : mine) {
            ++replayed;
            if (body != executed_body[k])
                ++wrong_bytes;
        }
    }
    CHECK(wrong_bytes == 0);
    CHECK(replayed + static_cast<std::size_t>(in_progress.load()) +
              static_cast<std::size_t>(kKeys) ==
          static_cast<std::size_t>(kThreads) * kKeys);
    INFO("replayed " << replayed << ", in_progress " << in_progress.load());

    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(*) FROM (SELECT key FROM " + tables.effects +
                       " GROUP BY key HAVING count(*) > 1) d") == 0);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE state = 'completed'") ==
          kKeys);
    CHECK(store.stats().claims_won == kKeys);
}

TEST_CASE("4 processes x 8 threads race on 200 keys: one effect row per key",
          "[concurrency][processes]") {
    const auto url = require_db();
    Tables tables(url);
    {
        idem::PostgresStore store(url, idem_test::env_options(tables.options(1)));
        store.ensure_schema(); // the workers run it again, all at once
    }
    const auto scope = idem_test::unique_name("procs");
    constexpr int kProcesses = 4;
    constexpr int kKeys = 200;
    constexpr int kThreads = 8;
    const auto dir = std::filesystem::temp_directory_path() / idem_test::unique_name("idem_race");
    std::filesystem::create_directories(dir);
    struct RemoveDir {
        std::filesystem::path dir;
        ~RemoveDir() {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    } remove_dir{dir};

    const auto start_at = std::chrono::duration_cast<std::chrono::milliseconds>(
                              (std::chrono::system_clock::now() + 1500ms).time_since_epoch())
                              .count();
    std::vector<pid_t> pids;
    std::vector<std::string> outfiles;
    for (int p = 0; p < kProcesses; ++p) {
        outfiles.push_back((dir / ("worker" + std::to_string(p) + ".txt")).string());
        std::vector<std::string> args = {IDEM_RACE_WORKER,
                                         url,
                                         tables.idem,
                                         tables.effects,
                                         scope,
                                         std::to_string(kKeys),
                                         std::to_string(kThreads),
                                         std::to_string(start_at),
                                         outfiles.back()};
        std::vector<char*> argv;
        for (auto& a : args)
            argv.push_back(a.data());
        argv.push_back(nullptr);
        pid_t pid = 0;
        const int rc =
            ::posix_spawn(&pid, IDEM_RACE_WORKER, nullptr, nullptr, argv.data(), environ);
        REQUIRE(rc == 0);
        pids.push_back(pid);
    }
    std::map<pid_t, int> exit_codes;
    for (pid_t pid : pids) {
        int status = 0;
        REQUIRE(::waitpid(pid, &status, 0) == pid);
        exit_codes[pid] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    for (const auto& [pid, code] : exit_codes) {
        CAPTURE(pid);
        CHECK(code == 0);
    }

    // What the database says happened: key -> pid of the process whose effect ran.
    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + tables.effects) == kKeys);
    std::map<std::string, std::string> effect_pid;
    const auto rows = admin.exec("SELECT key, pid FROM " + tables.effects);
    for (int i = 0; i < rows.rows(); ++i)
        effect_pid[rows.text(i, 0)] = rows.text(i, 1);

    // What the processes say happened must agree.
    std::map<int, std::string> executed_body; // key -> body, from the executing process
    std::map<int, pid_t> executed_by;
    int executed_lines = 0;
    std::vector<std::tuple<pid_t, int, std::string>> replays; // R and F lines
    std::map<pid_t, int> finals;
    for (int p = 0; p < kProcesses; ++p) {
        std::ifstream in(outfiles[static_cast<std::size_t>(p)]);
        REQUIRE(in.good());
        std::string line;
        while (std::getline(in, line)) {
            std::istringstream fields(line);
            std::string kind;
            int k = -1;
            std::string body;
            fields >> kind >> k >> body;
            if (kind == "E") {
                ++executed_lines;
                executed_body[k] = body;
                executed_by[k] = pids[static_cast<std::size_t>(p)];
            } else if (kind == "R" || kind == "F") {
                replays.emplace_back(pids[static_cast<std::size_t>(p)], k, body);
                if (kind == "F")
                    ++finals[pids[static_cast<std::size_t>(p)]];
            }
        }
    }
    CHECK(executed_lines == kKeys);
    CHECK(executed_body.size() == static_cast<std::size_t>(kKeys));
    int disagreements = 0;
    for (const auto& [k, pid] : executed_by) {
        const auto& row_pid = effect_pid["key-" + std::to_string(k)];
        if (row_pid != std::to_string(pid))
            ++disagreements;
        if (executed_body[k].find(";pid=" + row_pid + ";") == std::string::npos)
            ++disagreements;
    }
    CHECK(disagreements == 0);
    int wrong_replays = 0;
    for (const auto& [pid, k, body] : replays) {
        if (body != executed_body[k])
            ++wrong_replays;
    }
    CHECK(wrong_replays == 0);
    for (pid_t pid : pids) {
        CAPTURE(pid);
        CHECK(finals[pid] == kKeys * kThreads); // every thread saw every key replay at the end
    }
}
