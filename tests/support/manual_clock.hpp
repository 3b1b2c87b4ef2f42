// tests/support/manual_clock.hpp — a clock that moves only when the test moves it, for
// MemoryStoreOptions::clock: a lease or a retention passes exactly when the test says, however busy
// the machine is (not part of idem).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

namespace idem_test {

class ManualClock {
public:
    using time_point = std::chrono::system_clock::time_point;

    /// Starts at the system clock's present, so stored timestamps look ordinary.
    ManualClock() : since_epoch_(std::chrono::system_clock::now().time_since_epoch().count()) {}

    [[nodiscard]] time_point now() const {
        return time_point(time_point::duration(since_epoch_.load(std::memory_order_acquire)));
    }

    /// Moves the clock forward by `d` (thread-safe).
    void advance(std::chrono::milliseconds d) {
        since_epoch_.fetch_add(std::chrono::duration_cast<time_point::duration>(d).count(), std::memory_order_acq_rel);
    }

    /// The clock as MemoryStoreOptions::clock wants it; shares ownership of `clock`.
    static std::function<time_point()> function(const std::shared_ptr<ManualClock>& clock) {
        return [clock] { return clock->now(); };
    }

private:
    std::atomic<time_point::rep> since_epoch_;
};

}  // namespace idem_test
