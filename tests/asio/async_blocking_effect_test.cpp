// tests/asio/async_blocking_effect_test.cpp — the recipe of docs/api.md, "A blocking call inside
// an asynchronous effect": async_execute_once whose effect is a blocking client library (libpq's
// blocking calls here) run on a boost::asio::thread_pool, the event loop never blocked. Effects
// counted in a table, outside idem: each key once; a deadline that passes during the call does not
// abandon it; a call that would start too late is not started (not_performed: the key is released).
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace net = boost::asio;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using idem_test::PgConn;

namespace {

// ---- The recipe (docs/api.md) -------------------------------------------------------------------

// Runs the blocking `call` on `pool` and resumes the awaiting coroutine on its own executor (the
// store's strand) with the call's result or exception. The call is never started after `start_by`
// (the effect's start budget, so that a key stale to a reconciler has no call still to come): it
// throws not_performed instead — nothing was done, the key is released. Once started, the call runs
// to its end whatever happens to the awaiting call (a cancellation, AsyncOptions::deadline): a
// blocking call cannot be interrupted, and its result is saved rather than abandoned, so bound it
// with the client's own timeout.
template <class Call>
net::awaitable<std::invoke_result_t<Call&>> run_blocking(net::thread_pool& pool, Clock::time_point start_by,
                                                         Call call) {
    using R = std::invoke_result_t<Call&>;
    // (A named lambda: GCC 12 mishandles lambdas written inside a co_await expression.)
    auto on_pool = [&call, start_by]() -> net::awaitable<R> {
        if (Clock::now() > start_by) throw idem::not_performed("not started: past its start budget");
        co_return call();  // blocks this pool thread, not the event loop
    };
    // Not connected to the caller's cancellation: the pool's coroutine cannot act on it, and
    // co_spawn (Boost 1.81) throws a cancellation that arrived during the call out of the pool
    // thread once the call returns — std::terminate.
    co_return co_await net::co_spawn(pool, on_pool,
                                     net::bind_cancellation_slot(net::cancellation_slot(), net::use_awaitable));
}

// ---- The test's blocking client and its ledger --------------------------------------------------

/// The provider: a table of charges, written by a blocking libpq call with its own statement
/// timeout. Dropped at the end.
class Provider {
public:
    Provider() : url_(idem_test::database_url()), table_(idem_test::unique_name("idem_blocking_charges")) {
        PgConn(url_).exec("CREATE TABLE " + table_ + " (id bigserial PRIMARY KEY, key text NOT NULL)");
    }
    ~Provider() {
        try {
            PgConn(url_).exec("DROP TABLE IF EXISTS " + table_);
        } catch (...) {
        }
    }
    Provider(const Provider&) = delete;
    Provider& operator=(const Provider&) = delete;

    /// A charge: blocks the calling thread for `latency` (server side), then records one row.
    std::string charge(const std::string& key, std::chrono::milliseconds latency = 0ms) {
        PgConn conn(url_ + " options='-c statement_timeout=5000'");
        if (latency.count() > 0) {
            conn.exec("SELECT pg_sleep($1::float8 / 1000)", {std::to_string(latency.count())});
        }
        return "ch_" + conn.exec("INSERT INTO " + table_ + " (key) VALUES ($1) RETURNING id", {key}).text(0, 0);
    }
    long long count() { return PgConn(url_).scalar("SELECT count(*) FROM " + table_); }
    long long count(const std::string& key) {
        return PgConn(url_).scalar("SELECT count(*) FROM " + table_ + " WHERE key = $1", {key});
    }

private:
    std::string url_, table_;
};

/// A private idem table, an io_context run by one thread, the store on it.
struct Fixture {
    Fixture() : table(idem_test::unique_name("idem_blocking")) {
        idem::PostgresOptions o;
        o.table = table;
        store.emplace(io.get_executor(), idem_test::require_db(), o);
        store->blocking().ensure_schema();
        runner = std::thread([this] {
            loop_thread = std::this_thread::get_id();
            io.run();
        });
    }
    ~Fixture() {
        work.reset();
        runner.join();
        store.reset();
        try {
            PgConn(idem_test::database_url()).exec("DROP TABLE IF EXISTS " + table);
        } catch (...) {
        }
    }
    std::string table;
    net::io_context io;
    std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
    std::optional<idem::asio::AsyncPostgresStore> store;
    std::thread::id loop_thread;
    std::thread runner;
};

/// The first `n` arrivals wait for one another (at most 20 s); later ones pass. Says whether the
/// first `n` met.
class Meeting {
public:
    explicit Meeting(int n) : n_(n) {}
    void arrive() {
        std::unique_lock lock(mutex_);
        if (arrived_ >= n_) return;
        if (++arrived_ == n_) {
            met_ = true;
            cv_.notify_all();
            return;
        }
        cv_.wait_for(lock, 20s, [&] { return met_; });
    }
    bool met() {
        std::lock_guard lock(mutex_);
        return met_;
    }

private:
    std::mutex mutex_;
    std::condition_variable cv_;
    int n_, arrived_ = 0;
    bool met_ = false;
};

idem::Key key(const std::string& v) { return idem::Key("blocking-test", v); }

}  // namespace

