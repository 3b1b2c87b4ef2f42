// tests/asio/async_fault_test.cpp — the fault scenarios of tests/fault (backend_kill_test.cpp,
// crash_test.cpp, lost_ack_test.cpp) against idem::asio: AsyncPostgresStore and async_execute_once.
//
// The same machinery (tests/fault/fault.hpp): every run of the effect INSERTs a row into an effects
// table over its own autocommit connection (Effects::Writer), so duplicates are counted by the
// database, outside idem; every call is recorded (History) and check() resolves what is in doubt
// with one reconciler sweep and checks every key. What differs: the calls are
// async_execute_once(..., use_awaitable) from coroutines on the store's strand (AsyncLoad, co_call),
// and the effect's blocking INSERT runs on a thread pool the coroutine awaits, so the event loop
// never waits on it. check()'s reconciler and final retries use the store's blocking members (which
// run its asynchronous operations). Needs scripts/with-postgres.sh's cluster (IDEM_PG_DATA,
// IDEM_PG_HOST/IDEM_PG_PORT) for the crash and proxy scenarios; otherwise they WARN and skip.
#include "fault.hpp"
#include "idem/asio.hpp"
#include "proxy.hpp"
#include "store_env.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
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

/// What the caller of one call was told, from its exception (the same classes as fault::run_call).
void classify(Call& c, const std::exception_ptr& failure) {
    try {
        std::rethrow_exception(failure);
    } catch (const idem::not_performed& e) {
        c.told = Told::not_performed, c.detail = e.what();
    } catch (const idem::response_too_large& e) {
        c.told = Told::response_too_large, c.bytes = e.encoded_result(), c.detail = e.what();
    } catch (const idem::response_not_saved& e) {
        c.told = Told::response_not_saved, c.bytes = e.encoded_result(), c.detail = e.what();
    } catch (const EffectUnknown& e) {
        c.told = Told::effect_unknown, c.detail = e.what();
    } catch (const idem::lease_lost& e) {
        c.told = Told::lease_lost, c.detail = e.what();
    } catch (const idem::pool_timeout& e) {
        c.told = Told::pool_timeout, c.detail = e.what();
    } catch (const idem::store_unavailable& e) {
        c.told = Told::store_unavailable, c.detail = e.sqlstate() + " " + e.what();
    } catch (const idem::database_error& e) {
        c.told = Told::database_error, c.detail = e.sqlstate() + " " + e.what();
    } catch (const idem::corrupt_record& e) {
        c.told = Told::corrupt_record, c.detail = e.what();
    } catch (const std::exception& e) {
        c.told = Told::other_error, c.detail = e.what();
    }
}

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
        switch (r.outcome()) {
            case idem::Outcome::executed: c.told = Told::executed; break;
            case idem::Outcome::replayed: c.told = Told::replayed; break;
            case idem::Outcome::in_progress: c.told = Told::in_progress; break;
            case idem::Outcome::mismatch: c.told = Told::mismatch; break;
        }
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
class AsyncLoad {
public:
    AsyncLoad(Loop& loop, AsyncPostgresStore& store, const Effects& effects, History& history, LoadOptions options)
        : loop_(loop), store_(store), effects_(effects), history_(history), options_(std::move(options)) {}
    ~AsyncLoad() {
        try {
            stop();
        } catch (...) {
        }
    }
    AsyncLoad(const AsyncLoad&) = delete;
    AsyncLoad& operator=(const AsyncLoad&) = delete;

    void start() {
        for (int t = 0; t < options_.threads; ++t) writers_.push_back(std::make_unique<Effects::Writer>(effects_));
        for (int t = 0; t < options_.threads; ++t)
            clients_.push_back(net::co_spawn(store_.get_executor(), client(t), net::use_future));
    }
    /// Clients finish the call they are in, start no other.
    void request_stop() { stop_ = true; }
    /// Waits for every client; a client that ended by an exception (none should) fails the test.
    void stop() {
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
    [[nodiscard]] std::size_t keys_started() const { return std::min<std::size_t>(next_.load() / 2, options_.max_keys); }
    [[nodiscard]] bool finished() const { return done_.load() == options_.threads; }

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
    idem::PostgresStore(url, o).ensure_schema();
}

}  // namespace

