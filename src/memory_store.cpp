#include "idem/memory_store.hpp"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <utility>

#include "idem/errors.hpp"
#include "process.hpp"
#include "store_rules.hpp"

namespace idem {

using Clock = std::chrono::system_clock;

struct MemoryStore::Impl {
    MemoryStoreOptions options;
    mutable std::mutex mutex;
    std::condition_variable saved;  // wakes waiters (ClaimOptions::wait) on every save/release
    std::map<std::pair<std::string, std::string>, Record> records;
    StoreStats stats;

    static std::pair<std::string, std::string> id(const Key& key) { return {key.scope(), key.value()}; }

    [[nodiscard]] Clock::time_point now() const { return options.clock(); }

    // The record as a reader sees it now: lease/expiry flags computed from the clock.
    static Record view(Record record, Clock::time_point now) {
        record.lease_expired = record.state == RecordState::in_progress && record.lease_until < now;
        record.expired = record.state == RecordState::completed && record.expires_at < now;
        record.read_at = now;
        return record;
    }

    // Finds the in-progress record `fence` owns, or throws lease_lost. Caller holds the mutex.
    Record& owned(const Key& key, Fence fence, const char* what) {
        auto it = records.find(id(key));
        if (it == records.end() || it->second.fence != fence || it->second.state != RecordState::in_progress) {
            throw lease_lost(std::string("idem: ") + what + " refused: the fence no longer owns the key");
        }
        return it->second;
    }

    Fence fresh_claim(Record& record, const Fingerprint& fp, const ClaimOptions& o, Clock::time_point now) {
        Record fresh;
        fresh.state = RecordState::in_progress;
        fresh.fingerprint = fp.stored();  // not the plain digest a keyed one carries
        fresh.fence = detail::new_fence();
        fresh.attempt = 1;
        fresh.created_at = now;
        fresh.lease_until = now + o.lease.value_or(options.default_lease);
        fresh.expires_at = now + o.retention.value_or(options.default_retention);
        record = std::move(fresh);
        ++stats.claims_won;
        return record.fence;
    }
};

MemoryStore::MemoryStore(MemoryStoreOptions options) : impl_(std::make_unique<Impl>()) {
    impl_->options = std::move(options);
    if (!impl_->options.clock) impl_->options.clock = [] { return Clock::now(); };
}

MemoryStore::~MemoryStore() = default;

Fingerprint MemoryStore::key_fingerprint(const Fingerprint& fp) const {
    return detail::keyed(impl_->options.fingerprint_secret, fp);
}

Claim MemoryStore::claim(const Key& key, const Fingerprint& plain, const ClaimOptions& options) {
    Impl& m = *impl_;
    const Fingerprint fp = key_fingerprint(plain);
    std::unique_lock lock(m.mutex);
    ++m.stats.claims;
    ++m.stats.round_trips;
    // The wait is real time (steady), not the store's clock: an injected clock may stand still.
    const auto wait_until = std::chrono::steady_clock::now() + options.wait;
    for (;;) {
        const auto now = m.now();
        auto [it, inserted] = m.records.try_emplace(Impl::id(key));
        Record& record = it->second;
        if (inserted || (record.state == RecordState::completed && record.expires_at < now)) {
            const Fence fence = m.fresh_claim(record, fp, options, now);
            return Claim{ClaimStatus::claimed, fence, std::nullopt, {}};
        }
        Claim claim{claim_status(record, fp), 0, Impl::view(record, now), {}};
        if (claim.status != ClaimStatus::in_progress) return claim;
        if (options.resume_stale && record.lease_until < now) {
            const Fence stale = record.fence;
            record.fence = detail::new_fence();
            ++record.attempt;
            record.lease_until = now + options.lease.value_or(m.options.default_lease);
            ++m.stats.claims_won;
            emit(Event::taken_over, &key);
            return Claim{ClaimStatus::claimed, record.fence, Impl::view(record, now), {}, stale};
        }
        if (std::chrono::steady_clock::now() >= wait_until) {
            claim.retry_after = detail::retry_after_hint(record.lease_until, now, m.options.max_retry_after);
            return claim;
        }
        m.saved.wait_until(lock, wait_until);  // then look again
    }
}

void MemoryStore::save(const Key& key, Fence fence, std::string_view result) {
    detail::check_result_size(result, impl_->options.max_result_bytes);
    {
        std::lock_guard lock(impl_->mutex);
        ++impl_->stats.saves;
        ++impl_->stats.round_trips;
        Record& record = impl_->owned(key, fence, "save");
        record.state = RecordState::completed;
        record.result = std::string(result);
    }
    impl_->saved.notify_all();
}

void MemoryStore::release(const Key& key, Fence fence) {
    {
        std::lock_guard lock(impl_->mutex);
        ++impl_->stats.releases;
        ++impl_->stats.round_trips;
        impl_->owned(key, fence, "release");
        impl_->records.erase(Impl::id(key));
    }
    impl_->saved.notify_all();
}

void MemoryStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.round_trips;
    impl_->owned(key, fence, "extend_lease").lease_until = impl_->now() + lease;
}

void MemoryStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.round_trips;
    Record& record = impl_->owned(key, fence, "record_phase");
    record.phase = std::string(phase);
    record.phase_data = std::string(data);
}

std::optional<Fence> MemoryStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                            bool new_attempt) {
    const auto now = impl_->now();
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.round_trips;
    auto it = impl_->records.find(Impl::id(key));
    if (it == impl_->records.end()) return std::nullopt;
    Record& record = it->second;
    if (record.state != RecordState::in_progress || record.fence != stale_fence || record.lease_until >= now) {
        return std::nullopt;
    }
    record.fence = detail::new_fence();
    record.lease_until = now + lease;
    if (new_attempt) ++record.attempt;
    emit(Event::taken_over, &key);
    return record.fence;
}

std::optional<Record> MemoryStore::read(const Key& key) {
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.reads;
    ++impl_->stats.round_trips;
    auto it = impl_->records.find(Impl::id(key));
    if (it == impl_->records.end()) return std::nullopt;
    return Impl::view(it->second, impl_->now());
}

std::vector<StaleKey> MemoryStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    const auto now = impl_->now();
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.reads;
    ++impl_->stats.round_trips;
    std::vector<StaleKey> stale;
    for (const auto& [id, record] : impl_->records) {
        if (record.state == RecordState::in_progress && record.lease_until < now && scopes.matches(id.first)) {
            stale.push_back(StaleKey{Key(id.first, id.second), Impl::view(record, now)});
        }
    }
    std::sort(stale.begin(), stale.end(),
              [](const StaleKey& a, const StaleKey& b) { return a.record.lease_until < b.record.lease_until; });
    if (stale.size() > limit) stale.erase(stale.begin() + static_cast<std::ptrdiff_t>(limit), stale.end());
    return stale;
}

std::size_t MemoryStore::count_stale(const ScopeFilter& scopes) {
    const auto now = impl_->now();
    std::lock_guard lock(impl_->mutex);
    ++impl_->stats.reads;
    ++impl_->stats.round_trips;
    return static_cast<std::size_t>(std::count_if(impl_->records.begin(), impl_->records.end(), [&](const auto& entry) {
        const auto& [id, record] = entry;
        return record.state == RecordState::in_progress && record.lease_until < now && scopes.matches(id.first);
    }));
}

std::size_t MemoryStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    const auto now = impl_->now();
    std::size_t deleted = 0;
    {
        std::lock_guard lock(impl_->mutex);
        const std::size_t bound =
            batch_size * std::min<std::size_t>(max_batches, SIZE_MAX / std::max<std::size_t>(batch_size, 1));
        for (auto it = impl_->records.begin(); it != impl_->records.end() && deleted < bound;) {
            if (it->second.state == RecordState::completed && it->second.expires_at < now) {
                it = impl_->records.erase(it);
                ++deleted;
            } else {
                ++it;
            }
        }
    }
    if (deleted > 0) emit(Event::purged, nullptr, {}, deleted);
    return deleted;
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
