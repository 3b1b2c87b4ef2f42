// tests/fault/scenarios.hpp — the backend-kill, crash and lost-ack scenarios, written once over a
// Driver: how a scenario opens a store, makes one call and drives a load. blocking_driver() makes
// its calls with execute_once on client threads (backend_kill_test.cpp, crash_test.cpp,
// lost_ack_test.cpp); tests/asio/async_fault_test.cpp makes them with async_execute_once from
// coroutines. The checks, the counting, the FAULT-FIGURES lines and the negative control are the
// same for both.
#pragma once

#include "fault.hpp"
#include "proxy.hpp"
#include "store_env.hpp"

namespace fault {

/// How a scenario reaches the store.
struct Driver {
    /// "" or "async_": before scenario names (FAULT-FIGURES) and application names.
    std::string prefix;
    /// "" or "a": before the scenarios' scopes.
    std::string scope_prefix;
    /// How many clients a load runs (threads or coroutines).
    int load_clients = 8;
    /// A store over `url`; with make_schema, its table is made first (or by it).
    std::function<std::unique_ptr<idem::IdempotencyStore>(const std::string& url, const idem::PostgresOptions& options,
                                                          bool make_schema)>
        open;
    /// One call, classified for the history (fault::run_call, or through async_execute_once).
    std::function<Call(idem::IdempotencyStore&, Effects::Writer&, const Key&, bool right_fp, const idem::ClaimOptions&)>
        call;
    /// A load of load_clients clients racing on shared keys.
    std::function<std::unique_ptr<LoadDriver>(idem::IdempotencyStore&, const Effects&, History&, const LoadOptions&)>
        load;
    /// Opens the store's connections (many calls at once), then leaves them idle.
    std::function<void(idem::IdempotencyStore&)> warm;
};

/// execute_once on client threads over a PostgresStore.
inline Driver blocking_driver() {
    Driver d;
    d.open = [](const std::string& url, const idem::PostgresOptions& options,
                bool make_schema) -> std::unique_ptr<idem::IdempotencyStore> {
        auto store = std::make_unique<idem::PostgresStore>(url, options);
        if (make_schema) store->ensure_schema();
        return store;
    };
    d.call = [](idem::IdempotencyStore& store, Effects::Writer& writer, const Key& key, bool right_fp,
                const idem::ClaimOptions& claim) { return run_call(store, writer, key, right_fp, claim); };
    d.load = [](idem::IdempotencyStore& store, const Effects& effects, History& history,
                const LoadOptions& lo) -> std::unique_ptr<LoadDriver> {
        return std::make_unique<Load>(store, effects, history, lo);
    };
    d.warm = [](idem::IdempotencyStore& store) {
        // 8 concurrent reads open all 8 connections.
        std::vector<std::thread> threads;
        std::atomic<int> inside{0};
        for (int i = 0; i < 8; ++i) {
            threads.emplace_back([&] {
                ++inside;
                while (inside.load() < 8) std::this_thread::yield();
                for (int j = 0; j < 20; ++j) (void)store.read(Key("warm", "k"));
            });
        }
        for (auto& t : threads) t.join();
    };
    return d;
}

/// Waits (at most 30 s: a loaded machine) until the load has had a call answered: its connections
/// are open and its commits flow. If it never has, the test case fails here and goes on (the load
/// still has to be stopped).
inline void await_answered(const History& history) {
    const auto deadline = Clock::now() + 30s;
    for (;;) {
        const auto calls = history.calls();
        if (std::any_of(calls.begin(), calls.end(), [](const Call& c) { return is_answer(c.told); })) return;
        if (Clock::now() > deadline) {
            FAIL_CHECK("the load had no call answered within 30 s");
            return;
        }
        std::this_thread::sleep_for(10ms);
    }
}

// ---- scenario 1: backends killed
// ---------------------------------------------------------------------

/// pg_terminate_backend on random idem connections, 20 rounds, under load. Guarantee: no duplicate
/// effect, every answer byte-identical to the stored response, the connections heal, keys in doubt
/// are resolved by one reconciler sweep.
inline void backend_kill_scenario(const Driver& d) {
    const std::string url = require_db();
    IdemTable table(url);
    Effects effects(url);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.application_name = idem_test::unique_name("idem_fault_" + d.prefix + "kill");
    options.statement_timeout = 5s;
    options.lock_timeout = 1s;
    const auto store_ptr = d.open(url, idem_test::env_options(options), true);
    idem::IdempotencyStore& store = *store_ptr;

    History history;
    LoadOptions lo;
    lo.threads = d.load_clients;
    lo.scope = idem_test::unique_name(d.scope_prefix + "kill");
    lo.claim.lease = 1s;
    Figures f;
    f.scenario = d.prefix + "backend_kill";

    PgConn admin(url);
    std::minstd_rand rng(static_cast<unsigned>(::getpid()));
    {
        const auto load = d.load(store, effects, history, lo);
        load->start();
        await_answered(history);  // its connections are there to be terminated
        for (int round = 0; round < 20; ++round) {
            std::this_thread::sleep_for(std::chrono::milliseconds(80 + rng() % 150));
            const auto victims = static_cast<int>(1 + rng() % 3);
            auto r = admin.exec(
                "SELECT pg_terminate_backend(pid) FROM (SELECT pid FROM "
                "pg_stat_activity WHERE application_name = $1 "
                "ORDER BY random() LIMIT " +
                    std::to_string(victims) + ") v",
                {options.application_name});
            f.faults += r.rows();
            ++f.rounds;
        }
        std::this_thread::sleep_for(300ms);
        // The check below wants more than 100 calls; on a loaded machine 20 rounds can pass with
        // fewer, so the load runs on (healthy now) until it has made them, within a generous bound.
        const auto enough_by = std::chrono::steady_clock::now() + 120s;
        while (history.size() < 100 && std::chrono::steady_clock::now() < enough_by) {
            std::this_thread::sleep_for(50ms);
        }
        load->stop();
    }
    const auto stats = store.stats();
    f.notes.push_back("store: retries=" + std::to_string(stats.retries) +
                      " connections_opened=" + std::to_string(stats.connections_opened) + " connections_discarded=" +
                      std::to_string(stats.connections_discarded) + " claims=" + std::to_string(stats.claims));

    // The connections heal: broken ones were discarded, at most pool_size are open, new calls
    // work.
    CHECK(f.faults > 0);
    CHECK(stats.connections_discarded > 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                       {options.application_name}) <= static_cast<long long>(options.pool_size));
    {
        Effects::Writer writer(effects);
        for (int i = 0; i < 16; ++i) {
            Call c = d.call(store, writer, Key(lo.scope, "after-" + std::to_string(i)), true, {});
            CHECK(c.told == Told::executed);
            history.add(std::move(c));
        }
    }

