// Retention and purge: a completed key replays until its retention passes, then is claimable again
// (exactly one of many concurrent claimers wins); an in-progress key never expires; purge_expired
// deletes only expired completed keys and never makes a claim wait.
#include <catch2/catch.hpp>

#include <atomic>
#include <latch>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "idem/observer.hpp"
#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

TEMPLATE_TEST_CASE("retention: expiry, re-claim by one of 32, in-progress never expires, purge",
                   "[lifecycle][retention]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make(knobs(40));
    const auto scope = fresh_scope("retention");
    const auto fp = idem::fingerprint("POST /orders"s, 4200);
    // Retention a minute, then the test moves time past it (backend.advance): no real wait, and a
    // busy machine cannot make a key expire early.
    const idem::ClaimOptions one_minute = Opts().retain(60s);
    const idem::Key a(scope, "a"), b(scope, "b"), c(scope, "c"), d(scope, "d"), e(scope, "e");

    // a: completed with retention 1 min; replayed before expiry.
    std::atomic<int> runs_a{0};
    const auto r1 = idem::execute_once(
        store, a, fp,
        [&] {
            ++runs_a;
            return Response{201, "a-first"};
        },
        one_minute);
    REQUIRE(r1.outcome() == Outcome::executed);
    const auto r2 = idem::execute_once(
        store, a, fp,
        [&] {
            ++runs_a;
            return Response{201, "a-second"};
        },
        one_minute);
    CHECK(r2.outcome() == Outcome::replayed);
    CHECK(r2.response().body == "a-first");
    CHECK(runs_a == 1);
    CHECK_FALSE(store.read(a)->expired);

    // b: completed with retention 1 min, re-claimed by 32 threads after expiry.
    REQUIRE(idem::execute_once(
                store, b, fp,
                [] {
                    return Response{200, "b-old"};
                },
                one_minute)
                .outcome() == Outcome::executed);
    // c: in progress (lease 1 h) with retention 1 min: must never expire.
    const auto claim_c = store.claim(c, fp, Opts().lease_for(1h).retain(60s));
    REQUIRE(claim_c.status == idem::ClaimStatus::claimed);
    // d: completed, retention 1 min, left alone: purged. e: completed, default retention: kept.
    REQUIRE(idem::execute_once(
                store, d, fp,
                [] {
                    return Response{200, "d"};
                },
                one_minute)
                .outcome() == Outcome::executed);
    REQUIRE(idem::execute_once(store, e, fp, [] { return Response{200, "e"}; }).outcome() == Outcome::executed);
    // 50 s later: nothing has expired yet.
    backend.advance(50s);
    CHECK_FALSE(store.read(a)->expired);
    CHECK(idem::execute_once(store, a, fp, [&] {
              ++runs_a;
              return Response{201, "a-early"};
          }).outcome() == Outcome::replayed);
    CHECK(store.purge_expired(1000) == 0);
    CHECK(runs_a == 1);

    backend.advance(11s);  // 61 s in all: a, b and d have expired

    // a after expiry: claimable again, the effect runs a second time.
    auto expired_a = store.read(a);
    REQUIRE(expired_a);
    CHECK(expired_a->state == idem::RecordState::completed);
    CHECK(expired_a->expired);
    const auto r3 = idem::execute_once(store, a, fp, [&] {
        ++runs_a;
        return Response{201, "a-third"};
    });
    CHECK(r3.outcome() == Outcome::executed);
    CHECK(runs_a == 2);
    const auto r4 = idem::execute_once(store, a, fp, [&] {
        ++runs_a;
        return Response{201, "a-fourth"};
    });
    CHECK(r4.outcome() == Outcome::replayed);
    CHECK(r4.response().body == "a-third");
    CHECK(runs_a == 2);

    // b after expiry: 32 threads at once; exactly one wins, nobody replays the expired bytes.
    {
        constexpr int kThreads = 32;
        std::atomic<int> runs_b{0};
        std::latch start(kThreads);
        std::mutex mutex;
        std::vector<Outcome> outcomes;
        std::vector<std::string> replayed_bodies;
        std::vector<std::string> errors;
        std::vector<std::thread> threads;
        for (int t = 0; t < kThreads; ++t) {
            threads.emplace_back([&, t] {
                try {
                    start.arrive_and_wait();
                    const auto r = idem::execute_once(store, b, fp, [&] {
                        ++runs_b;
                        std::this_thread::sleep_for(20ms);
                        return Response{201, "b-new-" + std::to_string(t)};
                    });
                    std::lock_guard lock(mutex);
                    outcomes.push_back(r.outcome());
                    if (r.outcome() == Outcome::replayed) replayed_bodies.push_back(r.response().body);
                } catch (const std::exception& ex) {
                    std::lock_guard lock(mutex);
                    errors.emplace_back(ex.what());
                }
            });
        }
        for (auto& th : threads) th.join();
        CHECK(errors.empty());
        for (const auto& err : errors) UNSCOPED_INFO(err);
        CHECK(runs_b == 1);
        CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::executed) == 1);
        CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::mismatch) == 0);
        CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::replayed) +
                  std::count(outcomes.begin(), outcomes.end(), Outcome::in_progress) ==
              kThreads - 1);
        const auto now_b = store.read(b);
        REQUIRE(now_b);
        REQUIRE(now_b->state == idem::RecordState::completed);
        const std::string winner = idem::codec<Response>::decode(*now_b->result).body;
        CHECK(winner.starts_with("b-new-"));
        for (const auto& body : replayed_bodies) CHECK(body == winner);  // never "b-old"
    }

    // c: retention passed while in progress: still in progress, owned by its claim.
    std::atomic<int> runs_c{0};
    const auto rc = idem::execute_once(store, c, fp, [&] {
        ++runs_c;
        return Response{200, "c"};
    });
    CHECK(rc.outcome() == Outcome::in_progress);
    CHECK(runs_c == 0);
    auto rec_c = store.read(c);
    REQUIRE(rec_c);
    CHECK(rec_c->state == idem::RecordState::in_progress);
    CHECK_FALSE(rec_c->expired);
    CHECK(rec_c->fence == claim_c.fence);

    // purge: only d (completed, expired) goes; c (in progress, past expires_at), a, b, e stay.
    CHECK(store.purge_expired(1000) == 1);
    CHECK_FALSE(store.read(d));
    CHECK(store.read(c));
    CHECK(store.read(a));
    CHECK(store.read(b));
    CHECK(store.read(e));
    CHECK_NOTHROW(store.save(c, claim_c.fence, "c-late"));  // the claim still owns it
    // Completed now, and its retention (from the claim) has passed: the next purge takes it.
    CHECK(store.read(c)->expired);
    CHECK(store.purge_expired(1000) == 1);
    CHECK_FALSE(store.read(c));
    CHECK(store.purge_expired(1000) == 0);
}

