// idem/prometheus.hpp — an Observer that keeps Prometheus counters and latency histograms per
// outcome, and renders them (with a store's pool figures) in the Prometheus text format 0.0.4.
//
//   auto metrics = std::make_shared<idem::PrometheusObserver>();
//   metrics->set_pool_source([&store] { return store.pool_stats(); });   // optional
//   metrics->set_store_source([&store] { return store.stats(); });       // optional
//   metrics->set_stale_source([&reconciler] { return reconciler.stale_keys().value_or(0); });
//   store.set_observer(metrics);                                         // before sharing the store
//   // GET /metrics:  Content-Type: idem::PrometheusObserver::content_type,  body: metrics->render()
//
// The metrics (every series is always present, at 0 until something happens, so rate() and
// alerts see it from the first scrape; options.labels are added to every series):
//
//   idem_calls_total{outcome}                counter    execute_once / execute_batch / idem::http
//       calls by outcome: executed, replayed, in_progress, mismatch, released (not_performed),
//       unknown (fn threw or its result was not saved: the key waits for a reconciler)
//   idem_call_duration_seconds{outcome}      histogram  the same calls' durations (claim to answer);
//       calls that were not timed (execute_batch's messages: EventInfo::duration zero) are counted
//       in idem_calls_total only
//   idem_takeovers_total                     counter    stale keys taken over (resume mode, reconciler)
//   idem_reconciled_total                    counter    keys a reconciler resolved (saved or released)
//   idem_reconcile_duration_seconds          histogram  take-over to resolution, per resolved key
//   idem_reconcile_failures_total{kind}      counter    Event::reconcile_failed: kind="key" (one key
//       could not be resolved: it stays in progress), kind="sweep" (a whole sweep failed: an outage)
//   idem_purged_rows_total                   counter    rows purge_expired deleted
// with set_stale_source (e.g. Reconciler::stale_keys):
//   idem_stale_keys                          gauge      in-progress keys whose lease has passed, held
//       by no one, as the reconciler counted them at its last sweep: the backlog of unknown outcomes
// with set_store_source (StoreStats, any store):
//   idem_store_round_trips_total, idem_store_claims_total, idem_store_retries_total,
//   idem_store_connections_opened_total, idem_store_connections_discarded_total    counters
// with set_pool_source (PoolStats: PostgresStore::pool_stats, AsyncPostgresStore::pool_stats):
//   idem_pool_connections_max, idem_pool_connections_open, idem_pool_connections_idle,
//   idem_pool_waiters                        gauges     now
//   idem_pool_acquires_total, idem_pool_acquire_waits_total, idem_pool_acquire_timeouts_total
//                                            counters   connection requests, those that waited,
//                                                       those that ended in pool_timeout
//   idem_pool_acquire_wait_seconds           histogram  time waited by each acquire that found no
//       connection free (PoolStats::wait_bounds), observed once when its wait ended; acquires that
//       did not wait are not observed (idem_pool_acquires_total counts them all)
//
// Worth alerting on (docs/reliability.md, "Metrics"): increase(idem_reconcile_failures_total[15m])
// > 0; idem_calls_total{outcome="unknown"} rising faster than idem_reconciled_total, or
// idem_stale_keys growing (keys pile up in progress); idem_pool_acquire_timeouts_total rising, or idem_pool_waiters > 0
// for minutes (the pool is too small or the database slow); a high share of mismatch (clients reusing keys).
//
// Errors: the constructor throws config_error for invalid options (see PrometheusOptions).
// render() throws what a source throws (the stores' pool_stats() and stats() do not), and
// std::bad_alloc.
// Thread-safety: on_event is lock-free and may be called from any number of threads at once (its
// counters are sharded by thread; a call does three relaxed atomic additions). render() and the
// setters may be called from any thread, concurrently with on_event and with one another; a render
// sees each counter at some moment during the call (not one instant for all: a histogram's _count
// is the sum of its buckets, so each histogram is consistent in itself).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/observer.hpp"
#include "idem/pool_stats.hpp"
#include "idem/store.hpp"

namespace idem {

/// How a PrometheusObserver buckets and labels its series.
struct PrometheusOptions {
    /// Upper bounds (le), in seconds, of the buckets of idem_call_duration_seconds and
    /// idem_reconcile_duration_seconds; "+Inf" is added. Finite, positive, strictly increasing once
    /// rounded to whole nanoseconds, at most 64 of them. Default: 0.0005 … 10 (PoolStats::wait_bounds).
    std::vector<double> buckets{PoolStats::wait_bounds.begin(), PoolStats::wait_bounds.end()};
    /// Constant labels put first on every series, e.g. {{"store", "payments"}} for a process with
    /// several stores. Names: [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", not "le", "outcome"
    /// or "kind", each once. Values: any UTF-8 (escaped as the text format requires).
    std::vector<std::pair<std::string, std::string>> labels{};
};

/// An Observer keeping Prometheus counters and histograms per outcome; render() writes them out.
class PrometheusObserver final : public Observer {
public:
    /// The Content-Type of render()'s output (the text exposition format 0.0.4).
    static constexpr std::string_view content_type = "text/plain; version=0.0.4; charset=utf-8";

    /// Throws config_error for invalid options (buckets or labels, see PrometheusOptions).
    explicit PrometheusObserver(PrometheusOptions options = {});
    /// No source is called after it returns; no on_event or render() may be in flight.
    ~PrometheusObserver() override;
    /// Not copyable: share it (std::shared_ptr, as IdempotencyStore::set_observer takes it).
    PrometheusObserver(const PrometheusObserver&) = delete;
    /// Not assignable.
    PrometheusObserver& operator=(const PrometheusObserver&) = delete;

    /// Counts the event (EventInfo::count of it: rows for purged) and, for a timed call outcome or
    /// reconciled, observes its duration. Lock-free; events of a later version of idem this one
    /// does not know are ignored.
    void on_event(const EventInfo& event) noexcept override;

    /// Pool figures for the idem_pool_* metrics, asked for by every render() (from the thread that
    /// renders); an empty function (the default) leaves them out. The source must outlive its use:
    /// reset it (or destroy the observer) before the store it reads is destroyed.
    void set_pool_source(std::function<PoolStats()> source);

    /// Store counters for the idem_store_* metrics (e.g. `[&store] { return store.stats(); }`),
    /// asked for by every render(); an empty function (the default) leaves them out. Same lifetime
    /// rule as set_pool_source.
    void set_store_source(std::function<StoreStats()> source);

    /// The stale keys now, for the idem_stale_keys gauge (e.g. `[&reconciler] { return
    /// reconciler.stale_keys().value_or(0); }`, or the sum of several reconcilers'), asked for by
    /// every render(); an empty function (the default) leaves the gauge out. Same lifetime rule as
    /// set_pool_source.
    void set_stale_source(std::function<std::size_t()> source);

    /// Every metric in the Prometheus text exposition format 0.0.4: for each family `# HELP` and
    /// `# TYPE` lines, then its samples; histograms as cumulative `_bucket{le="…"}` lines ending
    /// with `le="+Inf"`, then `_sum` (seconds) and `_count`. Families in the order listed at the
    /// top of idem/prometheus.hpp, outcomes in Event order. Throws what a source throws.
    [[nodiscard]] std::string render() const;

private:
    struct State;
    std::unique_ptr<State> state_;
};

}  // namespace idem
