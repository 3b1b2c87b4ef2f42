// idem/observer.hpp — counters and timings per outcome, with the key in each event.
//
//   auto counts = std::make_shared<idem::CountingObserver>();
//   store.set_observer(counts);             // before the store is shared
//   ... counts->snapshot().count(idem::Event::replayed)
//
// Events: executed, replayed, in_progress, mismatch (execute_once, with the call's duration);
// released (not_performed), unknown (fn threw: outcome unknown, or the result was not saved);
// taken_over (resume mode or a reconciler took a stale key); reconciled (a reconciler resolved a
// key); purged (purge_expired, count = rows); reconcile_failed (a reconciler could not resolve a
// key — the key, and in `detail` the stage and the reason, e.g. "save: response_too_large: …" — or,
// with no key, a whole sweep failed: listing stale keys, an outage). Implement Observer to feed your
// own metrics, or use idem::PrometheusObserver (idem/prometheus.hpp). New events are added at the end, so the numbers
// of the existing ones never change.
//
// Thread-safety: on_event is called concurrently from every thread using the store; it must be
// thread-safe and must not throw (it is noexcept). CountingObserver is lock-free.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace idem {

class Key;

/// What happened, as reported to an Observer (see the top of this header).
enum class Event : std::uint8_t {
    executed,
    replayed,
    in_progress,
    mismatch,
    released,
    unknown,
    taken_over,
    reconciled,
    purged,
    reconcile_failed,
};
/// The number of Event values.
inline constexpr std::size_t event_count = 10;

/// The event's name, e.g. "reconcile_failed".
[[nodiscard]] constexpr std::string_view to_string(Event event) noexcept {
    constexpr std::string_view names[event_count] = {"executed", "replayed",        "in_progress", "mismatch",
                                                     "released", "unknown",         "taken_over",  "reconciled",
                                                     "purged",   "reconcile_failed"};
    return names[static_cast<std::size_t>(event)];
}

/// One event, as an Observer's on_event receives it.
struct EventInfo {
    Event event{};  ///< what happened
    /// The key concerned; null for purged and for a failed reconciler sweep.
    const Key* key = nullptr;
    std::chrono::nanoseconds duration{0};  ///< of the call, where one was timed
    std::uint64_t count = 1;               ///< 1, or the number of rows (purged)
    /// reconcile_failed: what failed and why ("save: response_too_large: …"); empty otherwise.
    /// One line: the error message's first line, at most 512 bytes of it (the database's DETAIL
    /// lines, which may show the row's values, are left out). Valid during on_event only.
    std::string_view detail{};
};

/// Receives a store's events; implement on_event to feed your own metrics.
class Observer {
public:
    virtual ~Observer() = default;
    /// Called for every event, from any thread using the store; must be thread-safe and must not
    /// throw.
    virtual void on_event(const EventInfo& event) noexcept = 0;
};

/// Counts events and sums their durations.
class CountingObserver final : public Observer {
public:
    /// The counters at one moment.
    struct Snapshot {
        /// Events seen, indexed by Event.
        std::array<std::uint64_t, event_count> counts{};
        /// Summed durations, indexed by Event.
        std::array<std::chrono::nanoseconds, event_count> total_time{};
        /// How many `e` events were seen.
        [[nodiscard]] std::uint64_t count(Event e) const noexcept { return counts[static_cast<std::size_t>(e)]; }
        /// The summed duration of the `e` events.
        [[nodiscard]] std::chrono::nanoseconds time(Event e) const noexcept {
            return total_time[static_cast<std::size_t>(e)];
        }
    };

    /// Adds the event to its counter (lock-free).
    void on_event(const EventInfo& event) noexcept override {
        const auto i = static_cast<std::size_t>(event.event);
        counts_[i].fetch_add(event.count, std::memory_order_relaxed);
        nanos_[i].fetch_add(event.duration.count(), std::memory_order_relaxed);
    }

    /// The counters now (each read on its own: not one atomic snapshot).
    [[nodiscard]] Snapshot snapshot() const noexcept {
        Snapshot s;
        for (std::size_t i = 0; i < event_count; ++i) {
            s.counts[i] = counts_[i].load(std::memory_order_relaxed);
            s.total_time[i] = std::chrono::nanoseconds(nanos_[i].load(std::memory_order_relaxed));
        }
        return s;
    }

private:
    std::array<std::atomic<std::uint64_t>, event_count> counts_{};
    std::array<std::atomic<std::int64_t>, event_count> nanos_{};
};

}  // namespace idem
