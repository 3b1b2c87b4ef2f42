#include "retry_policy.hpp"

#include <algorithm>
#include <random>

namespace idem::detail {

unsigned jitter(unsigned cap) noexcept {
    thread_local std::minstd_rand random{std::random_device{}()};
    return 1 + static_cast<unsigned>(random() % std::max(cap, 1u));
}

RetryPolicy::RetryPolicy(int attempts, Clock::duration keep_trying, SteadyNow now) noexcept
    : attempts_(attempts),
      now_(now),
      retry_until_(keep_trying > Clock::duration::zero() ? now() + keep_trying : Clock::time_point{}) {}

std::optional<std::chrono::milliseconds> RetryPolicy::after(Failure failure) noexcept {
    const int attempt = attempt_++;
    const bool in_window = now_() < retry_until_;
    switch (failure) {
        case Failure::conflict:
            if (++conflicts_ >= attempts_ && !in_window) return std::nullopt;
            // Jittered: the transaction that won the conflict is usually still running.
            return std::chrono::milliseconds(jitter(5u * static_cast<unsigned>(std::min(conflicts_, 20))));
        case Failure::broken:
            if (attempt >= attempts_ && !in_window) return std::nullopt;
            if (attempt == 1) return std::chrono::milliseconds(0);
            break;
        case Failure::unreachable:
            if (!in_window) return std::nullopt;
            break;
    }
    const auto pause = backoff_;
    backoff_ = std::min(backoff_ * 2, std::chrono::milliseconds(1000));
    return pause;
}

}  // namespace idem::detail
