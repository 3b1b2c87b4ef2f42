// When a store sends a failed attempt of an operation again (internal).
//
// One policy for every store and driver: PostgresStore and idem::asio (through pg::Retrier,
// which sorts PostgreSQL's failures into the kinds below and words the final error) and RedisStore.
// A driver sends an attempt, and after a failure asks after() whether, and after which pause, to
// send the next one. One per operation; not thread-safe.
#pragma once

#include <chrono>
#include <optional>

#include "clock.hpp"

namespace idem::detail {

/// 1 + a random number below `cap` (at least 1), per thread: spreads out callers that failed together.
[[nodiscard]] unsigned jitter(unsigned cap) noexcept;

class RetryPolicy {
public:
    using Clock = std::chrono::steady_clock;

    enum class Failure {
        /// The connection broke with the attempt in flight (the attempt may have landed: every
        /// operation recognises its own earlier write). `attempts` in all; the first retry goes at
        /// once (a broken pooled connection says little about the next one), later ones back off.
        broken,
        /// No connection could be made: the server is away. Retried only within `keep_trying` (a
        /// request path should hear "unavailable" at once, a save whose effect ran should try
        /// hard), backing off from 25 ms to 1 s.
        unreachable,
        /// The server rolled the attempt back for a conflict (serialization failure, deadlock):
        /// `attempts` in all, or for as long as `keep_trying`, each after a jittered pause.
        conflict,
    };

    /// `now`: the clock of the `keep_trying` window (a test's, to step through it).
    RetryPolicy(int attempts, Clock::duration keep_trying, SteadyNow now = &Clock::now) noexcept;

    /// After a failed attempt: the pause before the next one, or nullopt to give up.
    [[nodiscard]] std::optional<std::chrono::milliseconds> after(Failure failure) noexcept;
    /// 1 for the first attempt; more means an earlier attempt may have landed.
    [[nodiscard]] int attempt() const noexcept { return attempt_; }

private:
    int attempts_;
    SteadyNow now_;
    Clock::time_point retry_until_{};
    std::chrono::milliseconds backoff_{25};
    int conflicts_ = 0;
    int attempt_ = 1;
};

}  // namespace idem::detail
