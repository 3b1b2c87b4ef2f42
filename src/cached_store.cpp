#include "idem/cached_store.hpp"

#include <optional>
#include <utility>

#include "idem/errors.hpp"
#include "replay_rules.hpp"

namespace idem {

using detail::cacheable;
using detail::from_cache;

CachedStore::CachedStore(IdempotencyStore& primary, ReplayCacheOptions options)
    : primary_(primary), tiers_{std::make_shared<ReplayCache>(std::move(options))} {}

CachedStore::CachedStore(IdempotencyStore& primary, std::vector<std::shared_ptr<ReplayTier>> tiers)
    : primary_(primary), tiers_(std::move(tiers)) {
    if (tiers_.empty()) throw config_error("idem: CachedStore: no tiers");
    for (const auto& tier : tiers_) {
        if (!tier) throw config_error("idem: CachedStore: a tier is null");
    }
}

ReplayCache& CachedStore::cache() {
    for (const auto& tier : tiers_) {
        if (auto* local = dynamic_cast<ReplayCache*>(tier.get())) return *local;
    }
    throw config_error("idem: CachedStore::cache(): no tier of this store is a ReplayCache");
}

bool CachedStore::forget(const Key& key) {
    bool any = false;
    for (const auto& tier : tiers_) any = tier->erase(key) || any;
    return any;
}

std::vector<ReplayTier::time_point> CachedStore::now_of_tiers() const {
    std::vector<ReplayTier::time_point> now;
    now.reserve(tiers_.size());
    for (const auto& tier : tiers_) now.push_back(tier->now());
    return now;
}

std::shared_ptr<const Record> CachedStore::find(const Key& key) {
    if (tiers_.size() == 1) return tiers_[0]->find(key);  // the common case: no clocks to read
    // Each tier's clock before the tiers behind it are asked, so a copy never outlives its source.
    std::vector<ReplayTier::time_point> asked_at;
    asked_at.reserve(tiers_.size());
    for (std::size_t i = 0; i < tiers_.size(); ++i) {
        asked_at.push_back(tiers_[i]->now());
        auto hit = tiers_[i]->find(key);
        if (!hit) continue;
        if (tiers_[i]->states_time_left()) {
            for (std::size_t j = 0; j < i; ++j) tiers_[j]->insert(key, *hit, asked_at[j]);
        }
        return hit;
    }
    return nullptr;
}

void CachedStore::keep(const Key& key, const Record& record, const std::vector<ReplayTier::time_point>& asked_at) {
    for (std::size_t i = 0; i < tiers_.size(); ++i) tiers_[i]->insert(key, record, asked_at[i]);
}

// A hit answers a matching request (completed). A mismatch goes to the primary, which words it
// as it always does: a sealing store drops the result of a mismatch, while the cache holds the
// opened record, so answering it here would hand another request's plaintext to a reused key.
std::optional<Claim> CachedStore::from_tiers(const Key& key, const Fingerprint& fp) {
    const auto hit = find(key);
    if (!hit) return std::nullopt;
    Claim c = from_cache(*hit, primary_.key_fingerprint(fp));
    if (c.status == ClaimStatus::mismatch) return std::nullopt;
    return c;
}

Claim CachedStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    if (auto answer = from_tiers(key, fp)) return std::move(*answer);
    // Taken before the primary is asked, so no entry's expiry lies past what the database stated
    // (its read_at is later than this moment).
    const auto asked_at = now_of_tiers();
    Claim c = primary_.claim(key, fp, options);
    if (cacheable(c)) keep(key, *c.existing, asked_at);
    return c;
}

std::vector<Claim> CachedStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                            const ClaimOptions& options) {
    std::vector<Claim> out(keys.size());
    std::vector<std::size_t> misses;
    std::vector<Key> miss_keys;
    std::vector<Fingerprint> miss_fps;
    for (std::size_t i = 0; i < keys.size(); ++i) {
        if (auto answer = from_tiers(keys[i], fps[i])) {
            out[i] = std::move(*answer);
        } else {
            misses.push_back(i);
            miss_keys.push_back(keys[i]);
            miss_fps.push_back(fps[i]);
        }
    }
    if (misses.empty()) return out;
    const auto asked_at = now_of_tiers();
    std::vector<Claim> answers = primary_.claim_batch(miss_keys, miss_fps, options);
    for (std::size_t j = 0; j < misses.size(); ++j) {
        if (cacheable(answers[j])) keep(miss_keys[j], *answers[j].existing, asked_at);
        out[misses[j]] = std::move(answers[j]);
    }
    return out;
}

void CachedStore::save(const Key& key, Fence fence, std::string_view result) { primary_.save(key, fence, result); }

std::vector<SaveStatus> CachedStore::save_batch(std::span<const SaveRequest> saves) {
    return primary_.save_batch(saves);
}

void CachedStore::release(const Key& key, Fence fence) { primary_.release(key, fence); }

std::optional<Record> CachedStore::read(const Key& key) { return primary_.read(key); }

void CachedStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    primary_.extend_lease(key, fence, lease);
}

void CachedStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    primary_.record_phase(key, fence, phase, data);
}

std::optional<Fence> CachedStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                            bool new_attempt) {
    return primary_.take_over(key, stale_fence, lease, new_attempt);
}

std::vector<StaleKey> CachedStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    return primary_.list_stale(limit, scopes);
}

std::size_t CachedStore::count_stale(const ScopeFilter& scopes) { return primary_.count_stale(scopes); }

std::size_t CachedStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    return primary_.purge_expired(batch_size, max_batches);
}

StoreStats CachedStore::stats() const { return primary_.stats(); }

std::size_t CachedStore::max_result_bytes() const noexcept { return primary_.max_result_bytes(); }

Fingerprint CachedStore::key_fingerprint(const Fingerprint& fp) const { return primary_.key_fingerprint(fp); }

}  // namespace idem
