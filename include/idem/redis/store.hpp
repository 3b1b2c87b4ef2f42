// idem/redis/store.hpp — the Redis backend (component idem::redis, hiredis), with its connection pool.
//
//   idem::RedisStore store{{.unix_socket = "/run/redis/redis.sock"}};   // needs appendfsync always
//   auto r = idem::execute_once(store, key, fp, fn);
//
// Each key is one Redis hash; every step is one Lua script that reads and writes it atomically
// (Redis runs a script alone), so the database arbitrates every claim exactly as PostgreSQL's unique
// key does:
// * Claim: one script, one round trip. It creates the record (fingerprint, a fresh fence chosen by
//   the client, lease, retention) if the key is absent or its completed record has expired, and
//   otherwise returns the record found, classified like every store's (completed / in_progress /
//   mismatch). A new request costs 2 round trips (claim, save), a replay / in-progress / mismatch 1.
// * Every later write (save, release, extend_lease, record_phase, take_over) is a compare-and-set
//   script on the fence: a fence that no longer owns the key gets lease_lost and changes nothing,
//   so an owner paused past its lease (GC, SIGSTOP) whose key was taken over cannot save.
// * Time is Redis's own clock (TIME inside the scripts), so leases and expiry do not depend on the
//   clients' clocks.
// * A completed record expires by itself when its retention passes (PEXPIREAT); purge_expired has
//   nothing to delete and returns 0. An in-progress record never expires: its outcome is unknown
//   until someone resolves it. In-progress records are indexed by lease end in one sorted set (kept
//   by the same scripts), which list_stale reads for the Reconciler.
// * Reconnect-safe: a call whose connection broke, or whose answer did not come within
//   command_timeout, is sent again once on a fresh connection with the same fence; the scripts
//   recognise their own earlier write (a claim finds its own fence, a save its own result).
// * A save rides out an outage: save and save_batch, whose effect has already run, keep trying
//   while Redis cannot be reached or the connection breaks, for RedisOptions::save_retry_window
//   (then response_not_saved from execute_once, the key left in progress). Every other call that
//   cannot connect is store_unavailable at once.
// * Fail closed: a Redis error, refusal or timeout is store_unavailable (or config_error for what
//   retrying cannot heal) and execute_once does not call fn.
// * Batches: claim_batch / save_batch pipeline one script per key in one round trip. Each key is
//   atomic on its own; a batch is not all or nothing.
// * Waiting (ClaimOptions::wait): polls the key, 20 ms doubling to 200 ms, until the wait ends.
//
// Durability — what an acknowledged claim or save survives depends on the server, not on idem:
// * appendonly yes + appendfsync always, one node: Redis fsyncs the write before it answers, so an
//   acknowledged claim or save survives kill -9 and power loss. This is the only configuration
//   with PostgresStore's guarantee, and the default requirement (RedisDurability::fsync_always).
// * appendfsync everysec: up to about one second of acknowledged writes (two, when the disk is
//   slow) can be lost when the machine (or, on a stalled disk, the process) dies. A lost claim
//   means the effect can run twice. RedisDurability::fsync_everysec accepts it knowingly.
// * No AOF (RDB snapshots only, or nothing): everything since the last snapshot is lost on a crash.
// * Replicas and failover: replication is asynchronous, so a failover can lose writes the old
//   primary acknowledged. RedisOptions::wait_replicas sends WAIT after each write, which narrows the
//   window (the write reached that many replicas before the answer) but does not close it: Redis
//   is not strongly consistent, and a promoted replica may still miss it.
// * Eviction: a server whose maxmemory-policy may evict keys (anything but noeviction) would drop
//   claims and stored results under memory pressure, and the next call would run the effect again.
// The store checks each new connection's server (CONFIG GET appendonly / appendfsync /
// no-appendfsync-on-rewrite / maxmemory-policy, INFO replication) against RedisOptions::durability
// and refuses with config_error what cannot keep that promise: too little persistence, fsync
// skipped during rewrites, an evicting policy, a server that forbids CONFIG — unless durability is
// `unchecked`. With noeviction a full server refuses writes (OOM), which is store_unavailable: fail
// closed. A replica (role:slave) is refused with store_unavailable whatever the durability: it
// may lag, and a writable one would arbitrate keys apart from its primary; a user that may not run
// INFO is refused with config_error whatever the durability (the role could not be seen: grant
// +info). Settings are checked when a connection opens: a CONFIG SET on a running server is seen
// by the next new connection. Replicas without wait_replicas are reported once through the
// observer (Event::reconcile_failed is not used for it: see RedisStore::warnings()).
//
// Not supported: Redis Cluster (a script touches a record and the shared index: two hash slots).
//
// Errors: config_error — bad options (constructor), authentication refused, a server whose
// persistence cannot keep the durability asked for, CONFIG (unless unchecked), INFO or the scripts
// refused, keys outside the ACL user's key patterns (NOPERM: the message names key_prefix);
// store_unavailable — no connection, timeouts, a server loading or read-only (a replica),
// out of memory; lease_lost, response_too_large, corrupt_record (a hash idem did not write).
// Thread-safety: all members may be called concurrently; the pool hands each call its own
// connection. fork(): as PostgresStore, a store belongs to the process that made it (in a child
// every call throws config_error).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/fingerprint_secret.hpp"
#include "idem/sealing.hpp"
#include "idem/store.hpp"

