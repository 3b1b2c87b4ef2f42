// PrometheusObserver: the exact text for known events (bucket cumulation, +Inf, _sum / _count,
// escaping), the pool and store figures, option checks, exact totals under many emitting threads,
// and through a PostgresStore: calls counted as made, PoolStats of a pool that made a caller wait.
#include <catch2/catch.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#include "test_env.hpp"

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Event;
using idem::EventInfo;
using idem::PrometheusObserver;
using idem::PrometheusOptions;

namespace {

void emit(PrometheusObserver& m, Event e, std::chrono::nanoseconds d = {}, std::uint64_t count = 1,
          const idem::Key* key = nullptr) {
    m.on_event(EventInfo{e, key, d, count, {}});
}

/// The value of the sample line that starts with `series` ("name{labels}"), as written.
std::string sample(const std::string& text, const std::string& series) {
    const std::string head = "\n" + series + " ";
    const auto at = text.find(head);
    if (at == std::string::npos) return "<no " + series + ">";
    const auto from = at + head.size();
    return text.substr(from, text.find('\n', from) - from);
}

using idem_test::require_db;

}  // namespace

TEST_CASE("PrometheusObserver renders known events exactly: cumulative buckets, +Inf, sums, escaped labels",
          "[metrics]") {
    PrometheusOptions options;
    options.buckets = {0.001, 0.01};
    options.labels = {{"store", "a\"b\\c\nd"}};
    PrometheusObserver m(options);
    const idem::Key key("scope", "k");
    emit(m, Event::executed, 500us);
    emit(m, Event::executed, 1ms);  // exactly a bound: within it (le is "less or equal")
    emit(m, Event::executed, 5ms);
    emit(m, Event::executed, 50ms);  // beyond every bound: +Inf only
    emit(m, Event::replayed, 2ms);
    emit(m, Event::in_progress);  // not timed (execute_batch): counted, not observed
    emit(m, Event::mismatch, 100us);
    emit(m, Event::released);
    emit(m, Event::unknown, 20ms);
    emit(m, Event::taken_over, {}, 1, &key);
    emit(m, Event::taken_over, {}, 1, &key);
    emit(m, Event::reconciled, 3ms, 1, &key);
    emit(m, Event::reconcile_failed, {}, 1, &key);  // a key
    emit(m, Event::reconcile_failed);               // whole sweeps
    emit(m, Event::reconcile_failed);
    emit(m, Event::purged, {}, 7);  // rows
    emit(m, Event::purged, {}, 5);
    m.on_event(EventInfo{static_cast<Event>(idem::event_count), nullptr, 1ms, 1, {}});  // a future event: ignored

    const std::string expected =
        R"EXP(# HELP idem_calls_total Calls of execute_once, execute_batch and idem::http by outcome (released: not_performed; unknown: the effect's outcome is not known, the key waits for a reconciler).
# TYPE idem_calls_total counter
idem_calls_total{store="a\"b\\c\nd",outcome="executed"} 4
idem_calls_total{store="a\"b\\c\nd",outcome="replayed"} 1
idem_calls_total{store="a\"b\\c\nd",outcome="in_progress"} 1
idem_calls_total{store="a\"b\\c\nd",outcome="mismatch"} 1
idem_calls_total{store="a\"b\\c\nd",outcome="released"} 1
idem_calls_total{store="a\"b\\c\nd",outcome="unknown"} 1
# HELP idem_call_duration_seconds Duration of the timed calls by outcome, from the claim to the answer.
# TYPE idem_call_duration_seconds histogram
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="executed",le="0.001"} 2
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="executed",le="0.01"} 3
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="executed",le="+Inf"} 4
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="executed"} 0.0565
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="executed"} 4
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="replayed",le="0.001"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="replayed",le="0.01"} 1
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="replayed",le="+Inf"} 1
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="replayed"} 0.002
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="replayed"} 1
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="in_progress",le="0.001"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="in_progress",le="0.01"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="in_progress",le="+Inf"} 0
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="in_progress"} 0
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="in_progress"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="mismatch",le="0.001"} 1
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="mismatch",le="0.01"} 1
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="mismatch",le="+Inf"} 1
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="mismatch"} 0.0001
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="mismatch"} 1
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="released",le="0.001"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="released",le="0.01"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="released",le="+Inf"} 0
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="released"} 0
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="released"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="unknown",le="0.001"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="unknown",le="0.01"} 0
idem_call_duration_seconds_bucket{store="a\"b\\c\nd",outcome="unknown",le="+Inf"} 1
idem_call_duration_seconds_sum{store="a\"b\\c\nd",outcome="unknown"} 0.02
idem_call_duration_seconds_count{store="a\"b\\c\nd",outcome="unknown"} 1
# HELP idem_takeovers_total Stale in-progress keys taken over (resume mode or a reconciler).
# TYPE idem_takeovers_total counter
idem_takeovers_total{store="a\"b\\c\nd"} 2
# HELP idem_reconciled_total Keys a reconciler resolved (saved or released).
# TYPE idem_reconciled_total counter
idem_reconciled_total{store="a\"b\\c\nd"} 1
# HELP idem_reconcile_duration_seconds Time from a reconciler's take-over of a key to its resolution.
# TYPE idem_reconcile_duration_seconds histogram
idem_reconcile_duration_seconds_bucket{store="a\"b\\c\nd",le="0.001"} 0
idem_reconcile_duration_seconds_bucket{store="a\"b\\c\nd",le="0.01"} 1
idem_reconcile_duration_seconds_bucket{store="a\"b\\c\nd",le="+Inf"} 1
idem_reconcile_duration_seconds_sum{store="a\"b\\c\nd"} 0.003
idem_reconcile_duration_seconds_count{store="a\"b\\c\nd"} 1
# HELP idem_reconcile_failures_total Reconciler failures: kind="key", a key that could not be resolved (it stays in progress); kind="sweep", a whole sweep that failed.
# TYPE idem_reconcile_failures_total counter
idem_reconcile_failures_total{store="a\"b\\c\nd",kind="key"} 1
idem_reconcile_failures_total{store="a\"b\\c\nd",kind="sweep"} 2
# HELP idem_purged_rows_total Expired records deleted by purge_expired.
# TYPE idem_purged_rows_total counter
idem_purged_rows_total{store="a\"b\\c\nd"} 12
)EXP";
    CHECK(m.render() == expected);
    CHECK(PrometheusObserver::content_type == "text/plain; version=0.0.4; charset=utf-8");
}

