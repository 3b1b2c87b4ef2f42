// idem/replay_cache.hpp — ReplayCache: completed records kept in process memory, bounded by bytes.
//
// A completed record cannot change until its retention passes, so a replay can be answered from
// memory. CachedStore (idem/cached_store.hpp) puts one in front of any store; use this class directly
// only to build such a decorator. It is the in-process ReplayTier (idem/replay_tier.hpp).
//
// * Only completed records are kept (never in-progress ones), and only when the store said how much
//   retention is left: an entry expires at (local steady time taken before the store was asked)
//   + (expires_at - read_at), both as the store stated them, so no clock difference between this
//   host and the database stretches it. A record whose retention has passed is never returned.
//   A record without read_at, or already expired when read, is not kept.
// * Bounded: entries are evicted least recently used first once max_bytes is reached. The budget is
//   split evenly between the shards (max_bytes / shards each); an entry larger than one shard's
//   budget (its result plus its key plus a fixed overhead) is not kept.
// * An operator who deletes (or edits) a completed row by hand is NOT seen by the caches of running
//   processes: each keeps replaying the record it holds until that entry expires, i.e. at most until
//   the record's retention as stated when it was read (expires_at - read_at, default 24 h), or until
//   evicted. Whoever deletes a row by hand must call erase(key) or clear() in every process (or
//   restart them) if the replays must stop at once.
//
// Errors: the constructor throws config_error when max_bytes is 0 or above 1 TiB, shards is 0 or
// above 4096, or max_bytes / shards is below 1 KiB.
// Thread-safety: every member may be called from any number of threads at once; each shard has its
// own lock, so concurrent hits on different keys rarely wait for each other.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "idem/key.hpp"
#include "idem/replay_tier.hpp"
#include "idem/store.hpp"

namespace idem {

/// Size and sharding of a ReplayCache (and so of a CachedStore).
struct ReplayCacheOptions {
    /// Upper bound of the bytes the entries account for (results, keys, bookkeeping).
    std::size_t max_bytes = 64u << 20;
    /// Independently locked parts; a key's shard is picked by its hash.
    std::size_t shards = 32;
    /// The local clock entries expire by; empty means std::chrono::steady_clock::now. A test injects
    /// a clock it moves by hand. Called without any lock held; must be thread-safe.
    std::function<std::chrono::steady_clock::time_point()> clock{};
};

/// Counters since the cache was made (summed over the shards; not one atomic snapshot).
struct ReplayCacheStats {
    /// Finds that returned a record (CachedStore still asks the store when the request does not match it).
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;     ///< not there, or expired (expired entries are dropped)
    std::uint64_t inserts = 0;    ///< records kept
    std::uint64_t evictions = 0;  ///< dropped to make room (least recently used)
    std::uint64_t rejected = 0;   ///< not kept: too large, not completed, no read_at, expired
    std::uint64_t entries = 0;    ///< entries held now
    std::uint64_t bytes = 0;      ///< bytes the entries account for now
};

/// Completed records in process memory, bounded by bytes, sharded (see the top of this header).
class ReplayCache final : public ReplayTier {
public:
    /// Throws config_error on invalid options (see the top of this header).
    explicit ReplayCache(ReplayCacheOptions options = {});
    ~ReplayCache() override;
    ReplayCache(const ReplayCache&) = delete;
    ReplayCache& operator=(const ReplayCache&) = delete;

    /// The cached completed record of `key`, or nullptr (none, or its retention has passed).
    [[nodiscard]] std::shared_ptr<const Record> find(const Key& key) override;

    /// Keeps `record` for `key` if it qualifies (completed, read_at set, retention left, small
    /// enough); `asked_at` is this cache's clock() taken before the store was asked for it. Replaces
    /// an older entry of the key. Returns whether it was kept.
    bool insert(const Key& key, const Record& record, time_point asked_at) override;

    /// Drops the entry of `key`; returns whether there was one.
    bool erase(const Key& key) override;
    /// Drops every entry.
    void clear();

    /// This cache's clock (the injected one, or steady_clock::now).
    [[nodiscard]] time_point now() const override;
    /// false: find() answers the record as inserted (its read_at is the source's).
    [[nodiscard]] bool states_time_left() const noexcept override { return false; }

    /// Counters since the cache was made.
    [[nodiscard]] ReplayCacheStats stats() const;
    /// The options the cache was made with.
    [[nodiscard]] const ReplayCacheOptions& options() const noexcept;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace idem