TEST_CASE("a blocking effect on a thread pool: 16 calls, 4 at once off the event loop, each charged once",
          "[asio][blocking]") {
    Fixture f;
    Provider provider;
    net::thread_pool pool(4);
    Meeting four(4);  // the first 4 calls block together: the loop kept starting effects meanwhile
    std::mutex mutex;
    std::set<std::thread::id> call_threads;
    const std::string run = idem_test::unique_name("r");
    const auto pay = [&](int i) {
        const std::string k = run + "-" + std::to_string(i);
        auto effect = [&, k]() -> net::awaitable<idem::Response> {
            const std::string charge = co_await run_blocking(pool, Clock::now() + 5s, [&] {
                {
                    std::lock_guard lock(mutex);
                    call_threads.insert(std::this_thread::get_id());
                }
                four.arrive();
                return provider.charge(k);
            });
            co_return idem::Response{201, charge};
        };
        return idem::asio::async_execute_once(*f.store, key(k), idem::fingerprint(k), effect, net::use_future);
    };
    std::vector<std::future<idem::Result<idem::Response>>> calls;
    for (int i = 0; i < 16; ++i) calls.push_back(pay(i));
    std::vector<std::string> charges;
    for (auto& call : calls) {
        auto r = call.get();
        CHECK(r.outcome() == idem::Outcome::executed);
        charges.push_back(r.response().body);
    }
    CHECK(four.met());
    CHECK(call_threads.size() <= 4);
    CHECK(call_threads.count(f.loop_thread) == 0);  // never on the event loop's thread
    CHECK(call_threads.count(std::this_thread::get_id()) == 0);
    CHECK(provider.count() == 16);

    // Every retry replays the charge it made; none charges again.
    for (int i = 0; i < 16; ++i) {
        auto r = pay(i).get();
        CHECK(r.outcome() == idem::Outcome::replayed);
        CHECK(r.response().body == charges[static_cast<std::size_t>(i)]);
    }
    CHECK(provider.count() == 16);
}

TEST_CASE("a blocking effect on a thread pool: a deadline passing during the call does not abandon it",
          "[asio][blocking]") {
    Fixture f;
    Provider provider;
    net::thread_pool pool(2);
    const std::string k = idem_test::unique_name("slow");
    auto effect = [&]() -> net::awaitable<idem::Response> {
        co_return idem::Response{
            201, co_await run_blocking(pool, Clock::now() + 10s, [&] { return provider.charge(k, 3s); })};
    };
    idem::asio::AsyncOptions options;
    // Passes while the provider sleeps (3 s); long enough for the claim before it on a loaded
    // machine under ASan (the first connection is opened by this call).
    options.deadline = 2s;
    auto r =
        idem::asio::async_execute_once(*f.store, key(k), idem::fingerprint(k), effect, options, net::use_future).get();
    CHECK(r.outcome() == idem::Outcome::executed);  // the call ran to its end and its charge is saved
    CHECK(provider.count(k) == 1);
    auto again = idem::asio::async_execute_once(*f.store, key(k), idem::fingerprint(k), effect, net::use_future).get();
    CHECK(again.outcome() == idem::Outcome::replayed);
    CHECK(again.response().body == r.response().body);
    CHECK(provider.count(k) == 1);
}

TEST_CASE("a blocking effect on a thread pool: past its start budget in the pool's queue, it is not started",
          "[asio][blocking]") {
    Fixture f;
    Provider provider;
    net::thread_pool pool(1);
    std::promise<void> release_pool;
    net::post(pool, [gate = release_pool.get_future()]() mutable { gate.wait(); });  // the only thread, busy
    const std::string k = idem_test::unique_name("late");
    const auto pay = [&](std::chrono::milliseconds budget) {
        const auto start_by = Clock::now() + budget;
        auto effect = [&, start_by]() -> net::awaitable<idem::Response> {
            co_return idem::Response{201, co_await run_blocking(pool, start_by, [&] { return provider.charge(k); })};
        };
        return idem::asio::async_execute_once(*f.store, key(k), idem::fingerprint(k), effect, net::use_future);
    };
    auto late = pay(100ms);
    std::this_thread::sleep_for(300ms);  // the budget passes while the call waits for the thread
    release_pool.set_value();
    CHECK_THROWS_AS(late.get(), idem::not_performed);
    CHECK(provider.count(k) == 0);
    PgConn admin(idem_test::database_url());
    CHECK(admin.scalar("SELECT count(*) FROM " + f.table + " WHERE key = $1", {k}) == 0);  // released
    auto retry = pay(5s).get();                                                            // the same key runs again
    CHECK(retry.outcome() == idem::Outcome::executed);
    CHECK(provider.count(k) == 1);
}