    check(store, effects, history, CheckOptions{lo.scope, table.name()}, f);
    f.print();
    CHECK(f.calls > 100);
    CHECK(f.anomalies.empty());
}

// ---- scenario 2: PostgreSQL crashed and restarted
// ----------------------------------------------------

struct Loss {
    std::size_t acked_saves = 0,
                lost_saves = 0;                     // told executed/replayed: must be stored, same bytes
    std::size_t acked_claims = 0, lost_claims = 0;  // fn ran under the claim: the key must exist

    Loss& operator+=(const Loss& o) {
        acked_saves += o.acked_saves, lost_saves += o.lost_saves;
        acked_claims += o.acked_claims, lost_claims += o.lost_claims;
        return *this;
    }
    [[nodiscard]] std::string note() const {
        return "acknowledged saves checked=" + std::to_string(acked_saves) + " lost=" + std::to_string(lost_saves) +
               "; acknowledged claims checked=" + std::to_string(acked_claims) + " lost=" + std::to_string(lost_claims);
    }
};

/// Right after the restart, before anything resolves keys: is everything acknowledged still there?
inline Loss durability(const std::string& url, const std::string& table, const History& history, Figures* f) {
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
        // The claim was acknowledged when fn started; only an acknowledged (or possibly landed)
        // release may have removed it since.
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
    int failed_after_restart = 0;  // store_unavailable from a healthy server: dead connections of the store
};