// ---- scenario 1: backends killed --------------------------------------------------------------

TEST_CASE("async scenario 1: backends terminated under load (AsyncPostgresStore)", "[fault][asio][backend_kill]") {
    const std::string url = require_db();
    IdemTable table(url);
    Effects effects(url);
    make_schema(url, table.name());
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.application_name = idem_test::unique_name("idem_fault_async_kill");
    options.statement_timeout = 5s;
    options.lock_timeout = 1s;
    Loop loop;
    AsyncPostgresStore store(loop.io.get_executor(), url, idem_test::env_options(options));

    History history;
    LoadOptions lo;
    lo.threads = 32;
    lo.scope = idem_test::unique_name("akill");
    lo.claim.lease = 1s;
    Figures f;
    f.scenario = "async_backend_kill";

    PgConn admin(url);
    std::minstd_rand rng(static_cast<unsigned>(::getpid()));
    {
        AsyncLoad load(loop, store, effects, history, lo);
        load.start();
        std::this_thread::sleep_for(300ms);
        for (int round = 0; round < 20; ++round) {
            std::this_thread::sleep_for(std::chrono::milliseconds(80 + rng() % 150));
            const auto victims = static_cast<int>(1 + rng() % 3);
            auto r = admin.exec("SELECT pg_terminate_backend(pid) FROM (SELECT pid FROM pg_stat_activity WHERE "
                                "application_name = $1 ORDER BY random() LIMIT " +
                                    std::to_string(victims) + ") v",
                                {options.application_name});
            f.faults += r.rows();
            ++f.rounds;
        }
        std::this_thread::sleep_for(300ms);
        load.stop();
    }
    const auto stats = store.stats();
    f.notes.push_back("store: retries=" + std::to_string(stats.retries) +
                      " connections_opened=" + std::to_string(stats.connections_opened) +
                      " connections_discarded=" + std::to_string(stats.connections_discarded) +
                      " claims=" + std::to_string(stats.claims));

    // The connections heal: broken ones were discarded, at most pool_size are open, new calls work.
    CHECK(f.faults > 0);
    CHECK(stats.connections_discarded > 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                       {options.application_name}) <= static_cast<long long>(options.pool_size));
    {
        Effects::Writer writer(effects);
        for (int i = 0; i < 16; ++i) {
            Call c = call(loop, store, writer, Key(lo.scope, "after-" + std::to_string(i)));
            CHECK(c.told == Told::executed);
            history.add(std::move(c));
        }
    }

    check(store, effects, history, CheckOptions{lo.scope, table.name()}, f);
    f.print();
    CHECK(f.calls > 100);
    CHECK(f.anomalies.empty());
}

// ---- scenario 2: PostgreSQL crashed and restarted ----------------------------------------------

