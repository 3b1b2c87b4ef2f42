// tests/asio/async_concurrency_test.cpp — races through idem::asio: coroutines of one process on
// one key, and 4 OS processes × many coroutines on many keys (async_race_worker.cpp). Every effect
// INSERTs a row into an effects table over a plain libpq connection, so "exactly once" is counted by
// the database, outside idem. Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "store_env.hpp"
#include "test_env.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

extern char** environ;

namespace net = boost::asio;
using namespace std::chrono_literals;
using idem_test::PgConn;

namespace {

std::string require_db() {
    const auto url = idem_test::database_url();
    if (url.empty()) FAIL(idem_test::kNoDatabaseMessage);
    return url;
}

/// An idem table and an effects table (no unique constraint: a second run is a second row), both
/// dropped at the end.
struct Tables {
    std::string conninfo;
    std::string idem = idem_test::unique_name("idem_ta");
    std::string effects = idem_test::unique_name("idem_async_effects");

    explicit Tables(std::string url) : conninfo(std::move(url)) {
        PgConn(conninfo).exec("CREATE TABLE " + effects +
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
};

}  // namespace

TEST_CASE("async: 64 coroutines, one key: one effect row, the others replay or are told in progress",
          "[asio][concurrency]") {
    const auto url = require_db();
    Tables tables(url);
    net::io_context io;
    auto work = std::make_optional(net::make_work_guard(io));
    std::thread runner([&] { io.run(); });
    net::thread_pool pool(1);
    PgConn effect_conn(url);  // used on the pool's one thread only
    {
        idem::PostgresOptions o;
        o.table = tables.idem;
        idem::asio::AsyncPostgresStore store(io.get_executor(), url, idem_test::env_options(o));
        store.blocking().ensure_schema();
        const idem::Key key(idem_test::unique_name("hot"), "the-key");
        const auto fp = idem::fingerprint(std::string("POST /charges"), 25000);
        std::atomic<int> executed{0}, replayed{0}, busy{0}, wrong{0};
        std::vector<std::future<void>> all;
        for (int c = 0; c < 64; ++c) {
            all.push_back(net::co_spawn(
                store.get_executor(),
                [&, c]() -> net::awaitable<void> {
                    auto r = co_await idem::asio::async_execute_once(
                        store, key, fp,
                        [&, c]() -> net::awaitable<idem::Response> {
                            co_await net::co_spawn(
                                pool,
                                [&, c]() -> net::awaitable<void> {
                                    effect_conn.exec("INSERT INTO " + tables.effects +
                                                         " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
                                                     {key.scope(), key.value(), std::to_string(::getpid()),
                                                      std::to_string(c)});
                                    std::this_thread::sleep_for(50ms);  // a slow provider: the others arrive
                                    co_return;
                                },
                                net::use_awaitable);
                            co_return idem::Response{201, "tid=" + std::to_string(c)};
                        },
                        net::use_awaitable);
                    switch (r.outcome()) {
                        case idem::Outcome::executed: ++executed; break;
                        case idem::Outcome::replayed: ++replayed; break;
                        case idem::Outcome::in_progress: ++busy; break;
                        case idem::Outcome::mismatch: ++wrong; break;
                    }
                },
                net::use_future));
        }
        for (auto& f : all) f.get();
        CHECK(executed == 1);
        CHECK(wrong == 0);
        CHECK(executed + replayed + busy == 64);
        CHECK(busy > 0);  // the effect took 50 ms: most callers arrived while it ran
        PgConn admin(url);
        const auto rows = admin.exec("SELECT tid FROM " + tables.effects);
        REQUIRE(rows.rows() == 1);
        const auto stored = store.read(key);
        REQUIRE(stored);
        REQUIRE(stored->state == idem::RecordState::completed);
        CHECK(idem::codec<idem::Response>::decode(*stored->result).body == "tid=" + rows.text(0, 0));
        CHECK(store.stats().claims == 64);
        CHECK(store.stats().claims_won == 1);
    }
    pool.join();
    work.reset();
    runner.join();
}

TEST_CASE("async: 4 processes x 200 coroutines race on 100 keys: one effect row per key",
          "[asio][concurrency][processes]") {
    const auto url = require_db();
    Tables tables(url);
    {
        idem::PostgresOptions o;
        o.table = tables.idem;
        o.pool_size = 1;
        idem::PostgresStore store(url, idem_test::env_options(o));
        store.ensure_schema();  // the workers run it again, all at once
    }
    const auto scope = idem_test::unique_name("aprocs");
    constexpr int kProcesses = 4;
    constexpr int kKeys = 100;
    constexpr int kCoroutines = 200;
    const auto dir = std::filesystem::temp_directory_path() / idem_test::unique_name("idem_async_race");
    std::filesystem::create_directories(dir);
    struct RemoveDir {
        std::filesystem::path dir;
        ~RemoveDir() {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    } remove_dir{dir};

    const auto start_at =
        std::chrono::duration_cast<std::chrono::milliseconds>((std::chrono::system_clock::now() + 3s).time_since_epoch())
            .count();
    std::vector<pid_t> pids;
    std::vector<std::string> outfiles;
    for (int p = 0; p < kProcesses; ++p) {
        outfiles.push_back((dir / ("worker" + std::to_string(p) + ".txt")).string());
        std::vector<std::string> args = {IDEM_ASYNC_RACE_WORKER,  url,
                                         tables.idem,             tables.effects,
                                         scope,                   std::to_string(kKeys),
                                         std::to_string(kCoroutines), std::to_string(start_at),
                                         outfiles.back()};
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        pid_t pid = 0;
        REQUIRE(::posix_spawn(&pid, IDEM_ASYNC_RACE_WORKER, nullptr, nullptr, argv.data(), environ) == 0);
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

    // What the database says happened: exactly one effect row per key, and whose.
    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1 AND state = 'completed'", {scope}) ==
          kKeys);
    std::map<std::string, std::pair<std::string, std::string>> effect_by;  // key -> (pid, tid)
    const auto rows = admin.exec("SELECT key, pid, tid FROM " + tables.effects);
    for (int i = 0; i < rows.rows(); ++i) effect_by[rows.text(i, 0)] = {rows.text(i, 1), rows.text(i, 2)};

    // What the processes say happened must agree, and the outcomes add up.
    std::map<int, std::string> executed_body;  // key -> body, from the executing process
    std::map<int, pid_t> executed_by;
    int executed_lines = 0, replayed_lines = 0, busy_lines = 0;
    std::vector<std::tuple<pid_t, int, std::string>> replays;  // R and F lines
    std::map<pid_t, int> first_pass, finals;
    for (int p = 0; p < kProcesses; ++p) {
        const pid_t pid = pids[static_cast<std::size_t>(p)];
        std::ifstream in(outfiles[static_cast<std::size_t>(p)]);
        REQUIRE(in.good());
        std::string line;
        while (std::getline(in, line)) {
            std::istringstream fields(line);
            std::string kind, body;
            int k = -1;
            fields >> kind >> k >> body;
            if (kind == "E") {
                ++executed_lines, ++first_pass[pid];
                executed_body[k] = body;
                executed_by[k] = pid;
            } else if (kind == "R" || kind == "F") {
                replays.emplace_back(pid, k, body);
                if (kind == "F") {
                    ++finals[pid];
                } else {
                    ++replayed_lines, ++first_pass[pid];
                }
            } else if (kind == "P") {
                ++busy_lines, ++first_pass[pid];
            }
        }
    }
    std::ostringstream tally;
    tally << "executed=" << executed_lines << " replayed=" << replayed_lines << " in_progress=" << busy_lines;
    INFO(tally.str());
    WARN("async race: " << tally.str() << " (of " << kProcesses * kCoroutines * kKeys << " first-pass calls)");
    CHECK(executed_lines == kKeys);
    CHECK(executed_body.size() == static_cast<std::size_t>(kKeys));
    CHECK(executed_lines + replayed_lines + busy_lines == kProcesses * kCoroutines * kKeys);
    int disagreements = 0;
    for (const auto& [k, pid] : executed_by) {
        const auto& [row_pid, row_tid] = effect_by["key-" + std::to_string(k)];
        if (row_pid != std::to_string(pid)) ++disagreements;
        if (executed_body[k] != "key=" + std::to_string(k) + ";pid=" + row_pid + ";tid=" + row_tid) ++disagreements;
    }
    CHECK(disagreements == 0);
    int wrong_replays = 0;
    for (const auto& [pid, k, body] : replays) {
        if (body != executed_body[k]) ++wrong_replays;
    }
    CHECK(wrong_replays == 0);
    for (pid_t pid : pids) {
        CAPTURE(pid);
        CHECK(first_pass[pid] == kCoroutines * kKeys);  // every call of the race answered
        CHECK(finals[pid] == kCoroutines * kKeys);      // every coroutine saw every key replay at the end
    }
}