TEST_CASE("PrometheusObserver renders the pool and store figures its sources give", "[metrics]") {
    PrometheusObserver m;  // default buckets, no constant labels
    CHECK(m.render().find("idem_pool_") == std::string::npos);
    CHECK(m.render().find("idem_store_") == std::string::npos);
    idem::PoolStats p;
    p.size = 4;
    p.open = 3;
    p.idle = 1;
    p.waiters = 2;
    p.acquires = 100;
    p.waited = 10;
    p.timeouts = 1;
    p.wait_time = 1500ms;
    p.waits_within = {1, 2, 3, 3, 4, 5, 5, 6, 6, 7, 8, 8, 9, 9};  // one waited longer than 10 s
    m.set_pool_source([&p] { return p; });
    idem::StoreStats st;
    st.round_trips = 11;
    st.claims = 5;
    st.retries = 2;
    st.connections_opened = 3;
    st.connections_discarded = 1;
    m.set_store_source([&st] { return st; });
    const std::string text = m.render();
    const std::string store =
        R"EXP(# HELP idem_store_round_trips_total Waits for the database's answer (a pipeline counts once).
# TYPE idem_store_round_trips_total counter
idem_store_round_trips_total 11
# HELP idem_store_claims_total claim() calls.
# TYPE idem_store_claims_total counter
idem_store_claims_total 5
# HELP idem_store_retries_total Statements sent again (broken connection, 40001, 40P01, 55P03).
# TYPE idem_store_retries_total counter
idem_store_retries_total 2
# HELP idem_store_connections_opened_total Database connections opened.
# TYPE idem_store_connections_opened_total counter
idem_store_connections_opened_total 3
# HELP idem_store_connections_discarded_total Database connections closed after an error or a failed health check.
# TYPE idem_store_connections_discarded_total counter
idem_store_connections_discarded_total 1
)EXP";
    const std::string pool = R"EXP(# HELP idem_pool_connections_max The most connections the pool may open (pool_size).