/// Load until a random moment, crash, restart.
inline void crash_round(const Driver& d, idem::IdempotencyStore& store, const Effects& effects, Round& round,
                        ServerGuard& guard, std::minstd_rand& rng) {
    LoadOptions lo;
    lo.threads = d.load_clients;
    lo.scope = round.scope;
    lo.claim.lease = 1s;
    lo.replay_p = 0.1;
    const auto load = d.load(store, effects, round.history, lo);
    load->start();
    // Once the load runs (connections open, commits flowing), crash at a random moment mid-flight.
    await_answered(round.history);
    std::this_thread::sleep_for(std::chrono::milliseconds(700 + rng() % 800));
    guard.down = true;
    crash_server([&] { load->request_stop(); });  // calls in flight at the kill see it; no new ones
    start_server();
    guard.down = false;
    // Saves in flight keep retrying through the restart (save_retry_window): join after it.
    load->stop();
    round.failed_after_restart = heal(store);
}

/// kill -9 of the postmaster and every server process mid-load, then a restart (crash recovery).
/// Guarantee: every acknowledged save is there, byte-identical; every acknowledged claim is there
/// (completed, or in progress for the reconciler); one reconciler sweep resolves the rest; no
/// effect twice. Negative control: the same with synchronous_commit=off must be able to DETECT
/// loss (reported, not failed: whether a given crash loses anything is up to timing).
inline void crash_scenario(const Driver& d) {
    const std::string url = require_db();
    if (!server_controllable()) {
        WARN(
            "IDEM_PG_DATA is not set (the database was not started by scripts/with-postgres.sh): "
            "cannot kill and restart it; skipping the crash scenario");
        return;
    }
    IdemTable table(url);
    Effects effects(url);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.application_name = "idem_fault_" + d.prefix + "crash";
    options.connect_timeout = 2s;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    options.pool_wait = 2s;  // the blocking pool's (idem::asio pipelines: no pool wait)
    const auto store_ptr = d.open(url, idem_test::env_options(options), true);
    idem::IdempotencyStore& store = *store_ptr;
    std::minstd_rand rng(static_cast<unsigned>(::getpid()));

    SyncCommitGuard sync{url};
    ServerGuard guard;

    SECTION("synchronous_commit=on: nothing acknowledged is lost") {
        Figures f;
        f.scenario = d.prefix + "crash";
        Loss total;
        int failed_after_restart = 0;
        for (int r = 0; r < 3; ++r) {
            Round round;
            round.scope = idem_test::unique_name(d.scope_prefix + "crash");
            crash_round(d, store, effects, round, guard, rng);
            ++f.rounds;
            ++f.faults;
            failed_after_restart += round.failed_after_restart;
            total += durability(url, table.name(), round.history, &f);
            check(store, effects, round.history, CheckOptions{round.scope, table.name()}, f);
        }
        f.notes.push_back(total.note());
        f.notes.push_back(
            "calls that failed (store_unavailable) on a restarted, healthy server before the "
            "store's connections healed: " +
            std::to_string(failed_after_restart));
        f.print();
        CHECK(total.acked_saves > 0);
        CHECK(total.acked_claims > 0);
        CHECK(total.lost_saves == 0);
        CHECK(total.lost_claims == 0);
        CHECK(f.anomalies.empty());
    }

    SECTION("negative control, synchronous_commit=off: the same check detects loss (reported only)") {
        // The effects happen outside PostgreSQL here (a provider): an effect row committed with
        // synchronous_commit=on would flush the WAL — and with it every claim before it — hiding
        // exactly the loss this control must show.
        Effects provider(url, Effects::outside);
        sync.set_off();
        Figures f;
        f.scenario = d.prefix + "crash_negative_control(synchronous_commit=off)";
        Loss total;
        std::size_t would_be_anomalies = 0;
        constexpr int rounds = 3;
        for (int r = 0; r < rounds; ++r) {
            Round round;
            round.scope = idem_test::unique_name(d.scope_prefix + "crashoff");
            crash_round(d, store, provider, round, guard, rng);
            ++f.rounds;
            ++f.faults;
            total += durability(url, table.name(), round.history, nullptr);
            // What the loss does to the guarantees (a lost claim whose effect ran lets a retry run
            // it again): counted, not failed.
            Figures g;
            check(store, provider, round.history, CheckOptions{round.scope, table.name()}, g);
            would_be_anomalies += g.anomalies.size();
            f.calls += g.calls, f.keys += g.keys, f.in_doubt += g.in_doubt;
            f.reconciled_saved += g.reconciled_saved, f.reconciled_released += g.reconciled_released;
            f.final_executed += g.final_executed;
            for (const auto& [k, v] : g.told) f.told[k] += v;
            for (const auto& a : g.anomalies) {
                if (f.notes.size() < 8) f.notes.push_back("detected: " + a);
            }
        }
        sync.reset();
        const bool detected = total.lost_saves + total.lost_claims > 0;
        f.detected = static_cast<long>(total.lost_saves + total.lost_claims + would_be_anomalies);
        f.notes.push_back(total.note() +
                          "; guarantee violations the checker found=" + std::to_string(would_be_anomalies));
        f.notes.push_back(detected ? "NEGATIVE CONTROL: loss DETECTED (the check can fail)"
                                   : "NEGATIVE CONTROL: loss not detected in " + std::to_string(rounds) + " rounds");
        f.print();
        if (!detected)
            WARN("negative control: no loss detected in " << rounds << " crashes with synchronous_commit=off");
        CHECK(total.acked_saves > 0);  // the control ran real load
    }
}

