#include "idem/redis/replay_cache.hpp"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <algorithm>
#include <atomic>

#include "cache_entry.hpp"
#include "connection.hpp"
#include "idem/errors.hpp"
#include "process.hpp"
#include "sealed_results.hpp"

namespace idem {

using redis::Connection;
using redis::Reply;
using redis::ReplyType;
using SysClock = std::chrono::system_clock;

namespace {

std::string entry_key(const std::string& prefix, const Key& key) {
    return fmt::format("{}c:{}:{}{}", prefix, key.scope().size(), key.scope(), key.value());
}

}  // namespace

struct RedisReplayCache::Impl {
    RedisReplayCacheOptions options;  // entry_secret emptied: the secret lives in `seal` only
    redis::EntrySeal seal;
    redis::Pool pool;
    std::atomic<std::int64_t> paused_until{0};  // steady ns; 0: not paused
    struct Counters {
        std::atomic<std::uint64_t> hits{0}, misses{0}, inserts{0}, rejected{0}, errors{0}, skipped{0}, untrusted{0};
    } counters;

    explicit Impl(RedisReplayCacheOptions o)
        : options(std::move(o)),
          seal(take_secret(options), options.connection.key_prefix, options.connection.sealing.keyring),
          pool(options.connection.pool_size, options.connection.pool_wait,
               [this] { return std::make_unique<Connection>(options.connection); }) {}

    static std::string take_secret(RedisReplayCacheOptions& o) {
        std::string secret = o.entry_secret;
        OPENSSL_cleanse(o.entry_secret.data(), o.entry_secret.size());
        o.entry_secret.clear();
        return secret;
    }

    static std::int64_t steady_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }

    bool paused() {
        const auto until = paused_until.load(std::memory_order_relaxed);
        if (until == 0 || steady_ns() >= until) return false;
        counters.skipped.fetch_add(1, std::memory_order_relaxed);
        return true;
    }

    void failed() {
        counters.errors.fetch_add(1, std::memory_order_relaxed);
        paused_until.store(
            steady_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(options.pause_after_error).count(),
            std::memory_order_relaxed);
    }

    // Runs `fn(conn)`; a failure is counted and gives `fallback`. A failure of Redis (an error, a
    // timeout, a lost connection) also pauses the tier; one of this process (every pooled
    // connection busy) does not: under a burst the tier would go off for everyone. `gated` calls
    // are skipped during a pause; erase() is not (a forget must reach Redis, or say it did not).
    template <class T, class Fn>
    T guarded(T fallback, bool gated, Fn&& fn) {
        if (gated && paused()) return fallback;
        try {
            auto lease = pool.acquire();
            try {
                return fn(*lease);
            } catch (...) {
                lease.discard();  // an answer may still be on its way: never reuse the connection
                throw;
            }
        } catch (const pool_timeout&) {
            counters.errors.fetch_add(1, std::memory_order_relaxed);
            return fallback;
        } catch (const std::exception&) {
            failed();
            return fallback;
        }
    }

    static void expect_ok(const Reply& reply) {
        if (redis::type_of(*reply) == ReplyType::error) {
            throw store_unavailable(std::string("idem: Redis cache: ") + std::string(redis::text_of(*reply)));
        }
    }
};

RedisReplayCache::RedisReplayCache(RedisReplayCacheOptions options) {
    const RedisOptions& c = options.connection;
    if (c.pool_size == 0) throw config_error("idem: RedisReplayCacheOptions: connection.pool_size must be at least 1");
    if (c.unix_socket.empty() && c.host.empty())
        throw config_error("idem: RedisReplayCacheOptions: set a host or unix_socket");
    if (c.key_prefix.empty())
        throw config_error("idem: RedisReplayCacheOptions: connection.key_prefix must not be empty");
    if (c.connect_timeout.count() <= 0 || c.command_timeout.count() <= 0) {
        throw config_error("idem: RedisReplayCacheOptions: timeouts must be positive");
    }
    if (options.pause_after_error.count() < 0)
        throw config_error("idem: RedisReplayCacheOptions: pause_after_error < 0");
    if (options.max_entry_bytes == 0) throw config_error("idem: RedisReplayCacheOptions: max_entry_bytes must be > 0");
    detail::check_sealing(options.connection.sealing);
    if (!options.entry_secret.empty() &&
        options.entry_secret.size() < RedisReplayCacheOptions::min_entry_secret_bytes) {
        throw config_error(fmt::format("idem: RedisReplayCacheOptions: entry_secret must be empty or at least {} bytes",
                                       RedisReplayCacheOptions::min_entry_secret_bytes));
    }
    impl_ = std::make_unique<Impl>(std::move(options));
}

