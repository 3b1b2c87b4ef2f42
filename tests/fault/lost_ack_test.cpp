// Fault scenario 3 — lost acknowledgement: a wire-protocol proxy on loopback (proxy.hpp) between
// idem and PostgreSQL cuts the connection right after the claim INSERT or the save UPDATE was sent
// and committed, before its answer reaches idem. Guarantee: the retry (same fence, fresh
// connection) recognises its own committed write, so the caller is told the one true outcome, a
// later retry replays the same bytes, and the effect runs exactly once. Needs the Unix socket of
// scripts/with-postgres.sh's cluster (IDEM_PG_HOST/IDEM_PG_PORT).
#include "store_env.hpp"
#include "fault.hpp"
#include "proxy.hpp"

using namespace fault;

namespace {

const Proxy::Target kSave{{"idem_save"}, {"SET state = 'completed'"}};
const Proxy::Target kClaim{{"idem_claim"}, {"ON CONFLICT (scope, key) DO NOTHING"}};

std::string proxied_url(const Proxy& proxy) {
    return "host=127.0.0.1 port=" + std::to_string(proxy.port()) +
           " dbname=postgres user=postgres sslmode=disable gssencmode=disable";
}

} // namespace

TEST_CASE("scenario 3: acknowledgements lost on the wire", "[fault][lost_ack]") {
    const std::string url = require_db();
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN("IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): "
             "skipping the proxy scenario");
        return;
    }
    Proxy proxy(env("IDEM_PG_HOST") + "/.s.PGSQL." + env("IDEM_PG_PORT"));
    IdemTable table(url);
    Effects effects(url); // effects go straight to the server, never through the proxy
    const bool prepared = GENERATE(true, false);
    CAPTURE(prepared);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.prepared_statements = prepared;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    options.application_name = "idem_fault_lost_ack";
    idem::PostgresStore store(proxied_url(proxy), idem_test::env_options(options));
    store.ensure_schema(); // through the proxy too

    const std::string scope = idem_test::unique_name(prepared ? "ack_p" : "ack_u");
    History history;
    Figures f;
    f.scenario = std::string("lost_ack(") + (prepared ? "prepared" : "unnamed") + ")";
    Effects::Writer writer(effects);
    PgConn db(url);
    idem::ClaimOptions short_lease;
    short_lease.lease = 1s; // keys left in doubt become stale (reconcilable) quickly

    // One key: the caller's outcome, then a retry, recorded; the effect must have run once.
    // cuts < 0: cut every matching statement until the call returns (at least -cuts of them).
    const auto once = [&](idem::PostgresStore& on, const std::string& name,
                          const Proxy::Target& target, int cuts, Proxy::Mode mode, Told expected) {
        const Key key(scope, name);
        const int before = proxy.cuts();
        const auto stats_before = on.stats();
        proxy.arm(target, cuts < 0 ? 1'000'000 : cuts, mode);
        proxy.note("---- " + name + " first call");
        Call first = run_call(on, writer, key, true, short_lease);
        proxy.disarm();
        const auto retries = on.stats().retries - stats_before.retries;
        const auto round_trips = on.stats().round_trips - stats_before.round_trips;
        CAPTURE(name, first.detail, retries, round_trips, proxy.log());
        if (cuts < 0) {
            CHECK(proxy.cuts() - before >= -cuts);
        } else {
            CHECK(proxy.cuts() - before == cuts);
        }
        CHECK(first.told == expected);
        f.faults += proxy.cuts() - before;
        ++f.rounds;
        proxy.note("---- " + name + " retry");
        Call retry = run_call(on, writer, key, true, short_lease);
        if (expected == Told::executed || expected == Told::response_not_saved) {
            // The effect happened once; the retry replays exactly what the caller was (or could be)
            // told.
            CHECK(retry.told == Told::replayed);
            CHECK(retry.bytes == first.bytes);
            CHECK(effects.of(db, key).size() == 1);
        }
        history.add(std::move(first));
        history.add(std::move(retry));
    };

    const auto t0 = Clock::now();
    for (int i = 0; i < 6; ++i) {
        // The save committed, its answer lost: the retry finds the row completed with its own
        // fence.
        once(store, "save-ack-" + std::to_string(i), kSave, 1, Proxy::Mode::after_reply,
             Told::executed);
        // The claim committed, its answer lost: the retry finds its own fence in progress →
        // claimed.
        once(store, "claim-ack-" + std::to_string(i), kClaim, 1, Proxy::Mode::after_reply,
             Told::executed);
        // The request itself lost: the retry simply does it.
        once(store, "save-req-" + std::to_string(i), kSave, 1, Proxy::Mode::before_send,
             Told::executed);
        once(store, "claim-req-" + std::to_string(i), kClaim, 1, Proxy::Mode::before_send,
             Told::executed);
        // Answers lost on two attempts in a row: the third recognises the first's write.
        once(store, "save-ack2-" + std::to_string(i), kSave, 2, Proxy::Mode::after_reply,
             Told::executed);
        once(store, "claim-ack2-" + std::to_string(i), kClaim, 2, Proxy::Mode::after_reply,
             Told::executed);
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
        idem::PostgresStore short_window(proxied_url(proxy), idem_test::env_options(narrow));
        once(short_window, "save-all-lost", kSave, -narrow.claim_attempts, Proxy::Mode::after_reply,
             Told::response_not_saved);
    }

    // Every claim attempt loses its answer: store_unavailable, fn not called. The first attempt's
    // claim did commit, so the key is left in progress (never lost) until the reconciler frees it.
    {
        const Key key(scope, "claim-all-lost");
        proxy.arm(kClaim, options.claim_attempts, Proxy::Mode::after_reply);
        Call c = run_call(store, writer, key, true, short_lease);
        proxy.disarm();
        CHECK(c.told == Told::store_unavailable);
        CHECK_FALSE(c.fn_started);
        f.faults += options.claim_attempts;
        const auto row = read_row(db, table.name(), key);
        f.notes.push_back(
            std::string("claim-all-lost: store_unavailable thrown, key ") +
            (row ? "left in progress (claim committed; resolved by the reconciler)" : "absent"));
        history.add(std::move(c));
        Call retry = run_call(store, writer, key, true,
                              short_lease); // the orphan claim answers in_progress; nothing runs
        CHECK((retry.told == Told::in_progress || retry.told == Told::executed));
        CHECK(effects.of(db, key).size() <= 1);
        history.add(std::move(retry));
    }

    const auto t1 = Clock::now();
    // Under load: 8 clients, each claim/save cut with probability 0.1 (70 % after the reply).
    {
        LoadOptions lo;
        lo.scope = scope;
        lo.max_keys = 200;
        lo.claim.lease = 1s;
        const int before = proxy.cuts();
        proxy.random(
            Proxy::Target{{"idem_claim", "idem_save"},
                          {"ON CONFLICT (scope, key) DO NOTHING", "SET state = 'completed'"}},
            0.1, static_cast<unsigned>(::getpid()));
        Load load(store, effects, history, lo);
        load.start();
        const auto deadline = Clock::now() + 60s;
        while (!load.finished() && Clock::now() < deadline)
            std::this_thread::sleep_for(50ms);
        load.stop();
        proxy.disarm();
        f.faults += proxy.cuts() - before;
        ++f.rounds;
    }
    f.notes.push_back("proxy: connections=" + std::to_string(proxy.connections()) +
                      " cuts=" + std::to_string(proxy.cuts()) +
                      " (after the reply: " + std::to_string(proxy.cuts_after_reply()) +
                      ") store retries=" + std::to_string(store.stats().retries));

    const auto t2 = Clock::now();
    check(store, effects, history, CheckOptions{scope, table.name()}, f);
    f.notes.push_back("seconds: single keys " +
                      std::to_string(std::chrono::duration<double>(t1 - t0).count()) + ", load " +
                      std::to_string(std::chrono::duration<double>(t2 - t1).count()) + ", check " +
                      std::to_string(ms_since(t2) / 1000));
    f.print();
    CHECK(f.anomalies.empty());
}