/// After a restart every idle connection of the store is dead. A statement that meets a broken
/// connection marks the idle ones suspect, so its retry pings them (discarding the dead) and lands
/// on a live or fresh connection: the first call after the restart succeeds, and so does the first
/// claim (its effect run once).
inline void first_call_after_restart_scenario(const Driver& d) {
    const std::string url = require_db();
    if (!server_controllable()) {
        WARN("IDEM_PG_DATA is not set: skipping");
        return;
    }
    IdemTable table(url);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.connect_timeout = 2s;
    const auto store_ptr = d.open(url, idem_test::env_options(options), true);
    idem::IdempotencyStore& store = *store_ptr;
    d.warm(store);
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
    std::cout << "FAULT-FIGURES scenario=" << d.prefix << "first_call_after_restart pooled_connections=" << opened
              << " first_call=" << (error.empty() ? "ok" : "store_unavailable") << "\n";
    CHECK(error.empty());
    // And the first claim: claimed, its effect run once.
    Effects effects(url);
    Effects::Writer writer(effects);
    PgConn db(url);
    const Key key("after", idem_test::unique_name("claim"));
    const Call first_claim = d.call(store, writer, key, true, {});
    CAPTURE(first_claim.detail);
    CHECK(first_claim.told == Told::executed);
    CHECK(effects.of(db, key).size() == 1);
}

// ---- scenario 3: acknowledgements lost on the wire
// ---------------------------------------------------

inline const Proxy::Target& save_target() {
    static const Proxy::Target t{{"idem_save"}, {"SET state = 'completed'"}};
    return t;
}
inline const Proxy::Target& claim_target() {
    static const Proxy::Target t{{"idem_claim"}, {"DO NOTHING RETURNING fence"}};
    return t;
}

inline std::string proxied_url(const Proxy& proxy) {
    return "host=127.0.0.1 port=" + std::to_string(proxy.port()) +
           " dbname=postgres user=postgres sslmode=disable gssencmode=disable";
}

