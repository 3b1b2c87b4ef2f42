// tests/asio/async_fault_test.cpp — the fault scenarios of tests/fault (backend_kill_test.cpp,
// crash_test.cpp, lost_ack_test.cpp) against idem::asio: AsyncPostgresStore and async_execute_once.
//
// The same scenarios (tests/fault/scenarios.hpp) on the same machinery (tests/fault/fault.hpp):
// every run of the effect INSERTs a row into an effects table over its own autocommit connection
// (Effects::Writer), so duplicates are counted by the database, outside idem; every call is
// recorded (History) and check() resolves what is in doubt with one reconciler sweep and checks
// every key. What differs is the Driver: the calls are async_execute_once(..., use_awaitable) from
// coroutines on the store's strand (AsyncLoad, co_call), and the effect's blocking INSERT runs on a
// thread pool the coroutine awaits, so the event loop never waits on it. check()'s reconciler and
// final retries use the store's blocking members (which run its asynchronous operations). Needs
// scripts/with-postgres.sh's cluster (IDEM_PG_DATA, IDEM_PG_HOST/IDEM_PG_PORT) for the crash and
// proxy scenarios; otherwise they WARN and skip.
#include "idem/asio.hpp"
#include "scenarios.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <future>

using namespace fault;
namespace net = boost::asio;
using idem::asio::AsyncPostgresStore;

namespace {

/// An io_context run by one thread, and the pool the effects run on. Declare it before the stores.
struct Loop {
    net::io_context io;
    std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
    net::thread_pool effects{8};
    std::thread runner{[this] { io.run(); }};
    ~Loop() {
        effects.join();
        work.reset();
        runner.join();
    }
};

/// fault::run_call through async_execute_once: the effect (an awaitable) runs writer.run(key) on
/// `pool` and produces response_for(key, its effect row id).
net::awaitable<Call> co_call(AsyncPostgresStore& store, net::thread_pool& pool, Effects::Writer& writer, Key key,
                             bool right_fp = true, idem::ClaimOptions claim = {}) {
    Call c(key, right_fp);
    const auto started = Clock::now();
    idem::asio::AsyncOptions options;
    options.claim = claim;
    std::exception_ptr failure;
    try {
        auto r = co_await idem::asio::async_execute_once(
            store, key, right_fp ? fp_for(key) : other_fp_for(key),
            [&]() -> net::awaitable<Response> {
                c.fn_started = true;
                c.effect_id = co_await net::co_spawn(
                    pool, [&]() -> net::awaitable<long long> { co_return writer.run(key); }, net::use_awaitable);
                co_return response_for(key, c.effect_id);
            },
            options, net::use_awaitable);
        c.told = told_of(r.outcome());
        if (r.has_response()) c.bytes = idem::codec<Response>::encode(r.response());
    } catch (...) {
        failure = std::current_exception();
    }
    if (failure) classify(c, failure);
    c.ms = ms_since(started);
    co_return c;
}

/// One co_call from a thread that is not the store's: waits for it.
Call call(Loop& loop, AsyncPostgresStore& store, Effects::Writer& writer, const Key& key, bool right_fp = true,
          const idem::ClaimOptions& claim = {}) {
    auto wrapped = [&]() -> net::awaitable<std::optional<Call>> {  // use_future wants a default-constructible T
        co_return co_await co_call(store, loop.effects, writer, key, right_fp, claim);
    };
    return *net::co_spawn(store.get_executor(), wrapped(), net::use_future).get();
}

/// fault::Load with coroutines instead of threads: LoadOptions::threads clients on the store's
/// strand, two on every key at about the same time, retrying like real clients do.
class AsyncLoad final : public LoadDriver {
public:
    AsyncLoad(Loop& loop, AsyncPostgresStore& store, const Effects& effects, History& history, LoadOptions options)
        : loop_(loop), store_(store), effects_(effects), history_(history), options_(std::move(options)) {}
    ~AsyncLoad() override {
        try {
            AsyncLoad::stop();
        } catch (...) {
        }
    }
    AsyncLoad(const AsyncLoad&) = delete;
    AsyncLoad& operator=(const AsyncLoad&) = delete;