namespace idem {

/// What a RedisStore requires of the server's persistence before it uses a connection.
enum class RedisDurability {
    /// appendonly yes and appendfsync always: an acknowledged write survives a crash (the default).
    /// Every checked level also requires maxmemory-policy noeviction.
    fsync_always,
    /// appendonly yes, appendfsync always or everysec: up to ~1 s of acknowledged writes may be
    /// lost in a crash, and with them the exactly-once promise for those keys.
    fsync_everysec,
    /// Anything, and the check is not made (CONFIG may be forbidden): the operator vouches for the
    /// server's persistence and its maxmemory-policy (noeviction). For tests, and for managed
    /// services whose configuration is known some other way.
    unchecked,
};

/// Connection, pool and record settings of a RedisStore.
struct RedisOptions {
    /// TCP host and port; ignored when unix_socket is set.
    std::string host = "127.0.0.1";
    /// TCP port.
    int port = 6379;
    /// Path of the server's unix socket; when set, host and port are not used.
    std::string unix_socket{};
    /// ACL user (Redis 6+): when set, every connection authenticates as it (`AUTH username
    /// password`, also with an empty password, for a user made with `nopass`); empty with a
    /// password means the default user.
    std::string username{};
    /// Password for AUTH; empty with no username sends no AUTH. Never appears in an error message.
    std::string password{};
    /// Logical database (SELECT), 0 to 15 on a default server.
    int database = 0;
    /// Prefix of every Redis key this store writes: records are `<prefix>r:<scope length>:<scope><key>`,
    /// the index of in-progress keys is `<prefix>in_progress`. Two stores with one prefix share data.
    std::string key_prefix = "idem:";
    /// Maximum number of open connections.
    std::size_t pool_size = 8;
    /// How long a caller waits for a free pooled connection (then pool_timeout).
    std::chrono::milliseconds pool_wait{std::chrono::seconds(5)};
    /// Bound on connecting (and authenticating) to the server.
    std::chrono::milliseconds connect_timeout{std::chrono::seconds(2)};
    /// Bound on each wait for an answer; past it the call is store_unavailable (the write may have
    /// happened: a claim then stays in progress with a fence nobody holds, for the reconciler).
    std::chrono::milliseconds command_timeout{std::chrono::seconds(2)};
    /// How long a save (and save_batch) keeps retrying while Redis is unreachable (restart,
    /// failover) or its connection breaks: the effect already happened, and a fenced save is safe
    /// to repeat. Past it: response_not_saved. 0: one resend after a broken connection, as every
    /// other call.
    std::chrono::milliseconds save_retry_window{std::chrono::seconds(15)};
    /// Lease of a claim when ClaimOptions::lease is not set.
    std::chrono::milliseconds default_lease{std::chrono::seconds(30)};
    /// Retention of a completed record when ClaimOptions::retention is not set.
    std::chrono::seconds default_retention{std::chrono::hours(24)};
    /// Upper bound of the retry-after hint of an in_progress answer.
    std::chrono::milliseconds max_retry_after{std::chrono::seconds(1)};
    /// Largest result save() accepts, in bytes (Redis itself accepts up to 512 MiB per value).
    std::size_t max_result_bytes = 16u << 20;
    /// The persistence the server must have (checked on every new connection, see the header).
    RedisDurability durability = RedisDurability::fsync_always;
    /// With replicas: after each write, WAIT until this many replicas have it (0: do not wait). A
    /// write not acknowledged by them within wait_replicas_timeout is store_unavailable (it may
    /// exist on the primary: a claim then stays in progress, for the reconciler).
    int wait_replicas = 0;
    /// Bound of each WAIT.
    std::chrono::milliseconds wait_replicas_timeout{std::chrono::milliseconds(500)};
    /// Sealed responses (idem/sealing.hpp, opt-in): results are stored in Redis encrypted and
    /// authenticated under the keyring, and opened as they are read back; a result that does not
    /// open is corrupt_record. max_result_bytes bounds the result before sealing.
    SealingOptions sealing{};
    /// Keyed fingerprints at rest (opt-in; idem/fingerprint_secret.hpp): new records keep
    /// HMAC-SHA256 under this secret (fa 2) instead of the plain SHA-256, so whoever reads the
    /// keys, an RDB or an AOF cannot confirm guesses of low-entropy requests. Found records are
    /// compared by their own algorithm (the claim script's resume check included), so records
    /// written before the secret was set still replay. Without it, a keyed record is
    /// config_error. Rotating: keep the old secret until its records have expired.
    std::optional<FingerprintSecret> fingerprint_secret{};
};

/// The IdempotencyStore contract over Redis 7 (see the top of this header).
class RedisStore final : public IdempotencyStore {
public:
    /// Checks the options (config_error) and connects nothing yet: the first call opens the first
    /// connection, and checks the server's persistence then.
    explicit RedisStore(RedisOptions options = {});
    ~RedisStore() override;
    RedisStore(const RedisStore&) = delete;
    RedisStore& operator=(const RedisStore&) = delete;

