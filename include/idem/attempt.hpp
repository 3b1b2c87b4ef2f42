// idem/attempt.hpp — what an effect knows about the attempt it runs in: the key it claimed, its
// fence, its attempt number and the recovery point an earlier attempt recorded (resume mode).
//
// The read-only half of idem::Context (execute_once) and idem::asio::AsyncContext
// (async_execute_once); each adds the writes of its I/O model (record_phase, extend_lease).
// Thread-safety: a view of the call's key and claim, valid while the effect runs.
#pragma once

#include <optional>
#include <string>

#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem {

/// The attempt an effect runs in (see the top of this header).
class Attempt {
public:
    /// `taken_over` is the earlier attempt's record after a resume-mode takeover, else null.
    Attempt(const Key& key, Fence fence, const Record* taken_over) noexcept
        : key_(key), fence_(fence), taken_over_(taken_over) {}

    /// The key this call claimed.
    [[nodiscard]] const Key& key() const noexcept { return key_; }
    /// The fence token of this claim (pass it on if a downstream write should be fenced too).
    [[nodiscard]] Fence fence() const noexcept { return fence_; }
    /// 1 for the first attempt at this key; more when resume mode took over a stale attempt.
    [[nodiscard]] int attempt() const noexcept { return taken_over_ ? taken_over_->attempt : 1; }
    /// The last recovery point an earlier attempt recorded (resume mode).
    [[nodiscard]] std::optional<std::string> phase() const { return taken_over_ ? taken_over_->phase : std::nullopt; }
    /// The data recorded with phase() (resume mode).
    [[nodiscard]] std::optional<std::string> phase_data() const {
        return taken_over_ ? taken_over_->phase_data : std::nullopt;
    }

private:
    const Key& key_;
    Fence fence_;
    const Record* taken_over_;
};

}  // namespace idem
