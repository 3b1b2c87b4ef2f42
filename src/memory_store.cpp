#include "idem/memory_store.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "common.hpp"
#include "idem/errors.hpp"

namespace idem {

struct MemoryStore::Impl {
    MemoryStoreOptions options;
    mutable std::mutex mutex;
    std::map<std::pair<std::string, std::string>, Record> records;
    StoreStats stats;

    static std::pair<std::string, std::string> id(const Key& key) { return {key.scope(), key.value()}; }

    // Finds the record `fence` owns, or throws lease_lost. Caller holds the mutex.
    Record& owned(const Key& key, Fence fence, const char* what) {
        auto it = records.find(id(key));
        if (it == records.end() || it->second.fence != fence ||
            it->second.state != RecordState::in_progress) {
            throw lease_lost(std::string("idem: ") + what + " refused: the fence no longer owns the key");
        }
        return it->second;
    }
};

MemoryStore::MemoryStore(MemoryStoreOptions options) : impl_(std::make_unique<Impl>()) {
    impl_->options = options;
}

MemoryStore::~MemoryStore() = default;

Claim MemoryStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    const auto now = std::chrono::system_clock::now();
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.claims;
    ++impl_->stats.round_trips;
    auto [it, inserted] = impl_->records.try_emplace(Impl::id(key));
    Record& record = it->second;
    if (inserted) {
        record.state = RecordState::in_progress;
        record.fingerprint = fp;
        record.fence = detail::new_fence();
        record.attempt = 1;
        record.created_at = now;
        record.lease_until = now + options.lease.value_or(impl_->options.default_lease);
        record.expires_at = now + options.retention.value_or(impl_->options.default_retention);
        ++impl_->stats.claims_won;
        return Claim{ClaimStatus::claimed, record.fence, std::nullopt, {}};
    }
    Claim claim{classify(record, fp), 0, record, {}};
    if (claim.status == ClaimStatus::in_progress) {
        claim.retry_after = detail::retry_after_hint(record.lease_until, now, impl_->options.max_retry_after);
    }
    return claim;
}

void MemoryStore::save(const Key& key, Fence fence, std::string_view result) {
    if (result.size() > impl_->options.max_result_bytes) {
        throw response_too_large("idem: result of " + std::to_string(result.size()) +
                                     " bytes exceeds max_result_bytes " +
                                     std::to_string(impl_->options.max_result_bytes),
                                 std::string(result));
    }
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.saves;
    ++impl_->stats.round_trips;
    Record& record = impl_->owned(key, fence, "save");
    record.state = RecordState::completed;
    record.result = std::string(result);
}

void MemoryStore::release(const Key& key, Fence fence) {
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.releases;
    ++impl_->stats.round_trips;
    impl_->owned(key, fence, "release");
    impl_->records.erase(Impl::id(key));
}

std::optional<Record> MemoryStore::read(const Key& key) {
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.reads;
    ++impl_->stats.round_trips;
    auto it = impl_->records.find(Impl::id(key));
    if (it == impl_->records.end()) return std::nullopt;
    return it->second;
}

StoreStats MemoryStore::stats() const {
    std::lock_guard lock(impl_->mutex);
    return impl_->stats;
}

std::size_t MemoryStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

std::size_t MemoryStore::size() const {
    std::lock_guard lock(impl_->mutex);
    return impl_->records.size();
}

}  // namespace idem

namespace idem {

std::vector<StaleKey> MemoryStore::list_stale(std::size_t limit) {
    const auto now = std::chrono::system_clock::now();
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.reads;
    ++impl_->stats.round_trips;
    std::vector<StaleKey> stale;
    for (const auto& [id, record] : impl_->records) {
        if (record.state == RecordState::in_progress && record.lease_until < now) {
            stale.push_back(StaleKey{Key(id.first, id.second), record});
        }
    }
    std::sort(stale.begin(), stale.end(), [](const StaleKey& a, const StaleKey& b) {
        return a.record.lease_until < b.record.lease_until;
    });
    if (stale.size() > limit) stale.erase(stale.begin() + static_cast<std::ptrdiff_t>(limit), stale.end());
    return stale;
}

}  // namespace idem