    /// Claims `key` (one script, one round trip); see IdempotencyStore::claim.
    [[nodiscard]] Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) override;
    /// One pipelined round trip for all keys; each claim atomic on its own.
    [[nodiscard]] std::vector<Claim> claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                                 const ClaimOptions& options = {}) override;
    /// Completes the key if `fence` still owns it; the record then expires with its retention.
    void save(const Key& key, Fence fence, std::string_view result) override;
    /// One pipelined round trip for all saves.
    [[nodiscard]] std::vector<SaveStatus> save_batch(std::span<const SaveRequest> saves) override;
    /// Deletes the in-progress record `fence` owns.
    void release(const Key& key, Fence fence) override;
    /// Moves the lease end of the record `fence` owns to now + `lease` (Redis's clock).
    void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) override;
    /// Stores the phase and its data on the record `fence` owns.
    void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) override;
    /// Takes over a stale in-progress key whose fence is still `stale_fence`.
    [[nodiscard]] std::optional<Fence> take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                 bool new_attempt) override;
    /// The record of `key`, if any. An expired completed record is gone (Redis deleted it).
    [[nodiscard]] std::optional<Record> read(const Key& key) override;
    /// Reads the index of in-progress keys by lease end; the scope filter is applied by the script,
    /// so a prefix that matches few of many stale keys costs a walk over them.
    [[nodiscard]] std::vector<StaleKey> list_stale(std::size_t limit,
                                                   const ScopeFilter& scopes = ScopeFilter::all()) override;
    /// Returns 0: Redis deletes expired completed records itself.
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    /// Counters since the store was made (round_trips counts pipelined scripts once).
    [[nodiscard]] StoreStats stats() const override;
    /// RedisOptions::max_result_bytes.
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;
    /// `fp` keyed with RedisOptions::fingerprint_secret, or `fp` without one.
    [[nodiscard]] Fingerprint key_fingerprint(const Fingerprint& fp) const override;

    /// What the persistence check found that the store accepted but an operator should know (e.g.
    /// "2 replicas and wait_replicas = 0: a failover can lose acknowledged writes"), once per server
    /// run. Empty before the first connection.
    [[nodiscard]] std::vector<std::string> warnings() const;

    /// The options the store was made with.
    [[nodiscard]] const RedisOptions& options() const noexcept;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace idem
