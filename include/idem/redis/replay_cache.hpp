// idem/redis/replay_cache.hpp — RedisReplayCache: completed records kept in Redis, shared by every
// instance of a service, as a ReplayTier in front of a primary store (component idem::redis).
//
//   idem::PostgresStore primary{conninfo};
//   idem::RedisReplayCacheOptions cache_options;
//   cache_options.connection.unix_socket = "/run/redis/redis.sock";
//   idem::CachedStore store{primary, {std::make_shared<idem::ReplayCache>(),
//                                     std::make_shared<idem::RedisReplayCache>(cache_options)}};
//
// * A cache, not a store: the primary (PostgreSQL) arbitrates every claim and holds every record;
//   this tier only answers replays of completed records. An entry is written after the primary
//   answered with a completed record (never before, never for an in-progress one), and lives in
//   Redis with a TTL of the retention the record had left as the primary stated it
//   (expires_at - read_at, less the time since the primary was asked), so it never outlives the
//   record. The fingerprint is checked on every hit (by CachedStore): mismatch stays mismatch.
// * Sealed entries: each entry names the tier's key prefix, its key (scope and value) and the
//   request fingerprint it answers, and carries an HMAC-SHA256 under entry_secret over a
//   versioned, length-prefixed encoding of them and the record (without a secret, a SHA-256
//   checksum). An entry whose MAC does not verify, that names another key or another key prefix
//   (copied from a deployment sharing the Redis, even under the same secret), or of an unknown
//   format (including entries of an earlier idem's format) is a miss, counted in
//   stats().untrusted and deleted: the primary answers and the tier refills. Only a secret stops whoever can write to
//   the Redis from making the tier replay a response idem never produced; the checksum detects corruption and copied
//   entries.
// * Sealed expiry: a TTL is whatever a writer to the Redis sets, so an entry whose sealed expires_at
//   has passed by this host's system clock is untrusted too (a miss, counted, deleted), and a hit
//   states no more time left than its sealed expires_at leaves. No clock skew is allowed for: a
//   host whose clock is ahead of the primary's ends entries early (misses), one behind keeps them
//   at most that much longer.
// * Fails open to the primary: a Redis error, refusal or timeout (command_timeout, small by
//   default) is a miss and the call goes to the primary, which gives the true answer — a slow or
//   dead cache costs latency, never a second effect. After a Redis error or timeout the tier
//   answers misses without asking Redis for pause_after_error, so a dead Redis does not add a
//   timeout to every call (erase() still asks). An untrusted entry is a miss and is deleted (no
//   pause); every pooled connection busy is a miss (no pause). Errors are counted (stats()), not
//   thrown.
// * Persistence is not needed (a lost entry is a miss): the server's durability is not checked.
// * Staleness: an operator who deletes or edits a completed row in the primary by hand must also
//   delete its entry here (CachedStore::forget, or DEL of `<key_prefix>c:<scope length>:<scope><key>`),
//   or replays keep coming from the cache until the entry's TTL ends.
//
// Thread-safety: every member may be called from any number of threads at once (a pool of
// connections, connection.pool_size of them).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "idem/redis/store.hpp"
#include "idem/replay_tier.hpp"