# TYPE idem_pool_connections_max gauge
idem_pool_connections_max 4
# HELP idem_pool_connections_open Connections open now: idle, leased or being opened.
# TYPE idem_pool_connections_open gauge
idem_pool_connections_open 3
# HELP idem_pool_connections_idle Open connections no caller holds now.
# TYPE idem_pool_connections_idle gauge
idem_pool_connections_idle 1
# HELP idem_pool_waiters Callers waiting now for a connection to come back.
# TYPE idem_pool_waiters gauge
idem_pool_waiters 2
# HELP idem_pool_acquires_total Requests for a pooled connection.
# TYPE idem_pool_acquires_total counter
idem_pool_acquires_total 100
# HELP idem_pool_acquire_waits_total Requests that found the pool exhausted and waited.
# TYPE idem_pool_acquire_waits_total counter
idem_pool_acquire_waits_total 10
# HELP idem_pool_acquire_timeouts_total Requests that waited pool_wait in vain (pool_timeout).
# TYPE idem_pool_acquire_timeouts_total counter
idem_pool_acquire_timeouts_total 1
# HELP idem_pool_acquire_wait_seconds Time spent waiting for a pooled connection by the requests that found none free.
# TYPE idem_pool_acquire_wait_seconds histogram
idem_pool_acquire_wait_seconds_bucket{le="0.0005"} 1
idem_pool_acquire_wait_seconds_bucket{le="0.001"} 2
idem_pool_acquire_wait_seconds_bucket{le="0.0025"} 3
idem_pool_acquire_wait_seconds_bucket{le="0.005"} 3
idem_pool_acquire_wait_seconds_bucket{le="0.01"} 4
idem_pool_acquire_wait_seconds_bucket{le="0.025"} 5
idem_pool_acquire_wait_seconds_bucket{le="0.05"} 5
idem_pool_acquire_wait_seconds_bucket{le="0.1"} 6
idem_pool_acquire_wait_seconds_bucket{le="0.25"} 6
idem_pool_acquire_wait_seconds_bucket{le="0.5"} 7
idem_pool_acquire_wait_seconds_bucket{le="1"} 8
idem_pool_acquire_wait_seconds_bucket{le="2.5"} 8
idem_pool_acquire_wait_seconds_bucket{le="5"} 9
idem_pool_acquire_wait_seconds_bucket{le="10"} 9
idem_pool_acquire_wait_seconds_bucket{le="+Inf"} 10
idem_pool_acquire_wait_seconds_sum 1.5
idem_pool_acquire_wait_seconds_count 10
)EXP";
    // The store's figures, then the pool's, after the observer's own families.
    const auto purged = text.find("idem_purged_rows_total 0\n");
    REQUIRE(purged != std::string::npos);
    CHECK(text.substr(purged + std::string("idem_purged_rows_total 0\n").size()) == store + pool);
    // Default buckets: 0.0005 … 10, written as Prometheus' clients write them.
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="executed",le="0.0005"})") == "0");
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="executed",le="10"})") == "0");
    m.set_pool_source({});
    m.set_store_source({});
    CHECK(m.render().find("idem_pool_") == std::string::npos);
    CHECK(m.render().find("idem_store_") == std::string::npos);
}