    void start() override {
        for (int t = 0; t < options_.threads; ++t) writers_.push_back(std::make_unique<Effects::Writer>(effects_));
        for (int t = 0; t < options_.threads; ++t)
            clients_.push_back(net::co_spawn(store_.get_executor(), client(t), net::use_future));
    }
    void request_stop() override { stop_ = true; }
    /// Waits for every client; a client that ended by an exception (none should) fails the test.
    void stop() override {
        stop_ = true;
        for (auto& f : clients_) {
            if (!f.valid()) continue;
            try {
                f.get();
            } catch (const std::exception& e) {
                FAIL_CHECK("an AsyncLoad client ended by an exception: " << e.what());
            }
        }
    }
    [[nodiscard]] bool finished() const override { return done_.load() == options_.threads; }

private:
    net::awaitable<void> client(int t) {
        Effects::Writer& writer = *writers_[static_cast<std::size_t>(t)];
        std::minstd_rand rng(static_cast<unsigned>(t) * 7919u + static_cast<unsigned>(::getpid()));
        std::uniform_real_distribution<double> u(0, 1);
        net::steady_timer pause(co_await net::this_coro::executor);
        while (!stop_) {
            const std::size_t index = next_.fetch_add(1) / 2;
            if (index >= options_.max_keys) break;
            const Key key(options_.scope, "k" + std::to_string(index));
            for (int attempt = 0; attempt < options_.attempts_per_key && !stop_; ++attempt) {
                Call c = co_await co_call(store_, loop_.effects, writer, key, true, options_.claim);
                const Told told = c.told;
                history_.add(std::move(c));
                if (is_answer(told)) {
                    if (u(rng) < options_.replay_p)
                        history_.add(co_await co_call(store_, loop_.effects, writer, key, true, options_.claim));
                    if (u(rng) < options_.mismatch_p)
                        history_.add(co_await co_call(store_, loop_.effects, writer, key, false, options_.claim));
                    break;
                }
                if (told == Told::mismatch) break;
                pause.expires_after(options_.backoff);
                co_await pause.async_wait(net::use_awaitable);
            }
        }
        ++done_;
    }

    Loop& loop_;
    AsyncPostgresStore& store_;
    const Effects& effects_;
    History& history_;
    LoadOptions options_;
    std::atomic<bool> stop_{false};
    std::atomic<std::size_t> next_{0};
    std::atomic<int> done_{0};
    std::vector<std::unique_ptr<Effects::Writer>> writers_;
    std::vector<std::future<void>> clients_;
};

/// The schema, made by a blocking store of its own (the async store's blocking() connections would
/// carry its application_name and count among its connections).
void make_schema(const std::string& url, const std::string& table) {
    idem::PostgresOptions o;
    o.table = table;
    o.pool_size = 1;
    o.application_name = "idem_fault_async_schema";
    idem::PostgresStore(url, idem_test::env_options(o)).ensure_schema();
}

/// The scenarios' Driver: AsyncPostgresStore on `loop`, calls through async_execute_once, loads of
/// 32 coroutines.
Driver async_driver(Loop& loop) {
    Driver d;
    d.prefix = "async_";
    d.scope_prefix = "a";
    d.load_clients = 32;
    d.open = [&loop](const std::string& url, const idem::PostgresOptions& options,
                     bool schema) -> std::unique_ptr<idem::IdempotencyStore> {
        if (schema) make_schema(idem_test::database_url(), options.table);
        return std::make_unique<AsyncPostgresStore>(loop.io.get_executor(), url, options);
    };
    d.call = [&loop](idem::IdempotencyStore& store, Effects::Writer& writer, const Key& key, bool right_fp,
                     const idem::ClaimOptions& claim) {
        return call(loop, static_cast<AsyncPostgresStore&>(store), writer, key, right_fp, claim);
    };
    d.load = [&loop](idem::IdempotencyStore& store, const Effects& effects, History& history,
                     const LoadOptions& lo) -> std::unique_ptr<LoadDriver> {
        return std::make_unique<AsyncLoad>(loop, static_cast<AsyncPostgresStore&>(store), effects, history, lo);
    };
    d.warm = [](idem::IdempotencyStore& store) {
        // Many reads at once: the store opens its connections.
        auto& async_store = static_cast<AsyncPostgresStore&>(store);
        std::vector<std::future<std::optional<idem::Record>>> reads;
        for (int i = 0; i < 64; ++i)
            reads.push_back(async_store.async_read(Key("warm", "k" + std::to_string(i)), net::use_future));
        for (auto& r : reads) (void)r.get();
    };
    return d;
}

}  // namespace

TEST_CASE("async scenario 1: backends terminated under load (AsyncPostgresStore)", "[fault][asio][backend_kill]") {
    Loop loop;
    backend_kill_scenario(async_driver(loop));
}

TEST_CASE("async scenario 2: PostgreSQL killed (kill -9) mid-load and restarted (AsyncPostgresStore)",
          "[fault][asio][crash]") {
    Loop loop;
    crash_scenario(async_driver(loop));
}

// After a restart every idle connection of the store is dead: the first call must not fail on them.
TEST_CASE("async: after a restart, the first call succeeds (AsyncPostgresStore)", "[fault][asio][crash]") {
    Loop loop;
    first_call_after_restart_scenario(async_driver(loop));
}

TEST_CASE("async scenario 3: acknowledgements lost on the wire (AsyncPostgresStore)", "[fault][asio][lost_ack]") {
    const bool prepared = GENERATE(true, false);
    Loop loop;
    lost_ack_scenario(async_driver(loop), prepared);
}