namespace {

/// Samples, for the sessions with application_name `app` (the claimers), the heavyweight-lock waits
/// that would mean the purge makes a claim wait: a wait on a row lock (wait event transactionid or
/// tuple: the rows a claim writes are locked by someone) and any lock wait whose blocker is a session
/// named `purger_app`. Other lock waits are recorded but not counted: the claimers' own
/// relation-extension locks (Lock:extend, taken whenever concurrent INSERTs grow the table) say
/// nothing about the purge.
struct LockSampler {
    long long samples = 0;
    long long row_lock_waits = 0;   // claim sessions waiting on a row lock
    long long waits_on_purger = 0;  // claim sessions whose lock wait is blocked by a purger session
    long long sessions_seen = 0;    // samples in which the claim sessions were visible at all
    std::vector<std::string> seen_waits;

    void sample(PgConn& watch, const std::string& app, const std::string& purger_app) {
        const auto act = watch.exec(
            "SELECT count(*), "
            "count(*) FILTER (WHERE a.wait_event_type = 'Lock' AND a.wait_event IN ('transactionid', 'tuple')), "
            "count(*) FILTER (WHERE a.wait_event_type = 'Lock' AND EXISTS (SELECT 1 FROM pg_stat_activity b "
            "WHERE b.pid = ANY (pg_blocking_pids(a.pid)) AND b.application_name = $2)), "
            "string_agg(DISTINCT a.wait_event_type || ':' || a.wait_event, ',') "
            "FROM pg_stat_activity a WHERE a.application_name = $1",
            {app, purger_app});
        ++samples;
        if (act.integer(0, 0) > 0) ++sessions_seen;
        row_lock_waits += act.integer(0, 1);
        waits_on_purger += act.integer(0, 2);
        if (!act.is_null(0, 3)) seen_waits.push_back(act.text(0, 3));
    }
};

}  // namespace

