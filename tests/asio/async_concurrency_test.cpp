// tests/asio/async_concurrency_test.cpp — races through idem::asio: coroutines of one process on
// one key, and 4 OS processes × many coroutines on many keys (async_race_worker.cpp). Every effect
// INSERTs a row into an effects table over a plain libpq connection, so "exactly once" is counted by
// the database, outside idem. Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "race_run.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#include "test_env.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>
#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace net = boost::asio;
using namespace std::chrono_literals;
using idem_test::PgConn;

namespace race = idem_test::race;
using idem_test::require_db;

/// An idem table and an effects table, both dropped at the end.
struct Tables : race::Tables {
    explicit Tables(std::string url) : race::Tables(std::move(url), "idem_ta", "idem_async_effects") {}
};

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
                                    effect_conn.exec(
                                        "INSERT INTO " + tables.effects +
                                            " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
                                        {key.scope(), key.value(), std::to_string(::getpid()), std::to_string(c)});
                                    // A slow provider: it answers once another caller was told
                                    // in progress (or after 30 s: the check below then fails).
                                    const auto until = std::chrono::steady_clock::now() + 30s;
                                    while (busy == 0 && std::chrono::steady_clock::now() < until) {
                                        std::this_thread::sleep_for(1ms);
                                    }
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
        CHECK(busy > 0);  // callers arrived while the effect ran
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
    constexpr int kProcesses = 4;
    constexpr int kKeys = 100;
    constexpr int kCoroutines = 200;
    // What the database says happened (one effect row per key, and whose) and what the processes
    // say happened must agree, and the outcomes add up.
    const auto ran = race::run_race(IDEM_ASYNC_RACE_WORKER, tables, "aprocs", kProcesses, kKeys, kCoroutines, 3s);
    const auto& report = ran.report;
    PgConn admin(url);
    std::ostringstream tally;
    tally << "executed=" << report.executed_lines << " replayed=" << report.replayed_lines
          << " in_progress=" << report.busy_lines;
    INFO(tally.str());
    WARN("async race: " << tally.str() << " (of " << kProcesses * kCoroutines * kKeys << " first-pass calls)");
    race::check_race(admin, tables, ran, kKeys, kCoroutines);
}