namespace {

struct Loss {
    std::size_t acked_saves = 0, lost_saves = 0;    // told executed/replayed: must be stored, same bytes
    std::size_t acked_claims = 0, lost_claims = 0;  // fn ran under the claim: the key must exist
};

/// Right after the restart, before anything resolves keys: is everything acknowledged still there?
Loss durability(const std::string& url, const std::string& table, const History& history, Figures* f) {
    PgConn db(url);
    Loss loss;
    for (const Call& c : history.calls()) {
        const auto row = read_row(db, table, c.key);
        if (is_answer(c.told)) {
            ++loss.acked_saves;
            if (!row || row->state != "completed" || row->result != c.bytes) {
                ++loss.lost_saves;
                if (f) f->anomaly(c.key.value() + ": acknowledged response (" + name(c.told) + ") lost in the crash");
            }
        }
        if (c.fn_started && c.told != Told::not_performed && c.told != Told::store_unavailable &&
            c.told != Told::pool_timeout) {
            ++loss.acked_claims;
            if (!row) {
                ++loss.lost_claims;
                if (f) f->anomaly(c.key.value() + ": acknowledged claim lost in the crash");
            }
        }
    }
    return loss;
}

/// Resets synchronous_commit at scope exit (needs the server up: declare before ServerGuard).
struct SyncCommitGuard {
    std::string url;
    bool changed = false;
    void set_off() {
        PgConn c(url);
        c.exec("ALTER SYSTEM SET synchronous_commit = off");
        c.exec("SELECT pg_reload_conf()");
        changed = true;
    }
    void reset() {
        PgConn c(url);
        c.exec("ALTER SYSTEM RESET synchronous_commit");
        c.exec("SELECT pg_reload_conf()");
        changed = false;
    }
    ~SyncCommitGuard() {
        if (changed) {
            try {
                reset();
            } catch (...) {
            }
        }
    }
};

struct Round {
    History history;
    std::string scope;
    int failed_after_restart = 0;  // store_unavailable from a healthy server before the store healed
};

void crash_round(Loop& loop, AsyncPostgresStore& store, const Effects& effects, Round& round, ServerGuard& guard,
                 std::minstd_rand& rng) {
    LoadOptions lo;
    lo.threads = 32;
    lo.scope = round.scope;
    lo.claim.lease = 1s;
    lo.replay_p = 0.1;
    AsyncLoad load(loop, store, effects, round.history, lo);
    load.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(700 + rng() % 800));
    guard.down = true;
    crash_server([&] { load.request_stop(); });  // calls in flight at the kill see it; no new ones
    start_server();
    guard.down = false;
    load.stop();  // saves in flight keep retrying through the restart (save_retry_window)
    round.failed_after_restart = heal(store);
}

}  // namespace

TEST_CASE("async scenario 2: PostgreSQL killed (kill -9) mid-load and restarted (AsyncPostgresStore)",
          "[fault][asio][crash]") {
    const std::string url = require_db();
    if (!server_controllable()) {
        WARN("IDEM_PG_DATA is not set (the database was not started by scripts/with-postgres.sh): skipping");
        return;
    }
    IdemTable table(url);
    Effects effects(url);
    make_schema(url, table.name());
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.application_name = "idem_fault_async_crash";
    options.connect_timeout = 2s;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    Loop loop;
    AsyncPostgresStore store(loop.io.get_executor(), url, idem_test::env_options(options));
    std::minstd_rand rng(static_cast<unsigned>(::getpid()));

    SyncCommitGuard sync{url};
    ServerGuard guard;

    SECTION("synchronous_commit=on: nothing acknowledged is lost") {
        Figures f;
        f.scenario = "async_crash";
        Loss total;
        int failed_after_restart = 0;
        for (int r = 0; r < 3; ++r) {
            Round round;
            round.scope = idem_test::unique_name("acrash");
            crash_round(loop, store, effects, round, guard, rng);
            ++f.rounds;
            ++f.faults;
            failed_after_restart += round.failed_after_restart;
            const Loss loss = durability(url, table.name(), round.history, &f);
            total.acked_saves += loss.acked_saves, total.lost_saves += loss.lost_saves;
            total.acked_claims += loss.acked_claims, total.lost_claims += loss.lost_claims;
            check(store, effects, round.history, CheckOptions{round.scope, table.name()}, f);
        }
        f.notes.push_back("acknowledged saves checked=" + std::to_string(total.acked_saves) +
                          " lost=" + std::to_string(total.lost_saves) +
                          "; acknowledged claims checked=" + std::to_string(total.acked_claims) +
                          " lost=" + std::to_string(total.lost_claims));
        f.notes.push_back("calls that failed (store_unavailable) on a restarted, healthy server before the store "
                          "healed: " +
                          std::to_string(failed_after_restart));
        f.print();
        CHECK(total.acked_saves > 0);
        CHECK(total.acked_claims > 0);
        CHECK(total.lost_saves == 0);
        CHECK(total.lost_claims == 0);
        CHECK(f.anomalies.empty());
    }

    SECTION("negative control, synchronous_commit=off: the same check detects loss (reported only)") {
        // Effects outside PostgreSQL (a provider): an effect row committed with synchronous_commit=on
        // would flush the WAL, and every claim before it, hiding the loss this control must show.
        Effects provider(url, Effects::outside);
        sync.set_off();
        Figures f;
        f.scenario = "async_crash_negative_control(synchronous_commit=off)";
        Loss total;
        std::size_t would_be_anomalies = 0;
        constexpr int rounds = 3;
        for (int r = 0; r < rounds; ++r) {
            Round round;
            round.scope = idem_test::unique_name("acrashoff");
            crash_round(loop, store, provider, round, guard, rng);
            ++f.rounds;
            ++f.faults;
            const Loss loss = durability(url, table.name(), round.history, nullptr);
            total.acked_saves += loss.acked_saves, total.lost_saves += loss.lost_saves;
            total.acked_claims += loss.acked_claims, total.lost_claims += loss.lost_claims;
            Figures g;
            check(store, provider, round.history, CheckOptions{round.scope, table.name()}, g);
            would_be_anomalies += g.anomalies.size();
            f.calls += g.calls, f.keys += g.keys, f.in_doubt += g.in_doubt;
            for (const auto& [k, v] : g.told) f.told[k] += v;
            for (const auto& a : g.anomalies) {
                if (f.notes.size() < 8) f.notes.push_back("detected: " + a);
            }
        }
        sync.reset();
        const bool detected = total.lost_saves + total.lost_claims > 0;
        f.detected = static_cast<long>(total.lost_saves + total.lost_claims + would_be_anomalies);
        f.notes.push_back("acknowledged saves checked=" + std::to_string(total.acked_saves) +
                          " lost=" + std::to_string(total.lost_saves) +
                          "; acknowledged claims checked=" + std::to_string(total.acked_claims) +
                          " lost=" + std::to_string(total.lost_claims) +
                          "; guarantee violations the checker found=" + std::to_string(would_be_anomalies));
        f.notes.push_back(detected ? "NEGATIVE CONTROL: loss DETECTED (the check can fail)"
                                   : "NEGATIVE CONTROL: loss not detected in " + std::to_string(rounds) + " rounds");
        f.print();
        if (!detected) WARN("negative control: no loss detected in " << rounds << " crashes with synchronous_commit=off");
        CHECK(total.acked_saves > 0);  // the control ran real load
    }
}

