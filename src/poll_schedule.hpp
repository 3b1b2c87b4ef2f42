// When a waiting claim reads its key again (internal).
#pragma once

#include <algorithm>
#include <chrono>

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

    explicit PollSchedule(Clock::time_point end) noexcept : end_(end) {}

    /// The time of the next poll; each call moves on one step.
    [[nodiscard]] Clock::time_point next() noexcept {
        const Clock::time_point at = std::min(Clock::now() + interval_, end_);
        interval_ = std::min(interval_ * 2, std::chrono::duration_cast<Clock::duration>(kMaxInterval));
        return at;
    }
    /// The wait's end.
    [[nodiscard]] Clock::time_point end() const noexcept { return end_; }

private:
    Clock::time_point end_;
    Clock::duration interval_ = kFirstInterval;
};

}  // namespace idem::detail