// A save whose server went away keeps trying for save_retry_window; a claim made meanwhile must
// still hear store_unavailable at once (the effect not run), not wait in line behind that save.
TEST_CASE("async: in an outage a claim is refused at once while a save keeps trying (AsyncPostgresStore)",
          "[fault][asio][outage]") {
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN("IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): skipping the outage case");
        return;
    }
    auto proxy = std::make_unique<Proxy>(env("IDEM_PG_HOST") + "/.s.PGSQL." + env("IDEM_PG_PORT"));
    Loop loop;
    idem::PostgresOptions o = idem_test::env_options({});
    o.table = idem_test::unique_name("idem_async_outage");
    o.pool_size = 1;  // one transaction in flight at a time: the save holds it while it tries
    o.save_retry_window = std::chrono::seconds(8);
    AsyncPostgresStore store(loop.io.get_executor(), proxied_url(*proxy), o);
    store.blocking().ensure_schema();
    const std::string scope = idem_test::unique_name("outage");

    std::atomic<int> runs_a{0}, runs_b{0};
    std::uint64_t retries_before = 0;  // when a's effect ends: a's save has not begun
    std::promise<void> away;
    auto a = idem::asio::async_execute_once(
        store, Key(scope, "a"), fp_for(Key(scope, "a")),
        [&] {
            ++runs_a;
            proxy.reset();  // the server is away from here on: its connection closed, new ones refused
            retries_before = store.stats().retries;
            away.set_value();
            return Response{200, "a"};
        },
        net::use_future);
    away.get_future().wait();
    // a's save is trying: it has failed once and goes on within its window (or, on a machine
    // slower than the 8 s window, has given up; b is refused at once then too).
    const auto trying_by = Clock::now() + std::chrono::seconds(30);
    while (store.stats().retries == retries_before &&
           a.wait_for(std::chrono::seconds(0)) != std::future_status::ready && Clock::now() < trying_by) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }

    const auto started = Clock::now();
    auto b = idem::asio::async_execute_once(
        store, Key(scope, "b"), fp_for(Key(scope, "b")),
        [&] {
            ++runs_b;
            return Response{200, "b"};
        },
        net::use_future);
    REQUIRE_THROWS_AS(b.get(), idem::store_unavailable);
    const auto waited = Clock::now() - started;
    CHECK(runs_b == 0);
    // At once: well inside the save's 8 s window (a claim alone fails in milliseconds here).
    CHECK(waited < std::chrono::seconds(4));
    REQUIRE_THROWS_AS(a.get(), idem::response_not_saved);
    CHECK(runs_a == 1);
    PgConn(idem_test::database_url()).exec("DROP TABLE IF EXISTS " + o.table);
}

// The network to PostgreSQL goes silent as effects return: every save must give up within its
// save_retry_window (plus the one attempt in flight), however many wait for the pool's few
// connections — not pool_size at a time, one connect_timeout after another.
TEST_CASE("async: saves into a silent network give up within save_retry_window, however many wait",
          "[fault][asio][outage]") {
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN("IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): skipping the outage case");
        return;
    }
    Proxy proxy(env("IDEM_PG_HOST") + "/.s.PGSQL." + env("IDEM_PG_PORT"));
    Loop loop;
    idem::PostgresOptions o = idem_test::env_options({});
    o.table = idem_test::unique_name("idem_async_silent");
    o.pool_size = 3;
    o.save_retry_window = std::chrono::seconds(6);
    o.connect_timeout = std::chrono::seconds(2);
    o.statement_timeout = std::chrono::seconds(1);
    o.lock_timeout = std::chrono::milliseconds(500);
    AsyncPostgresStore store(loop.io.get_executor(), proxied_url(proxy), o);
    store.blocking().ensure_schema();
    const std::string scope = idem_test::unique_name("silent");
    constexpr int kCalls = 8;

    // Every effect waits at a gate until the network is silent, then returns: its save goes out
    // into the silence.
    net::steady_timer gate(loop.io.get_executor(), std::chrono::steady_clock::time_point::max());
    std::atomic<int> inside{0};
    std::vector<std::future<idem::Result<Response>>> calls;
    for (int i = 0; i < kCalls; ++i) {
        const Key key(scope, "k" + std::to_string(i));
        calls.push_back(idem::asio::async_execute_once(
            store, key, fp_for(key),
            [&, i]() -> net::awaitable<Response> {
                ++inside;
                boost::system::error_code ec;
                co_await gate.async_wait(net::redirect_error(net::use_awaitable, ec));
                co_return Response{200, "k" + std::to_string(i)};
            },
            net::use_future));
    }
    const auto by = Clock::now() + std::chrono::seconds(30);
    while (inside < kCalls && Clock::now() < by) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(inside == kCalls);  // every claim is committed: the saves are what meets the silence
    proxy.silence();
    const auto released = Clock::now();
    net::post(loop.io.get_executor(), [&] { gate.cancel(); });
    for (auto& c : calls) CHECK_THROWS_AS(c.get(), idem::response_not_saved);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - released);
    INFO("the last save gave up " << took.count() << " ms after the effects returned");
    // The window, plus the attempt in flight at its end (a connect_timeout, or a statement's
    // deadline: statement_timeout + lock_timeout + 1 s), plus room for a busy machine.
    CHECK(took < std::chrono::seconds(6 + 3 + 4));  // before: 17-24 s (pool_size connects at a time)
}