TEST_CASE("PrometheusObserver refuses invalid buckets and labels with config_error", "[metrics]") {
    const auto with_buckets = [](std::vector<double> b) {
        PrometheusOptions o;
        o.buckets = std::move(b);
        return o;
    };
    const auto with_label = [](std::string name) {
        PrometheusOptions o;
        o.labels = {{std::move(name), "v"}};
        return o;
    };
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({0.1, 0.1})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({0.2, 0.1})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({0.0})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({-1.0})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({std::numeric_limits<double>::infinity()})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({std::numeric_limits<double>::quiet_NaN()})), idem::config_error);
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({1e-10})), idem::config_error);         // 0 ns
    CHECK_THROWS_AS(PrometheusObserver(with_buckets({1e-9, 1.2e-9})), idem::config_error);  // both 1 ns
    CHECK_THROWS_AS(PrometheusObserver(with_buckets(std::vector<double>(65, 1.0))), idem::config_error);
    for (const char* bad : {"", "le", "outcome", "kind", "__name", "1x", "a-b", "a b"}) {
        CHECK_THROWS_AS(PrometheusObserver(with_label(bad)), idem::config_error);
    }
    PrometheusOptions twice;
    twice.labels = {{"a", "1"}, {"a", "2"}};
    CHECK_THROWS_AS(PrometheusObserver(twice), idem::config_error);
    PrometheusOptions fine;
    fine.buckets = {1e-9, 0.5, 1e9};
    fine.labels = {{"_a1", ""}, {"Zone", "eu"}};
    PrometheusObserver m(fine);
    emit(m, Event::executed, 1ns);
    const std::string text = m.render();
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{_a1="",Zone="eu",outcome="executed",le="0.000000001"})") ==
          "1");
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{_a1="",Zone="eu",outcome="executed",le="1000000000"})") ==
          "1");
    CHECK(sample(text, R"(idem_call_duration_seconds_sum{_a1="",Zone="eu",outcome="executed"})") == "0.000000001");
}

TEST_CASE("PrometheusObserver totals are exact with many threads emitting while others render", "[metrics]") {
    PrometheusOptions options;
    options.buckets = {0.001, 0.01};
    PrometheusObserver m(options);
    constexpr int kThreads = 8;
    constexpr int kPerThread = 20'000;
    std::atomic<bool> done{false};
    std::atomic<int> renders{0};
    std::thread scraper([&] {
        while (!done.load()) {
            const std::string text = m.render();
            CHECK(text.ends_with("\n"));
            renders.fetch_add(1);
        }
    });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&m] {
            const idem::Key key("scope", "k");
            for (int i = 0; i < kPerThread; ++i) {
                const std::chrono::nanoseconds d = i % 3 == 0 ? 100us : i % 3 == 1 ? 5ms : 50ms;
                emit(m, Event::executed, d, 1, &key);
                emit(m, Event::replayed, {}, 1, &key);  // counted only
                emit(m, Event::purged, {}, 3);
                if (i % 100 == 0) emit(m, Event::reconcile_failed, {}, 1, &key);
            }
        });
    }
    for (auto& t : threads) t.join();
    done = true;
    scraper.join();
    CHECK(renders.load() >= 1);
    const std::string text = m.render();
    constexpr std::uint64_t n = std::uint64_t{kThreads} * kPerThread;
    // i % 3: 0 → 6667 of 20000, 1 → 6667, 2 → 6666 per thread.
    constexpr std::uint64_t fast = kThreads * 6667ull, middle = kThreads * 6667ull, slow = kThreads * 6666ull;
    CHECK(sample(text, R"(idem_calls_total{outcome="executed"})") == std::to_string(n));
    CHECK(sample(text, R"(idem_calls_total{outcome="replayed"})") == std::to_string(n));
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="executed",le="0.001"})") == std::to_string(fast));
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="executed",le="0.01"})") ==
          std::to_string(fast + middle));
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="executed",le="+Inf"})") ==
          std::to_string(fast + middle + slow));
    CHECK(sample(text, R"(idem_call_duration_seconds_count{outcome="executed"})") == std::to_string(n));
    // 100 µs, 5 ms and 50 ms in whole nanoseconds, summed exactly, then written in seconds.
    const std::uint64_t nanos = fast * 100'000 + middle * 5'000'000 + slow * 50'000'000;
    std::string expected_sum;
    {
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, static_cast<double>(nanos) / 1e9, std::chars_format::fixed);
        expected_sum.assign(buf, r.ptr);
    }
    CHECK(sample(text, R"(idem_call_duration_seconds_sum{outcome="executed"})") == expected_sum);
    CHECK(sample(text, R"(idem_call_duration_seconds_count{outcome="replayed"})") == "0");
    CHECK(sample(text, "idem_purged_rows_total") == std::to_string(3 * n));
    CHECK(sample(text, R"(idem_reconcile_failures_total{kind="key"})") == std::to_string(kThreads * 200));
    CHECK(sample(text, R"(idem_reconcile_failures_total{kind="sweep"})") == "0");
}