TEST_CASE("purge_expired: 100,000 expired keys while 4 threads claim; no claim waits on it", "[lifecycle][purge]") {
    IDEM_NOT_ON_CITUS("it samples lock waits in the coordinator's pg_stat_activity and pg_locks");
    PostgresBackend backend;
    const std::string claim_app = idem_test::unique_name("idem_lc_claimers");
    const std::string purger_app = idem_test::unique_name("idem_lc_purger");
    auto& purger = backend.make_pg(knobs(2, purger_app));
    auto counts = std::make_shared<idem::CountingObserver>();
    purger.set_observer(counts);
    auto& claimer = backend.make_pg(knobs(4, claim_app));
    const std::string& T = backend.table();
    const auto scope = fresh_scope("purge");
    PgConn admin(backend.conninfo());

    constexpr long long kExpired = 100000;
    // Expired completed keys, written behind idem's back (fingerprint 32 bytes, algorithm 1).
    admin.exec("INSERT INTO " + T +
                   " (scope, key, state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
                   "lease_until, completed_at, expires_at) "
                   "SELECT $1, 'expired-' || g, 'completed', decode(repeat('ab', 32), 'hex'), 1, g, 1, "
                   "'\\x0102'::bytea, now() - interval '2 days', now() - interval '2 days', "
                   "now() - interval '2 days', now() - interval '1 hour' - g * interval '1 millisecond' "
                   "FROM generate_series(1, $2::int) g",
               {scope, std::to_string(kExpired)});
    // Survivors: in progress with expires_at in the past (never expires), and completed unexpired.
    admin.exec("INSERT INTO " + T +
                   " (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at) "
                   "SELECT $1, 'keep-ip-' || g, 'in_progress', decode(repeat('cd', 32), 'hex'), 1, g, "
                   "now() - interval '1 hour', now() - interval '1 hour' FROM generate_series(1, 10) g",
               {scope});
    admin.exec("INSERT INTO " + T +
                   " (scope, key, state, fingerprint, fingerprint_alg, fence, result, lease_until, completed_at, "
                   "expires_at) SELECT $1, 'keep-done-' || g, 'completed', decode(repeat('ef', 32), 'hex'), 1, g, "
                   "'\\x03'::bytea, now(), now(), now() + interval '1 day' FROM generate_series(1, 10) g",
               {scope});
    admin.exec("ANALYZE " + T);
    REQUIRE(admin.scalar("SELECT count(*) FROM " + T) == kExpired + 20);

    // Warm the claimers' connections so connection set-up is not measured.
    const auto fp = idem::fingerprint("purge-test"s);
    for (int i = 0; i < 4; ++i) {
        (void)idem::execute_once(claimer, idem::Key(scope, "warm-" + std::to_string(i)), fp, [] {
            return Response{200, "w"};
        });
    }

    // Calibration: the sampler does see a claim-store session that waits on a row lock held by a
    // session named like the purger.
    {
        PgConn blocker(backend.conninfo());
        blocker.exec("SELECT set_config('application_name', $1, false)", {purger_app});
        blocker.exec("BEGIN");
        blocker.exec("SELECT 1 FROM " + T + " WHERE scope = $1 AND key = 'keep-ip-1' FOR UPDATE", {scope});
        std::atomic<bool> blocked_returned{false};
        std::thread blocked([&] {
            try {
                claimer.extend_lease(idem::Key(scope, "keep-ip-1"), 1, 1h);  // waits on the row lock
            } catch (const idem::error&) {                                   // lock_timeout: fine either way
            }
            blocked_returned = true;
        });
        // Sampled until the wait is seen, for as long as the call waits (it gives up after its
        // lock_timeouts; the bound only keeps a hang from lasting).
        LockSampler calibration;
        PgConn watch(backend.conninfo());
        const auto until = SteadyClock::now() + 30s;
        while (calibration.waits_on_purger == 0 && !blocked_returned && SteadyClock::now() < until) {
            calibration.sample(watch, claim_app, purger_app);
            if (calibration.waits_on_purger == 0) std::this_thread::sleep_for(5ms);
        }
        blocker.exec("ROLLBACK");
        blocked.join();
        REQUIRE(calibration.waits_on_purger > 0);
        CHECK(calibration.row_lock_waits > 0);
    }

    std::atomic<bool> purging{false};
    std::atomic<bool> done{false};
    std::mutex mutex;
    std::vector<double> claim_ms;  // execute_once latencies while the purge ran
    std::vector<std::string> errors;
    std::latch started(6);  // 4 claimers, the sampler, the purger
    std::vector<std::thread> threads;
    std::atomic<int> fresh_executed{0};
    std::atomic<int> claimers_running{0};  // claimers that have finished a call
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            started.arrive_and_wait();
            std::vector<double> mine;
            try {
                for (int i = 0; !done; ++i) {
                    const idem::Key key(scope, "fresh-" + std::to_string(t) + "-" + std::to_string(i));
                    const bool during = purging;
                    const auto t0 = SteadyClock::now();
                    const auto r = idem::execute_once(claimer, key, fp, [] { return Response{201, "fresh"}; });
                    const auto t1 = SteadyClock::now();
                    if (r.outcome() == Outcome::executed) ++fresh_executed;
                    if (during && purging) mine.push_back(ms(t1 - t0));
                    if (i == 0) ++claimers_running;
                }
            } catch (const std::exception& ex) {
                std::lock_guard lock(mutex);
                errors.emplace_back(ex.what());
            }
            std::lock_guard lock(mutex);
            claim_ms.insert(claim_ms.end(), mine.begin(), mine.end());
        });
    }
    LockSampler sampler;
    std::thread sampling([&] {
        PgConn watch(backend.conninfo());
        started.arrive_and_wait();
        while (!done) {
            if (purging) sampler.sample(watch, claim_app, purger_app);
            std::this_thread::sleep_for(2ms);
        }
    });

    std::size_t purged = 0;
    std::thread purge_thread([&] {
        started.arrive_and_wait();
        // The claimers are running: each has finished a call (bounded; if they never do, the
        // checks on the claims made during the purge fail).
        const auto until = SteadyClock::now() + 30s;
        while (claimers_running < 4 && SteadyClock::now() < until) std::this_thread::sleep_for(1ms);
        purging = true;
        try {
            purged = purger.purge_expired(1000);
        } catch (const std::exception& ex) {
            std::lock_guard lock(mutex);
            errors.emplace_back(std::string("purge: ") + ex.what());
        }
        purging = false;
        std::this_thread::sleep_for(50ms);
        done = true;
    });
    const auto t_start = SteadyClock::now();
    purge_thread.join();
    const auto purge_took = SteadyClock::now() - t_start;
    for (auto& th : threads) th.join();
    sampling.join();

    for (const auto& err : errors) UNSCOPED_INFO(err);
    REQUIRE(errors.empty());
    INFO("purge took " << ms(purge_took) << " ms; claims during purge: " << claim_ms.size() << "; p50 "
                       << percentile(claim_ms, 0.5) << " ms, p99 " << percentile(claim_ms, 0.99) << " ms, max "
                       << percentile(claim_ms, 1.0) << " ms; lock samples " << sampler.samples
                       << " (claim sessions visible in " << sampler.sessions_seen << ")");
    CHECK(purged == static_cast<std::size_t>(kExpired));
    CHECK(admin.scalar("SELECT count(*) FROM " + T + " WHERE key LIKE 'expired-%'") == 0);
    CHECK(admin.scalar("SELECT count(*) FROM " + T + " WHERE key LIKE 'keep-ip-%' AND state = 'in_progress'") == 10);
    CHECK(admin.scalar("SELECT count(*) FROM " + T + " WHERE key LIKE 'keep-done-%' AND state = 'completed'") == 10);
    CHECK(admin.scalar("SELECT count(*) FROM " + T + " WHERE key LIKE 'fresh-%' AND state = 'completed'") ==
          fresh_executed.load());
    CHECK(counts->snapshot().count(idem::Event::purged) == static_cast<std::uint64_t>(kExpired));

    // The claims really overlapped the purge, and none of them waited on a lock it held, nor on any
    // row lock.
    CHECK(claim_ms.size() >= 20);
    CHECK(sampler.samples >= 5);
    CHECK(sampler.sessions_seen >= 1);
    for (const auto& w : sampler.seen_waits) {
        if (w.find("Lock:") == 0 || w.find(",Lock:") != std::string::npos) UNSCOPED_INFO("wait: " << w);
    }
    CHECK(sampler.waits_on_purger == 0);
    CHECK(sampler.row_lock_waits == 0);
    // Claims blocked behind the purge would take about as long as the purge (seconds); unblocked
    // ones take milliseconds. The median, with room for a busy machine.
    CHECK(percentile(claim_ms, 0.5) < 250.0);

    // Nothing left to purge; the observer is not told about empty purges.
    CHECK(purger.purge_expired(1000) == 0);
    CHECK(counts->snapshot().count(idem::Event::purged) == static_cast<std::uint64_t>(kExpired));
}