namespace idem {

/// Settings of a RedisReplayCache.
struct RedisReplayCacheOptions {
    /// Where Redis is and how to talk to it: host / port / unix_socket, username / password,
    /// database, key_prefix (entries are `<key_prefix>c:…`), pool_size, pool_wait, connect_timeout
    /// and command_timeout are used, and sealing.keyring: when set, every entry is sealed under it
    /// (AES-256-GCM, idem/sealing.hpp): nothing of the record or the fingerprint is readable in
    /// an entry's value — the entry's Redis key name still holds the idempotency key's scope and
    /// value in plain text (`<key_prefix>c:<scope length>:<scope><key>`; docs/security.md) — and
    /// the GCM tag authenticates the entry in entry_secret's place (an entry
    /// that does not open is a miss, stats().untrusted). durability, wait_replicas and the record
    /// settings are not used.
    /// The defaults here are a cache's: short timeouts (a miss is cheaper than a wait).
    RedisOptions connection = cache_connection_defaults();
    /// After a Redis error or timeout, how long the tier answers misses without asking Redis.
    std::chrono::milliseconds pause_after_error{std::chrono::seconds(1)};
    /// Records larger than this (result, phase data and key together) are not kept.
    std::size_t max_entry_bytes = 1u << 20;
    /// The key of the HMAC-SHA256 that seals every entry: empty, or at least
    /// min_entry_secret_bytes of secret (e.g. 32 random bytes), the same on every instance that
    /// shares the entries. Each entry names the key prefix, its key and the request fingerprint it
    /// answers, and carries a MAC over them and the record; an entry whose MAC does not verify,
    /// that names another key or key prefix, or of another format is a miss (stats().untrusted),
    /// answered by the primary.
    /// Empty: entries carry a SHA-256 checksum instead, which catches corruption and entries
    /// copied into another key's slot, but not forgery — whoever can write to this Redis can then
    /// make the tier replay a response idem never produced. Set it wherever anyone but idem can
    /// write to the Redis. Changing it turns the entries in Redis into misses: the tier refills
    /// from the primary. The tier keeps its own copy and never shows it in an error.
    std::string entry_secret{};

    /// The shortest non-empty entry_secret accepted.
    static constexpr std::size_t min_entry_secret_bytes = 32;

    /// RedisOptions with a cache's timeouts: connect 200 ms, each answer 50 ms, pool wait 50 ms.
    [[nodiscard]] static RedisOptions cache_connection_defaults() {
        RedisOptions o;
        o.connect_timeout = std::chrono::milliseconds(200);
        o.command_timeout = std::chrono::milliseconds(50);
        o.pool_wait = std::chrono::milliseconds(50);
        return o;
    }
};

/// Counters since the tier was made.
struct RedisReplayCacheStats {
    std::uint64_t hits = 0;      ///< finds answered from Redis
    std::uint64_t misses = 0;    ///< not there, expired, or not asked (paused after an error)
    std::uint64_t inserts = 0;   ///< records kept
    std::uint64_t rejected = 0;  ///< not kept: not completed, no read_at, no retention left, too large
    std::uint64_t errors = 0;    ///< Redis errors and timeouts, every pooled connection busy
    std::uint64_t skipped = 0;   ///< calls answered as misses during a pause after an error
    /// Entries found but not answered (each a miss, and deleted): a MAC (or checksum) that does not
    /// verify, another key or key prefix named, truncated, of another format (an earlier idem's,
    /// or not idem's), or a sealed expires_at already passed (a TTL set past it). Anything but zero
    /// with entry_secret set means that something other than this tier wrote to its keys, or that
    /// instances disagree on the secret or the key prefix.
    std::uint64_t untrusted = 0;
};

/// A ReplayTier in Redis (see the top of this header).
class RedisReplayCache final : public ReplayTier {
public:
    /// Checks the options (config_error) and connects nothing yet.
    explicit RedisReplayCache(RedisReplayCacheOptions options = {});
    ~RedisReplayCache() override;
    RedisReplayCache(const RedisReplayCache&) = delete;
    RedisReplayCache& operator=(const RedisReplayCache&) = delete;

    /// GET and PTTL of the entry in one round trip; nullptr on a miss or any failure.
    [[nodiscard]] std::shared_ptr<const Record> find(const Key& key) override;
    /// SET with PX of the retention left; false when not kept or on any failure.
    bool insert(const Key& key, const Record& record, time_point asked_at) override;
    /// DEL of the entry, also during a pause after an error; false when there was none or on a
    /// failure (stats().errors tells them apart).
    bool erase(const Key& key) override;
    /// std::chrono::steady_clock::now().
    [[nodiscard]] time_point now() const override;
    /// true: a hit's read_at is set from the entry's TTL, never past its sealed expires_at.
    [[nodiscard]] bool states_time_left() const noexcept override { return true; }

    /// Counters since the tier was made.
    [[nodiscard]] RedisReplayCacheStats stats() const noexcept;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace idem
