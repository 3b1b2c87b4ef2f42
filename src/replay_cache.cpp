#include "idem/replay_cache.hpp"

#include <algorithm>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "idem/errors.hpp"

namespace idem {
namespace {

using SteadyClock = std::chrono::steady_clock;

// Bookkeeping charged to every entry on top of its strings: list and map nodes, the Record and its
// shared_ptr control block. An estimate, so that many tiny entries cannot exceed max_bytes by much.
constexpr std::size_t kEntryOverhead = 256;
// A longer stated retention is treated as this long (keeps the steady-clock sum from overflowing).
constexpr auto kLongest = std::chrono::hours(24 * 366 * 100);

// The map's key: views into the Key held by the entry itself (or, for a lookup, the caller's Key),
// so a hit allocates nothing.
struct IdView {
    std::string_view scope, value;
    friend bool operator==(const IdView&, const IdView&) = default;
};

struct IdHash {
    std::size_t operator()(const IdView& id) const noexcept {
        const std::size_t a = std::hash<std::string_view>{}(id.scope);
        const std::size_t b = std::hash<std::string_view>{}(id.value);
        return a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
    }
};

struct Entry {
    Key key;
    std::shared_ptr<const Record> record;
    SteadyClock::time_point expires;
    std::size_t bytes;
};

struct Shard {
    std::mutex mutex;
    std::list<Entry> lru;  // most recently used first
    std::unordered_map<IdView, std::list<Entry>::iterator, IdHash> index;
    std::size_t bytes = 0;
    std::uint64_t hits = 0, misses = 0, inserts = 0, evictions = 0, rejected = 0;

    // Caller holds the mutex.
    void remove(std::list<Entry>::iterator it) {
        index.erase(IdView{it->key.scope(), it->key.value()});
        bytes -= it->bytes;
        lru.erase(it);
    }
};

std::size_t entry_bytes(const Key& key, const Record& r) {
    return kEntryOverhead + key.scope().size() + key.value().size() + r.fingerprint.bytes().size() +
           (r.result ? r.result->size() : 0) + (r.phase ? r.phase->size() : 0) +
           (r.phase_data ? r.phase_data->size() : 0);
}

}  // namespace

struct ReplayCache::Impl {
    ReplayCacheOptions options;
    std::size_t shard_budget = 0;
    std::vector<Shard> shards;

    Shard& shard_of(const IdView& id) { return shards[IdHash{}(id) % shards.size()]; }
};

ReplayCache::ReplayCache(ReplayCacheOptions options) : impl_(std::make_unique<Impl>()) {
    if (options.max_bytes == 0 || options.max_bytes > (std::size_t{1} << 40)) {
        throw config_error("idem: ReplayCacheOptions::max_bytes must be between 1 and 2^40, got " +
                           std::to_string(options.max_bytes));
    }
    if (options.shards == 0 || options.shards > 4096) {
        throw config_error("idem: ReplayCacheOptions::shards must be between 1 and 4096, got " +
                           std::to_string(options.shards));
    }
    if (options.max_bytes / options.shards < 1024) {
        throw config_error("idem: ReplayCacheOptions::max_bytes / shards must be at least 1 KiB, got " +
                           std::to_string(options.max_bytes) + " / " + std::to_string(options.shards));
    }
    if (!options.clock) options.clock = [] { return SteadyClock::now(); };
    impl_->shard_budget = options.max_bytes / options.shards;
    impl_->shards = std::vector<Shard>(options.shards);
    impl_->options = std::move(options);
}

ReplayCache::~ReplayCache() = default;

ReplayCache::time_point ReplayCache::now() const { return impl_->options.clock(); }

const ReplayCacheOptions& ReplayCache::options() const noexcept { return impl_->options; }

std::shared_ptr<const Record> ReplayCache::find(const Key& key) {
    const IdView id{key.scope(), key.value()};
    Shard& s = impl_->shard_of(id);
    const auto now = impl_->options.clock();  // outside the lock: it may be slow or contended
    std::lock_guard lock(s.mutex);
    const auto found = s.index.find(id);
    if (found == s.index.end()) {
        ++s.misses;
        return nullptr;
    }
    const auto it = found->second;
    if (it->expires <= now) {  // retention (as the store stated it) has passed: never served
        s.remove(it);
        ++s.misses;
        return nullptr;
    }
    s.lru.splice(s.lru.begin(), s.lru, it);
    ++s.hits;
    return it->record;
}

bool ReplayCache::insert(const Key& key, const Record& record, time_point asked_at) {
    const IdView id{key.scope(), key.value()};
    Shard& s = impl_->shard_of(id);
    const auto reject = [&s] {
        std::lock_guard lock(s.mutex);
        ++s.rejected;
        return false;
    };
    // Only what cannot change before its retention passes, and only when the store said how much
    // retention is left by its own clock (read_at): the local clock never stretches an entry.
    if (record.state != RecordState::completed || !record.result || record.expired ||
        record.read_at == std::chrono::system_clock::time_point{} || record.expires_at <= record.read_at) {
        return reject();
    }
    const auto left = std::min<std::chrono::system_clock::duration>(record.expires_at - record.read_at, kLongest);
    const auto expires = asked_at + std::chrono::duration_cast<SteadyClock::duration>(left);
    const std::size_t bytes = entry_bytes(key, record);
    if (bytes > impl_->shard_budget || expires <= impl_->options.clock()) return reject();

    auto copy = std::make_shared<Record>(record);
    copy->lease_expired = false;
    Entry entry{key, std::move(copy), expires, bytes};
    std::lock_guard lock(s.mutex);
    if (const auto old = s.index.find(id); old != s.index.end()) s.remove(old->second);
    s.lru.push_front(std::move(entry));
    const auto it = s.lru.begin();
    s.index.emplace(IdView{it->key.scope(), it->key.value()}, it);
    s.bytes += bytes;
    ++s.inserts;
    while (s.bytes > impl_->shard_budget) {
        s.remove(std::prev(s.lru.end()));
        ++s.evictions;
    }
    return true;
}

bool ReplayCache::erase(const Key& key) {
    const IdView id{key.scope(), key.value()};
    Shard& s = impl_->shard_of(id);
    std::lock_guard lock(s.mutex);
    const auto found = s.index.find(id);
    if (found == s.index.end()) return false;
    s.remove(found->second);
    return true;
}

void ReplayCache::clear() {
    for (Shard& s : impl_->shards) {
        std::lock_guard lock(s.mutex);
        s.index.clear();
        s.lru.clear();
        s.bytes = 0;
    }
}

ReplayCacheStats ReplayCache::stats() const {
    ReplayCacheStats total;
    for (Shard& s : impl_->shards) {
        std::lock_guard lock(s.mutex);
        total.hits += s.hits;
        total.misses += s.misses;
        total.inserts += s.inserts;
        total.evictions += s.evictions;
        total.rejected += s.rejected;
        total.entries += s.index.size();
        total.bytes += s.bytes;
    }
    return total;
}

}  // namespace idem