TEST_CASE("PrometheusObserver on a PostgresStore counts the calls made; pool_stats sees a caller wait",
          "[metrics][postgres]") {
    const std::string url = require_db();
    idem::PostgresOptions o = idem_test::env_options({});
    o.table = idem_test::unique_name("idem_metrics");
    o.pool_size = 1;
    o.pool_wait = 30s;  // the waiting call below must not time out: it waits for the test's release
    idem::PostgresStore store(url, o);
    store.ensure_schema();
    auto metrics = std::make_shared<PrometheusObserver>();
    metrics->set_pool_source([&store] { return store.pool_stats(); });
    metrics->set_store_source([&store] { return store.stats(); });
    store.set_observer(metrics);
    const auto fp = idem::fingerprint("POST /metrics"s);
    const auto ok = [] { return idem::Response{201, "ok"}; };

    const idem::PoolStats before = store.pool_stats();
    CHECK(before.size == 1);
    CHECK(before.open == 0);  // (ensure_schema used a connection of its own)
    CHECK(before.idle == 0);
    CHECK(before.acquires == 0);
    CHECK(before.waiters == 0);
    CHECK(before.waited == 0);
    // A new key: claim and save, one connection each; a replay: the claim.
    CHECK(idem::execute_once(store, idem::Key("metrics", "n1"), fp, ok).outcome() == idem::Outcome::executed);
    CHECK(store.pool_stats().acquires == before.acquires + 2);
    CHECK(idem::execute_once(store, idem::Key("metrics", "n1"), fp, ok).outcome() == idem::Outcome::replayed);
    CHECK(store.pool_stats().acquires == before.acquires + 3);
    CHECK(idem::execute_once(store, idem::Key("metrics", "n2"), fp, ok).outcome() == idem::Outcome::executed);
    CHECK(idem::execute_once(store, idem::Key("metrics", "n2"), fp, ok).outcome() == idem::Outcome::replayed);
    CHECK(idem::execute_once(store, idem::Key("metrics", "n1"), fp, ok).outcome() == idem::Outcome::replayed);
    CHECK(idem::execute_once(store, idem::Key("metrics", "n1"), idem::fingerprint("other"s), ok).outcome() ==
          idem::Outcome::mismatch);
    CHECK_THROWS_AS(idem::execute_once(store, idem::Key("metrics", "u1"), fp,
                                       []() -> idem::Response { throw std::runtime_error("timeout"); }),
                    std::runtime_error);
    CHECK(idem::execute_once(store, idem::Key("metrics", "u1"), fp, ok).outcome() == idem::Outcome::in_progress);

    // The pool's only connection held by an in-transaction effect; another thread's call waits.
    std::atomic<bool> inside{false}, release{false};
    std::thread holder([&] {
        const auto r =
            idem::execute_once_in_transaction(store, idem::Key("metrics", "tx"), fp, [&](idem::Transaction&) {
                inside = true;
                while (!release.load()) std::this_thread::sleep_for(1ms);
                return idem::Response{201, "tx"};
            });
        CHECK(r.outcome() == idem::Outcome::executed);
    });
    while (!inside.load()) std::this_thread::sleep_for(1ms);
    std::thread waiter([&] {
        CHECK(idem::execute_once(store, idem::Key("metrics", "n3"), fp, ok).outcome() == idem::Outcome::executed);
    });
    // Until the waiter is blocked in the pool (bounded: a hang fails here, not in ctest's timeout).
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (store.pool_stats().waiters == 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(1ms);
    }
    const idem::PoolStats during = store.pool_stats();
    CHECK(during.waiters == 1);
    CHECK(during.open == 1);
    CHECK(during.idle == 0);
    CHECK(sample(metrics->render(), "idem_pool_waiters") == "1");
    release = true;
    holder.join();
    waiter.join();

    const idem::PoolStats after = store.pool_stats();
    CHECK(after.waiters == 0);
    CHECK(after.open == 1);
    CHECK(after.idle == 1);
    CHECK(after.waited == 1);
    CHECK(after.timeouts == 0);
    CHECK(after.wait_time.count() > 0);
    CHECK(after.waits_within.back() <= 1);
    const std::string text = metrics->render();
    CHECK(sample(text, R"(idem_calls_total{outcome="executed"})") == "3");  // n1, n2, n3 (tx is in-transaction)
    CHECK(sample(text, R"(idem_calls_total{outcome="replayed"})") == "3");
    CHECK(sample(text, R"(idem_calls_total{outcome="mismatch"})") == "1");
    CHECK(sample(text, R"(idem_calls_total{outcome="unknown"})") == "1");
    CHECK(sample(text, R"(idem_calls_total{outcome="in_progress"})") == "1");
    CHECK(sample(text, R"(idem_calls_total{outcome="released"})") == "0");
    CHECK(sample(text, R"(idem_call_duration_seconds_count{outcome="executed"})") == "3");
    CHECK(sample(text, R"(idem_call_duration_seconds_count{outcome="replayed"})") == "3");
    CHECK(sample(text, R"(idem_call_duration_seconds_bucket{outcome="replayed",le="+Inf"})") == "3");
    CHECK(sample(text, "idem_pool_connections_max") == "1");
    CHECK(sample(text, "idem_pool_connections_open") == "1");
    CHECK(sample(text, "idem_pool_waiters") == "0");
    CHECK(sample(text, "idem_pool_acquire_waits_total") == "1");
    CHECK(sample(text, "idem_pool_acquire_timeouts_total") == "0");
    CHECK(sample(text, "idem_pool_acquires_total") == std::to_string(after.acquires));
    CHECK(sample(text, "idem_pool_acquire_wait_seconds_count") == std::to_string(after.waited));
    CHECK(sample(text, "idem_store_claims_total") == std::to_string(store.stats().claims));
    CHECK(sample(text, "idem_store_connections_opened_total") == "1");
}

