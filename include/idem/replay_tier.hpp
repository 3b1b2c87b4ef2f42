// idem/replay_tier.hpp — ReplayTier: one place completed records can be kept for replays.
//
// CachedStore (idem/cached_store.hpp) asks its tiers in order before the primary store: the
// in-process ReplayCache (idem/replay_cache.hpp) and, with the idem::redis component,
// RedisReplayCache (idem/redis/replay_cache.hpp). Implement it to put another cache in front.
//
// Contract of every tier:
// * Only completed records are kept, each for at most the retention it had left when its source
//   stated it (expires_at - read_at of the record handed to insert(), counted from asked_at), so a
//   tier never answers with a record the primary would no longer give.
// * find() answers the record as it was inserted. A tier that measures the time an entry has left
//   (states_time_left(), e.g. RedisReplayCache, from the entry's TTL) sets its read_at so that
//   expires_at - read_at is what is left now; CachedStore copies a hit into the tiers in front of
//   the one that answered only from such a tier (ReplayCache answers the record as inserted).
// * A tier's own failure (an error, a timeout) is a miss for find() and a no for insert(), never
//   an exception: the caller then asks the next tier or the primary. A tier counts its failures.
//
// Thread-safety: every member may be called from any number of threads at once.
#pragma once

#include <chrono>
#include <memory>

#include "idem/key.hpp"
#include "idem/store.hpp"

namespace idem {

/// A cache of completed records in front of a store (see the top of this header).
class ReplayTier {
public:
    /// The clock a tier's expiry is measured by.
    using time_point = std::chrono::steady_clock::time_point;

    virtual ~ReplayTier() = default;

    /// The cached completed record of `key`, or nullptr: none, its retention has passed, or the
    /// tier could not answer.
    [[nodiscard]] virtual std::shared_ptr<const Record> find(const Key& key) = 0;

    /// Keeps `record` for `key` if it qualifies (completed, read_at set, retention left); `asked_at`
    /// is this tier's now() taken before the record's source was asked. Returns whether it was kept.
    virtual bool insert(const Key& key, const Record& record, time_point asked_at) = 0;

    /// Drops the entry of `key`; returns whether there was one (as far as the tier can tell).
    virtual bool erase(const Key& key) = 0;

    /// This tier's clock.
    [[nodiscard]] virtual time_point now() const = 0;

    /// Whether find()'s records state the retention left now (see the top of this header).
    [[nodiscard]] virtual bool states_time_left() const noexcept = 0;

protected:
    ReplayTier() = default;
    /// For implementations.
    ReplayTier(const ReplayTier&) = default;
    /// For implementations.
    ReplayTier& operator=(const ReplayTier&) = default;
};

}  // namespace idem
