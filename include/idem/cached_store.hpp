// idem/cached_store.hpp — CachedStore: any store, with replays answered from caches in front of it.
//
//   idem::PostgresStore primary{conninfo};
//   idem::CachedStore store{primary, {.max_bytes = 64u << 20}};   // opt-in: process memory
//   auto r = idem::execute_once(store, key, fp, fn);                  // replays: no round trip
//
//   // Tiers, asked in order: process memory, then Redis shared by every instance (idem::redis).
//   idem::CachedStore tiered{primary, {std::make_shared<idem::ReplayCache>(),
//                                      std::make_shared<idem::RedisReplayCache>(redis_options)}};
//
// * claim(): a cached completed record of the key whose fingerprint matches (checked on every hit,
//   by the same rule and with the same FingerprintSecret as the primary: key_fingerprint())
//   answers completed at once, with no round trip to the primary. One whose fingerprint does not
//   match is asked of the primary, which answers mismatch in its own words (a sealing store drops
//   the result of a mismatch; the cache holds opened records). The tiers are asked in order; a hit
//   in a tier that states the time left (idem/replay_tier.hpp) is copied into the tiers in front
//   of it. On a miss in every tier — or a tier's error or timeout, which is a miss — the primary
//   is asked, and a completed (or mismatch-on-completed) answer is kept in every tier for the
//   retention it has left. So an answer always is one the primary gives or gave for that record.
//   In-progress records are never kept, so in_progress answers, waiting and resume mode always go
//   to the primary. claim_batch() does the same per key (the misses go to the primary in one
//   claim_batch call).
// * Every other member forwards to the primary unchanged (save, release, read, listing, purge,
//   stats — stats() are the primary's: a hit adds nothing to them; cache().stats() counts hits).
//   A save does not fill the cache: the first replay of the key does.
// * Staleness: a completed record changes only when its retention passes, which the cache never
//   outlives. An operator deleting or editing a completed row by hand is the exception: every process
//   whose cache holds the key keeps replaying the old record until the entry expires (at most the
//   record's retention as read, default 24 h) — call cache().erase(key) or cache().clear() in each
//   process, or restart them, to stop it at once.
// * A crash between the primary's commit and a tier's insert leaves that tier without the entry:
//   a miss, answered by the primary. No tier is written before the primary has answered.
// * Observers: events of execute_once run through this store go to this store's observer; the
//   primary reports its own to its own.
//
// Errors: those of the primary (a tier never throws); the constructors throw config_error for bad
// ReplayCacheOptions, or no tiers, or a null one.
// Thread-safety: as the primary (every idem store is fully thread-safe), plus the tiers' own.
// The primary must outlive the CachedStore.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "idem/replay_cache.hpp"
#include "idem/store.hpp"

namespace idem {

/// A store whose replays of completed keys are answered from the replay tiers in front of it
/// (process memory, Redis; see the top of this header).
class CachedStore final : public IdempotencyStore {
public:
    /// One tier in front of `primary` (which must outlive this object): a ReplayCache in process
    /// memory made with `options`. Throws config_error for bad options.
    explicit CachedStore(IdempotencyStore& primary, ReplayCacheOptions options = {});
    /// `tiers`, asked in order before the primary (at least one; none null).
    CachedStore(IdempotencyStore& primary, std::vector<std::shared_ptr<ReplayTier>> tiers);

    [[nodiscard]] Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) override;
    [[nodiscard]] std::vector<Claim> claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                                 const ClaimOptions& options = {}) override;
    void save(const Key& key, Fence fence, std::string_view result) override;
    [[nodiscard]] std::vector<SaveStatus> save_batch(std::span<const SaveRequest> saves) override;
    void release(const Key& key, Fence fence) override;
    [[nodiscard]] std::optional<Record> read(const Key& key) override;
    void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) override;
    void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) override;
    [[nodiscard]] std::optional<Fence> take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                 bool new_attempt) override;
    [[nodiscard]] std::vector<StaleKey> list_stale(std::size_t limit,
                                                   const ScopeFilter& scopes = ScopeFilter::all()) override;
    [[nodiscard]] std::size_t count_stale(const ScopeFilter& scopes = ScopeFilter::all()) override;
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    /// The primary's counters (cache hits add nothing: see cache().stats()).
    [[nodiscard]] StoreStats stats() const override;
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;
    /// The primary's (a cached record is compared as the primary compares its row).
    [[nodiscard]] Fingerprint key_fingerprint(const Fingerprint& fp) const override;

    /// The store behind the cache.
    /// The store behind the tiers.
    [[nodiscard]] IdempotencyStore& primary() const noexcept { return primary_; }
    /// The in-process cache (the first ReplayCache among the tiers): its counters, and erase() /
    /// clear() (see "Staleness" above). Throws config_error when no tier is a ReplayCache.
    [[nodiscard]] ReplayCache& cache();
    /// The tiers, in the order they are asked.
    [[nodiscard]] const std::vector<std::shared_ptr<ReplayTier>>& tiers() const noexcept { return tiers_; }
    /// Drops `key` from every tier (see "Staleness" above); returns whether any had it.
    bool forget(const Key& key);

private:
    // The cached record of `key` from the first tier that has it, copied into the tiers in front
    // of it when that tier states the time left.
    std::shared_ptr<const Record> find(const Key& key);
    // The answer of a hit that matches `fp` (completed); nullopt for a miss or a mismatch.
    std::optional<Claim> from_tiers(const Key& key, const Fingerprint& fp);
    void keep(const Key& key, const Record& record, const std::vector<ReplayTier::time_point>& asked_at);
    std::vector<ReplayTier::time_point> now_of_tiers() const;

    IdempotencyStore& primary_;
    std::vector<std::shared_ptr<ReplayTier>> tiers_;
};

}  // namespace idem