// After a restart every idle connection of the store is dead: the first call must not fail on them.
TEST_CASE("async: after a restart, the first call succeeds (AsyncPostgresStore)", "[fault][asio][crash]") {
    const std::string url = require_db();
    if (!server_controllable()) {
        WARN("IDEM_PG_DATA is not set: skipping");
        return;
    }
    IdemTable table(url);
    make_schema(url, table.name());
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.connect_timeout = 2s;
    Loop loop;
    AsyncPostgresStore store(loop.io.get_executor(), url, idem_test::env_options(options));
    {
        // Many reads at once: the store opens its connections.
        std::vector<std::future<std::optional<idem::Record>>> reads;
        for (int i = 0; i < 64; ++i) reads.push_back(store.async_read(Key("warm", "k" + std::to_string(i)), net::use_future));
        for (auto& r : reads) (void)r.get();
    }
    const auto opened = store.stats().connections_opened;
    CAPTURE(opened);
    ServerGuard guard;
    guard.down = true;
    crash_server();
    start_server();
    guard.down = false;
    std::string error;
    try {
        (void)store.read(Key("after", "restart"));
    } catch (const idem::store_unavailable& e) {
        error = e.what();
    }
    CAPTURE(error);
    std::cout << "FAULT-FIGURES scenario=async_first_call_after_restart connections=" << opened
              << " first_call=" << (error.empty() ? "ok" : "store_unavailable") << "\n";
    CHECK(error.empty());
    // And the first claim: claimed, its effect run once.
    Effects effects(url);
    Effects::Writer writer(effects);
    PgConn db(url);
    const Key key("after", idem_test::unique_name("claim"));
    const Call first_claim = call(loop, store, writer, key);
    CAPTURE(first_claim.detail);
    CHECK(first_claim.told == Told::executed);
    CHECK(effects.of(db, key).size() == 1);
}

// ---- scenario 3: acknowledgements lost on the wire ---------------------------------------------