RedisReplayCache::~RedisReplayCache() = default;

std::shared_ptr<const Record> RedisReplayCache::find(const Key& key) {
    Impl& m = *impl_;
    auto hit = m.guarded(std::shared_ptr<const Record>(), true, [&](Connection& conn) -> std::shared_ptr<const Record> {
        const std::string k = entry_key(m.options.connection.key_prefix, key);
        conn.append({"GET", k});
        conn.append({"PTTL", k});
        Reply value = conn.read("cache get");
        Reply ttl = conn.read("cache get");
        Impl::expect_ok(value);
        Impl::expect_ok(ttl);
        if (redis::type_of(*value) != ReplyType::string) return nullptr;
        const long long left_ms = redis::integer_of(*ttl);
        if (left_ms <= 0) return nullptr;  // expired between the two, or no TTL (not ours)
        // Not to be trusted: a miss, and it goes, so the primary's answer replaces it. Redis
        // itself is fine: no pause.
        auto untrusted = [&] {
            m.counters.untrusted.fetch_add(1, std::memory_order_relaxed);
            conn.append({"DEL", k});
            Impl::expect_ok(conn.read("cache del"));
            return nullptr;
        };
        std::shared_ptr<Record> record;
        try {
            record = std::make_shared<Record>(m.seal.open(key, redis::text_of(*value)));
        } catch (const corrupt_record&) {
            return untrusted();  // another format, altered, truncated, another secret, another key's
        }
        // The TTL is whatever a writer to Redis set; the sealed expires_at is the primary's. An
        // entry past it answers a key the primary may have forgotten, and a new request with that
        // key would be answered with the old bytes instead of running: not to be trusted, and it
        // goes. Measured by this host's clock, with no allowance: one ahead of the primary's ends
        // entries early (a miss, answered by the primary), one behind keeps them no longer than
        // the difference.
        const SysClock::time_point now = SysClock::now();
        if (record->expires_at <= now) return untrusted();
        // What is left now: Redis's TTL, never past the sealed expires_at.
        record->read_at = std::max<SysClock::time_point>(record->expires_at - std::chrono::milliseconds(left_ms), now);
        return record;
    });
    (hit ? m.counters.hits : m.counters.misses).fetch_add(1, std::memory_order_relaxed);
    return hit;
}

bool RedisReplayCache::insert(const Key& key, const Record& record, time_point asked_at) {
    Impl& m = *impl_;
    const bool stated = record.read_at != SysClock::time_point{};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>((record.expires_at - record.read_at) -
                                                                            (now() - asked_at));
    const std::size_t size = record.result.value_or(std::string()).size() +
                             record.phase_data.value_or(std::string()).size() + key.scope().size() + key.value().size();
    if (record.state != RecordState::completed || !record.result || !stated || record.expired || left.count() <= 0 ||
        size > m.options.max_entry_bytes) {
        m.counters.rejected.fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    std::string value;
    try {
        value = m.seal.seal(key, record);
    } catch (const std::exception&) {
        m.counters.errors.fetch_add(1, std::memory_order_relaxed);  // OpenSSL failed: not kept
        return false;
    }
    const bool kept = m.guarded(false, true, [&](Connection& conn) {
        conn.append(
            {"SET", entry_key(m.options.connection.key_prefix, key), value, "PX", std::to_string(left.count())});
        Reply reply = conn.read("cache set");
        Impl::expect_ok(reply);
        return true;
    });
    if (kept) m.counters.inserts.fetch_add(1, std::memory_order_relaxed);
    return kept;
}

bool RedisReplayCache::erase(const Key& key) {
    Impl& m = *impl_;
    return m.guarded(false, false, [&](Connection& conn) {
        conn.append({"DEL", entry_key(m.options.connection.key_prefix, key)});
        Reply reply = conn.read("cache del");
        Impl::expect_ok(reply);
        return redis::integer_of(*reply) > 0;
    });
}

ReplayTier::time_point RedisReplayCache::now() const { return std::chrono::steady_clock::now(); }

RedisReplayCacheStats RedisReplayCache::stats() const noexcept {
    const auto& c = impl_->counters;
    RedisReplayCacheStats s;
    s.hits = c.hits.load(std::memory_order_relaxed);
    s.misses = c.misses.load(std::memory_order_relaxed);
    s.inserts = c.inserts.load(std::memory_order_relaxed);
    s.rejected = c.rejected.load(std::memory_order_relaxed);
    s.errors = c.errors.load(std::memory_order_relaxed);
    s.skipped = c.skipped.load(std::memory_order_relaxed);
    s.untrusted = c.untrusted.load(std::memory_order_relaxed);
    return s;
}

}  // namespace idem
