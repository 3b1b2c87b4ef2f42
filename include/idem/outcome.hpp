// idem/outcome.hpp — the value execute_once returns.
//
//   executed     this call claimed the key, ran the effect and saved its result: response() is it.
//   replayed     an earlier call completed this key: response() is the stored result, decoded from
//                the very bytes stored; the effect did not run.
//   in_progress  another call holds the key and has not finished (or its outcome is unknown and
//                awaits reconciliation): answer 409 and let the client retry after retry_after().
//   mismatch     the key was used with a different request fingerprint: a client error (422).
//
// response() on in_progress or mismatch throws std::logic_error (a programming error, not an idem
// failure). Thread-safety: a plain value.
#pragma once

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <utility>

namespace idem {

/// What execute_once decided for a call (see the top of this header).
enum class Outcome { executed, replayed, in_progress, mismatch };

/// The outcome's name: "executed", "replayed", "in_progress" or "mismatch".
[[nodiscard]] constexpr std::string_view to_string(Outcome outcome) noexcept {
    switch (outcome) {
        case Outcome::executed: return "executed";
        case Outcome::replayed: return "replayed";
        case Outcome::in_progress: return "in_progress";
        case Outcome::mismatch: return "mismatch";
    }
    return "unknown";
}

template <class T>
/// The value execute_once returns: the Outcome, and the response for executed and replayed.
class [[nodiscard]] Result {
public:
    /// This call ran the effect and saved `value`.
    static Result executed(T value) { return Result(Outcome::executed, std::move(value), {}); }
    /// An earlier call completed the key; `value` is its stored result.
    static Result replayed(T value) { return Result(Outcome::replayed, std::move(value), {}); }
    /// Another call holds the key; the client may retry after `retry_after`.
    static Result in_progress(std::chrono::milliseconds retry_after) {
        return Result(Outcome::in_progress, std::nullopt, retry_after);
    }
    /// The key was used with another request fingerprint.
    static Result mismatch() { return Result(Outcome::mismatch, std::nullopt, {}); }

    /// What happened to this call.
    [[nodiscard]] Outcome outcome() const noexcept { return outcome_; }
    /// True for executed and replayed: there is a response.
    [[nodiscard]] bool has_response() const noexcept { return value_.has_value(); }
    /// True for replayed.
    [[nodiscard]] bool is_replay() const noexcept { return outcome_ == Outcome::replayed; }

    /// The response (executed, replayed); throws std::logic_error for in_progress and mismatch.
    [[nodiscard]] const T& response() const& {
        if (!value_) throw std::logic_error("idem::Result::response() on an outcome without one");
        return *value_;
    }
    /// Moves the response out (executed, replayed); throws std::logic_error for in_progress and
    /// mismatch.
    [[nodiscard]] T&& response() && {
        if (!value_) throw std::logic_error("idem::Result::response() on an outcome without one");
        return std::move(*value_);
    }

    /// For in_progress: how long the client should wait before retrying (the Retry-After hint).
    [[nodiscard]] std::chrono::milliseconds retry_after() const noexcept { return retry_after_; }

private:
    Result(Outcome outcome, std::optional<T> value, std::chrono::milliseconds retry_after)
        : outcome_(outcome), value_(std::move(value)), retry_after_(retry_after) {}

    Outcome outcome_;
    std::optional<T> value_;
    std::chrono::milliseconds retry_after_{};
};

}  // namespace idem
