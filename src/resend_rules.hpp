// What a write sent again finds (internal).
//
// A write whose answer was lost with its connection is sent again, with the same fence, on a fresh
// one; the first may have committed. The second then finds the key as the first left it, and each
// rule here says when that means "it was ours". One copy for every store and driver: PostgresStore
// and idem::asio (src/postgres/sansio/ops.cpp, and PostgresStore's save_batch) and RedisStore's release
// call these when a write that may have been sent before (a retry, or a group's statement that
// failed) changed nothing.
#pragma once

#include <optional>
#include <string_view>

#include "idem/store.hpp"

namespace idem::detail {

/// A release (delete of an in-progress key by its fence) changed nothing on a resend: it landed
/// the first time if the key is gone, or now holds another fence (someone claimed it since).
[[nodiscard]] inline bool release_landed(const std::optional<Record>& now, Fence fence) noexcept {
    return !now || now->fence != fence;
}

/// A take-over (stale fence to `fresh`) changed nothing on a resend: it landed the first time if
/// the record holds `fresh`.
[[nodiscard]] inline bool take_over_landed(const std::optional<Record>& now, Fence fresh) noexcept {
    return now && now->fence == fresh;
}

/// A save changed nothing on a resend: it landed the first time if the record is completed under
/// this fence with this very result.
[[nodiscard]] inline bool save_landed(const std::optional<Record>& now, Fence fence, std::string_view result) noexcept {
    return now && now->state == RecordState::completed && now->fence == fence && now->result == result;
}

}  // namespace idem::detail