/// A wire-protocol proxy on loopback (proxy.hpp) between idem and PostgreSQL cuts the connection
/// right after the claim INSERT or the save UPDATE was sent and committed, before its answer
/// reaches idem. Guarantee: the retry (same fence, fresh connection) recognises its own committed
/// write, so the caller is told the one true outcome, a later retry replays the same bytes, and
/// the effect runs exactly once. Needs the Unix socket of scripts/with-postgres.sh's cluster
/// (IDEM_PG_HOST/IDEM_PG_PORT).
inline void lost_ack_scenario(const Driver& d, bool prepared) {
    const std::string url = require_db();
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN(
            "IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): "
            "skipping the proxy scenario");
        return;
    }
    const Proxy::Target& kSave = save_target();
    const Proxy::Target& kClaim = claim_target();
    Proxy proxy(env("IDEM_PG_HOST") + "/.s.PGSQL." + env("IDEM_PG_PORT"));
    IdemTable table(url);
    Effects effects(url);  // effects go straight to the server, never through the proxy
    CAPTURE(prepared);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.prepared_statements = prepared;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    options.application_name = "idem_fault_" + d.prefix + "lost_ack";
    const auto store_ptr = d.open(proxied_url(proxy), idem_test::env_options(options), true);
    idem::IdempotencyStore& store = *store_ptr;

    const std::string scope = idem_test::unique_name(d.scope_prefix + (prepared ? "ack_p" : "ack_u"));
    History history;
    Figures f;
    f.scenario = d.prefix + "lost_ack(" + (prepared ? "prepared" : "unnamed") + ")";
    Effects::Writer writer(effects);
    PgConn db(url);
    idem::ClaimOptions short_lease;
    short_lease.lease = 1s;  // keys left in doubt become stale (reconcilable) quickly

    // One key: the caller's outcome, then a retry, recorded; the effect must have run once.
    // cuts < 0: cut every matching statement until the call returns (at least -cuts of them).
    const auto once = [&](idem::IdempotencyStore& on, const std::string& key_name, const Proxy::Target& target,
                          int cuts, Proxy::Mode mode, Told expected) {
        const Key key(scope, key_name);
        const int before = proxy.cuts();
        const auto stats_before = on.stats();
        proxy.arm(target, cuts < 0 ? 1'000'000 : cuts, mode);
        proxy.note("---- " + key_name + " first call");
        Call first = d.call(on, writer, key, true, short_lease);
        proxy.disarm();
        const auto stats_after = on.stats();
        const auto retries = stats_after.retries - stats_before.retries;
        const auto round_trips = stats_after.round_trips - stats_before.round_trips;
        const auto claims_won = stats_after.claims_won - stats_before.claims_won;
        CAPTURE(key_name, first.detail, first.ms, retries, round_trips, claims_won, proxy.log());
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
        Call retry = d.call(on, writer, key, true, short_lease);
        if (expected == Told::executed || expected == Told::response_not_saved) {
            // The effect happened once; the retry replays exactly what the caller was (or could be)
            // told.
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
    // Per round, in this order, for the save and then the claim:
    //   -ack-   the statement committed, its answer lost: the retry finds the row completed with
    //           its own fence (save), or its own fence in progress → claimed (claim);
    //   -req-   the request itself lost: the retry simply does it;
    //   -ack2-  answers lost on two attempts in a row: the third recognises the first's write.
    struct Cut {
        const char* name;
        int cuts;
        Proxy::Mode mode;
    };
    const Cut cuts[] = {{"-ack-", 1, Proxy::Mode::after_reply},
                        {"-req-", 1, Proxy::Mode::before_send},
                        {"-ack2-", 2, Proxy::Mode::after_reply}};
    const std::pair<const char*, const Proxy::Target*> statements[] = {{"save", &kSave}, {"claim", &kClaim}};
    for (int i = 0; i < 6; ++i) {
        for (const Cut& cut : cuts) {
            for (const auto& [statement, target] : statements)
                once(store, statement + std::string(cut.name) + std::to_string(i), *target, cut.cuts, cut.mode,
                     Told::executed);
        }
    }

    // Three save answers lost in a row: the save keeps retrying (fenced, safe) within
    // save_retry_window, and the attempt after them recognises the first one's write.
    once(store, "save-ack3", kSave, 3, Proxy::Mode::after_reply, Told::executed);

    // Every attempt loses its answer until save_retry_window (here 300 ms) has passed: the save
    // landed but idem cannot know → response_not_saved (an outcome_unknown) carrying the bytes; the
    // retry replays those very bytes.
    {
        auto narrow = options;
        narrow.save_retry_window = 300ms;
        const auto short_window = d.open(proxied_url(proxy), idem_test::env_options(narrow), false);
        once(*short_window, "save-all-lost", kSave, -narrow.claim_attempts, Proxy::Mode::after_reply,
             Told::response_not_saved);
    }

    // Every claim attempt loses its answer: store_unavailable, fn not called. The first attempt's
    // claim did commit, so the key is left in progress (never lost) until the reconciler frees it.
    {
        const Key key(scope, "claim-all-lost");
        proxy.arm(kClaim, options.claim_attempts, Proxy::Mode::after_reply);
        Call c = d.call(store, writer, key, true, short_lease);
        proxy.disarm();
        CAPTURE(c.detail);
        CHECK(c.told == Told::store_unavailable);
        CHECK_FALSE(c.fn_started);
        f.faults += options.claim_attempts;
        const auto row = read_row(db, table.name(), key);
        f.notes.push_back(std::string("claim-all-lost: store_unavailable thrown, key ") +
                          (row ? "left in progress (claim committed; resolved by the reconciler)" : "absent"));
        history.add(std::move(c));
        Call retry = d.call(store, writer, key, true,
                            short_lease);  // the orphan claim answers in_progress; nothing runs
        CHECK((retry.told == Told::in_progress || retry.told == Told::executed));
        CHECK(effects.of(db, key).size() <= 1);
        history.add(std::move(retry));
    }

    const auto t1 = Clock::now();
    // Under load: load_clients clients, each claim/save cut with probability 0.1 (70 % after the
    // reply) — their groups' statements too: under load most of them go in groups.
    {
        LoadOptions lo;
        lo.threads = d.load_clients;
        lo.scope = scope;
        lo.max_keys = 200;
        lo.claim.lease = 1s;
        const int before = proxy.cuts();
        proxy.random(Proxy::Target{{"idem_claim", "idem_claim_batch", "idem_claim_group", "idem_save",
                                    "idem_save_batch", "idem_save_returning_fence"},
                                   {"DO NOTHING RETURNING fence", "SET state = 'completed'"}},
                     0.1, static_cast<unsigned>(::getpid()));
        const auto load = d.load(store, effects, history, lo);
        load->start();
        const auto deadline = Clock::now() + 60s;
        while (!load->finished() && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
        load->stop();
        proxy.disarm();
        CHECK(proxy.cuts() - before > 0);
        f.faults += proxy.cuts() - before;
        ++f.rounds;
    }
    f.notes.push_back("proxy: connections=" + std::to_string(proxy.connections()) + " cuts=" +
                      std::to_string(proxy.cuts()) + " (after the reply: " + std::to_string(proxy.cuts_after_reply()) +
                      ") store retries=" + std::to_string(store.stats().retries));

    const auto t2 = Clock::now();
    check(store, effects, history, CheckOptions{scope, table.name()}, f);
    f.notes.push_back("seconds: single keys " + std::to_string(std::chrono::duration<double>(t1 - t0).count()) +
                      ", load " + std::to_string(std::chrono::duration<double>(t2 - t1).count()) + ", check " +
                      std::to_string(ms_since(t2) / 1000));
    f.print();
    CHECK(f.anomalies.empty());
}

}  // namespace fault