TEST_CASE("PostgresStore::pool_stats counts a pool_timeout and its wait", "[metrics][postgres]") {
    const std::string url = require_db();
    idem::PostgresOptions o = idem_test::env_options({});
    o.table = idem_test::unique_name("idem_metrics");
    o.pool_size = 1;
    o.pool_wait = 100ms;
    idem::PostgresStore store(url, o);
    store.ensure_schema();
    const auto fp = idem::fingerprint("POST /metrics"s);
    std::atomic<bool> inside{false}, release{false};
    std::thread holder([&] {
        (void)idem::execute_once_in_transaction(store, idem::Key("metrics", "hold"), fp, [&](idem::Transaction&) {
            inside = true;
            while (!release.load()) std::this_thread::sleep_for(1ms);
            return idem::Response{201, "tx"};
        });
    });
    while (!inside.load()) std::this_thread::sleep_for(1ms);
    std::thread late([&] {  // another thread: the holder's own thread would get config_error at once
        CHECK_THROWS_AS(idem::execute_once(store, idem::Key("metrics", "late"), fp, [] { return idem::Response{}; }),
                        idem::pool_timeout);
    });
    late.join();
    release = true;
    holder.join();
    const idem::PoolStats s = store.pool_stats();
    CHECK(s.timeouts == 1);
    CHECK(s.waited == 1);
    CHECK(s.waiters == 0);
    CHECK(s.wait_time >= 99ms);         // waited until the deadline, pool_wait after it began waiting
    CHECK(s.waits_within[5] == 0);      // not within 25 ms
    CHECK(s.waits_within.back() == 1);  // within 10 s
}