namespace {

const Proxy::Target kSave{{"idem_save"}, {"SET state = 'completed'"}};
const Proxy::Target kClaim{{"idem_claim"}, {"ON CONFLICT (scope, key) DO NOTHING"}};

std::string proxied_url(const Proxy& proxy) {
    return "host=127.0.0.1 port=" + std::to_string(proxy.port()) +
           " dbname=postgres user=postgres sslmode=disable gssencmode=disable";
}

}  // namespace

TEST_CASE("async scenario 3: acknowledgements lost on the wire (AsyncPostgresStore)", "[fault][asio][lost_ack]") {
    const std::string url = require_db();
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN("IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): skipping the proxy scenario");
        return;
    }
    Proxy proxy(env("IDEM_PG_HOST") + "/.s.PGSQL." + env("IDEM_PG_PORT"));
    IdemTable table(url);
    Effects effects(url);  // effects go straight to the server, never through the proxy
    make_schema(url, table.name());
    const bool prepared = GENERATE(true, false);
    CAPTURE(prepared);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.prepared_statements = prepared;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    options.application_name = "idem_fault_async_lost_ack";
    Loop loop;
    AsyncPostgresStore store(loop.io.get_executor(), proxied_url(proxy), idem_test::env_options(options));

    const std::string scope = idem_test::unique_name(prepared ? "aack_p" : "aack_u");
    History history;
    Figures f;
    f.scenario = std::string("async_lost_ack(") + (prepared ? "prepared" : "unnamed") + ")";
    Effects::Writer writer(effects);
    PgConn db(url);
    idem::ClaimOptions short_lease;
    short_lease.lease = 1s;  // keys left in doubt become stale (reconcilable) quickly

    // One key: the caller's outcome, then a retry, recorded; the effect must have run once.
    // cuts < 0: cut every matching statement until the call returns (at least -cuts of them).
    const auto once = [&](AsyncPostgresStore& on, const std::string& key_name, const Proxy::Target& target, int cuts,
                          Proxy::Mode mode, Told expected) {
        const Key key(scope, key_name);
        const int before = proxy.cuts();
        const auto stats_before = on.stats();
        proxy.arm(target, cuts < 0 ? 1'000'000 : cuts, mode);
        proxy.note("---- " + key_name + " first call");
        Call first = call(loop, on, writer, key, true, short_lease);
        proxy.disarm();
        const auto retries = on.stats().retries - stats_before.retries;
        const auto claims_won = on.stats().claims_won - stats_before.claims_won;
        CAPTURE(key_name, first.detail, first.ms, retries, claims_won, proxy.log());
        if (cuts < 0) {
            CHECK(proxy.cuts() - before >= -cuts);
        } else {
            CHECK(proxy.cuts() - before == cuts);
        }
        CHECK(first.told == expected);
        if (expected == Told::executed) {
            CHECK(first.fn_started);
            CHECK(claims_won == 1);  // the retried claim recognised its own fence: claimed, once
            CHECK(retries >= 1);
        }
        f.faults += proxy.cuts() - before;
        ++f.rounds;
        proxy.note("---- " + key_name + " retry");
        Call retry = call(loop, on, writer, key, true, short_lease);
        if (expected == Told::executed || expected == Told::response_not_saved) {
            // The effect happened once; the retry replays exactly what the caller was (or could be) told.
            CHECK(retry.told == Told::replayed);
            CHECK_FALSE(retry.fn_started);
            CHECK(retry.bytes == first.bytes);
            CHECK(effects.of(db, key).size() == 1);
            const auto row = read_row(db, table.name(), key);
            REQUIRE(row);
            CHECK(row->state == "completed");
            CHECK(row->result == std::optional<std::string>(first.bytes));
        }
        history.add(std::move(first));
        history.add(std::move(retry));
    };

    const auto t0 = Clock::now();
    for (int i = 0; i < 6; ++i) {
        // The save committed, its answer lost: the retry finds the row completed with its own fence.
        once(store, "save-ack-" + std::to_string(i), kSave, 1, Proxy::Mode::after_reply, Told::executed);
        // The claim committed, its answer lost: the retry finds its own fence in progress → claimed.
        once(store, "claim-ack-" + std::to_string(i), kClaim, 1, Proxy::Mode::after_reply, Told::executed);
        // The request itself lost: the retry simply does it.
        once(store, "save-req-" + std::to_string(i), kSave, 1, Proxy::Mode::before_send, Told::executed);
        once(store, "claim-req-" + std::to_string(i), kClaim, 1, Proxy::Mode::before_send, Told::executed);
        // Answers lost on two attempts in a row: the third recognises the first's write.
        once(store, "save-ack2-" + std::to_string(i), kSave, 2, Proxy::Mode::after_reply, Told::executed);
        once(store, "claim-ack2-" + std::to_string(i), kClaim, 2, Proxy::Mode::after_reply, Told::executed);
    }

    // Three save answers lost in a row: the save keeps retrying (fenced) within save_retry_window.
    once(store, "save-ack3", kSave, 3, Proxy::Mode::after_reply, Told::executed);

    // Every attempt loses its answer until save_retry_window (300 ms) has passed: the save landed but
    // idem cannot know → response_not_saved carrying the bytes; the retry replays those very bytes.
    {
        auto narrow = options;
        narrow.save_retry_window = 300ms;
        AsyncPostgresStore short_window(loop.io.get_executor(), proxied_url(proxy), idem_test::env_options(narrow));
        once(short_window, "save-all-lost", kSave, -narrow.claim_attempts, Proxy::Mode::after_reply,
             Told::response_not_saved);
    }

    // Every claim attempt loses its answer: store_unavailable, fn not called. The first attempt's claim
    // did commit, so the key is left in progress (never lost) until the reconciler frees it.
    {
        const Key key(scope, "claim-all-lost");
        proxy.arm(kClaim, options.claim_attempts, Proxy::Mode::after_reply);
        Call c = call(loop, store, writer, key, true, short_lease);
        proxy.disarm();
        CAPTURE(c.detail);
        CHECK(c.told == Told::store_unavailable);
        CHECK_FALSE(c.fn_started);
        f.faults += options.claim_attempts;
        const auto row = read_row(db, table.name(), key);
        f.notes.push_back(std::string("claim-all-lost: store_unavailable thrown, key ") +
                          (row ? "left in progress (claim committed; resolved by the reconciler)" : "absent"));
        history.add(std::move(c));
        Call retry = call(loop, store, writer, key, true, short_lease);  // the orphan claim: in_progress
        CHECK((retry.told == Told::in_progress || retry.told == Told::executed));
        CHECK(effects.of(db, key).size() <= 1);
        history.add(std::move(retry));
    }

    const auto t1 = Clock::now();
    // Under load: 32 client coroutines, each claim/save cut with probability 0.1.
    {
        LoadOptions lo;
        lo.threads = 32;
        lo.scope = scope;
        lo.max_keys = 200;
        lo.claim.lease = 1s;
        const int before = proxy.cuts();
        proxy.random(Proxy::Target{{"idem_claim", "idem_save"},
                                   {"ON CONFLICT (scope, key) DO NOTHING", "SET state = 'completed'"}},
                     0.1, static_cast<unsigned>(::getpid()));
        AsyncLoad load(loop, store, effects, history, lo);
        load.start();
        const auto deadline = Clock::now() + 60s;
        while (!load.finished() && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
        load.stop();
        proxy.disarm();
        CHECK(proxy.cuts() - before > 0);
        f.faults += proxy.cuts() - before;
        ++f.rounds;
    }
    f.notes.push_back("proxy: connections=" + std::to_string(proxy.connections()) +
                      " cuts=" + std::to_string(proxy.cuts()) + " (after the reply: " +
                      std::to_string(proxy.cuts_after_reply()) + ") store retries=" + std::to_string(store.stats().retries));

    const auto t2 = Clock::now();
    check(store, effects, history, CheckOptions{scope, table.name()}, f);
    f.notes.push_back("seconds: single keys " + std::to_string(std::chrono::duration<double>(t1 - t0).count()) +
                      ", load " + std::to_string(std::chrono::duration<double>(t2 - t1).count()) + ", check " +
                      std::to_string(ms_since(t2) / 1000));
    f.print();
    CHECK(f.anomalies.empty());
}
