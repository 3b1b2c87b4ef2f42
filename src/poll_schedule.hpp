// When a waiting claim reads its key again (internal).
#pragma once

#include <algorithm>
#include <chrono>

#include "clock.hpp"

namespace idem::detail {

/// The poll schedule of ClaimOptions::wait: a caller that waits for another attempt's save reads
/// the key 20 ms after its first look, then after twice the last interval, at most kMaxInterval
/// apart (what a missed notification costs at most), and never past the wait's end. PostgreSQL's
/// claim machine (blocking and async) and RedisStore poll by it (MemoryStore waits on a condition).
/// One per waiting call; not thread-safe.
class PollSchedule {
public:
    using Clock = std::chrono::steady_clock;
    static constexpr std::chrono::milliseconds kFirstInterval{20};
    static constexpr std::chrono::milliseconds kMaxInterval{200};

    /// `now`: the clock the schedule reads (a test's, to step through it).
    explicit PollSchedule(Clock::time_point end, SteadyNow now = &Clock::now) noexcept : end_(end), now_(now) {}

    /// The time of the next poll; each call moves on one step.
    [[nodiscard]] Clock::time_point next() noexcept {
        const Clock::time_point at = std::min(now_() + interval_, end_);
        interval_ = std::min(interval_ * 2, std::chrono::duration_cast<Clock::duration>(kMaxInterval));
        return at;
    }
    /// The wait's end.
    [[nodiscard]] Clock::time_point end() const noexcept { return end_; }

private:
    Clock::time_point end_;
    SteadyNow now_;
    Clock::duration interval_ = kFirstInterval;
};

}  // namespace idem::detail
