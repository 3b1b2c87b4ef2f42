// idem/cached_store.hpp — CachedStore: any store, with replays answered from process memory.
//
//   idem::PostgresStore primary{conninfo};
//   idem::CachedStore store{primary, {.max_bytes = 64u << 20}};   // opt-in
//   auto r = idem::execute_once(store, key, fp, fn);                  // replays: no round trip
//
// * claim(): a cached completed record of the key answers at once, with no round trip: completed if
//   the fingerprint matches, mismatch if not (checked on every hit). Otherwise the primary is asked;
//   a completed (or mismatch-on-completed) answer is kept for the retention it has left (see
//   idem/replay_cache.hpp). In-progress records are never kept, so in_progress answers, waiting
//   and resume mode always go to the primary. claim_batch() does the same per key (the misses go to
//   the primary in one claim_batch call).
// * Every other member forwards to the primary unchanged (save, release, read, listing, purge,
//   stats — stats() are the primary's: a hit adds nothing to them; cache().stats() counts hits).
//   A save does not fill the cache: the first replay of the key does.
// * Staleness: a completed record changes only when its retention passes, which the cache never
//   outlives. An operator deleting or editing a completed row by hand is the exception: every process
//   whose cache holds the key keeps replaying the old record until the entry expires (at most the
//   record's retention as read, default 24 h) — call cache().erase(key) or cache().clear() in each
//   process, or restart them, to stop it at once.
// * Observers: events of execute_once run through this store go to this store's observer; the
//   primary reports its own to its own.
//
// Errors: those of the primary; the constructor throws config_error for bad ReplayCacheOptions.
// Thread-safety: as the primary (every idem store is fully thread-safe), plus the cache's shard locks.
// The primary must outlive the CachedStore.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "idem/replay_cache.hpp"
#include "idem/store.hpp"

namespace idem {

class CachedStore final : public IdempotencyStore {
public:
    explicit CachedStore(IdempotencyStore& primary, ReplayCacheOptions options = {});

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
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    [[nodiscard]] StoreStats stats() const override;
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;

    [[nodiscard]] IdempotencyStore& primary() const noexcept { return primary_; }
    /// The cache: its counters, and erase() / clear() (see "Staleness" above).
    [[nodiscard]] ReplayCache& cache() noexcept { return cache_; }

private:
    IdempotencyStore& primary_;
    ReplayCache cache_;
};

}  // namespace idem
