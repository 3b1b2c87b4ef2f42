// idem/postgres_store.hpp — the PostgreSQL backend (libpq), with its connection pool.
//
//   idem::PostgresStore store{"host=/run/postgresql dbname=app", {.pool_size = 8}};
//   store.ensure_schema();
//
// * Claim: one round trip — a pipeline of `INSERT … ON CONFLICT DO NOTHING RETURNING` and a separate
//   `SELECT` under one Sync (the claim commits at the Sync, before claim() returns; the SELECT, a
//   statement of its own, takes a fresh snapshot that sees a conflicting session's commit). Save: one
//   round trip (UPDATE … WHERE fence).
//   A new request costs 2 round trips, a replay / in-progress / mismatch answer 1.
// * Group commit (group_commit, on by default): claim() and save() callers that find no pooled
//   connection free share one transaction — for claims an array INSERT and an array read, one
//   round trip, one commit; for saves one array UPDATE — instead of waiting for a connection each.
//   A caller that finds a connection free goes at once, alone, with the statements above (no
//   timer): with as many connections as concurrent callers nothing changes. Each caller keeps its
//   own fence, outcome and errors: a failure of the shared statement sends every member again
//   alone, with its fence (a member whose group committed before its answer was lost recognises
//   its row). docs/design.md, "Group commit". Stats: group_commit_stats().
// * Pool: at most pool_size connections, opened lazily; a caller waits up to pool_wait for one
//   (then pool_timeout). A connection idle longer than health_check_after is checked before use; one
//   that broke is discarded and the statement retried once on a fresh one, with the same fence.
// * Timeouts: connect_timeout (per host), statement_timeout (server side, and a client-side bound on
//   every wait for an answer), lock_timeout (how long a claim may wait on a concurrent uncommitted
//   claim of the same key; it then answers in_progress).
// * Prepared statements per connection by default; behind PgBouncer < 1.21 in transaction pooling
//   mode set prepared_statements=false and session_options=false (see docs/reliability.md).
//   ClaimOptions::wait works through one too: wait_strategy automatic sees the pooler and polls
//   the key instead of LISTENing (LISTEN/NOTIFY needs a session of its own).
// * Citus: distribute() shards the table by scope or key, inspect() reports the layout and the
//   settings the shards miss (lock_timeout on the role). Where Citus is installed a claim runs in
//   an explicit BEGIN … COMMIT (same round trip); on a distributed table batches and groups send
//   one segment per shard, each committed on its own (no two-phase commit, so not all or nothing
//   across shards), and purge_expired does without SKIP LOCKED. docs/scale-out.md.
// * synchronous_commit is left as the server has it (on by default): a claim the caller acts on must
//   survive a crash. Do not turn it off for idem's table.
//
// * A claim is answered `claimed` only when the transaction that inserted its row committed: a
//   failure of the read that follows the INSERT, or of the COMMIT, rolls the INSERT back and is
//   reported (or retried), never taken for a win.
//
// Errors: config_error — bad options (constructor), or a permanent misconfiguration reported by
// the database: no such database / role / table (the message says to call ensure_schema()),
// authentication failed, permission denied, a server certificate that does not verify (TLS)
// (sqlstate() says which); store_unavailable /
// pool_timeout — what a retry can heal (no connection, timeouts, cancels, shortages);
// database_error (with sqlstate()), lease_lost, response_too_large, corrupt_record.
// Every entry point is reconnect-safe: a pooled connection found dead is replaced and the call
// goes on (in-transaction mode included, as long as nothing has committed).
// Thread-safety: all members may be called concurrently. The destructor closes every connection;
// no call may be in flight then. A store owns one background thread that enforces the deadlines
// of its connections' waits (no kernel timer per wait: cheaper, see docs/benchmarks.md).
// fork(): a store (its connections, its thread) belongs to the process that made it. In a child,
// every call throws config_error — make new stores there; destroying the inherited one is safe (it
// neither blocks nor ends the parent's sessions: the child's socket copies are closed, the rest is
// deliberately leaked). Calling a store from inside its own in-transaction effect needs a second
// connection: with pool_size 1 it throws config_error at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "idem/fingerprint_secret.hpp"
#include "idem/group_commit_stats.hpp"
#include "idem/pool_stats.hpp"
#include "idem/sealing.hpp"
#include "idem/store.hpp"

namespace idem {

class Transaction;
struct TransactionOptions;

/// Settings of a PostgresStore (and of idem::asio::AsyncPostgresStore); see the top of this header.
struct PostgresOptions {
    /// Maximum number of open connections.
    std::size_t pool_size = 8;
    /// Table, optionally schema-qualified ("billing.idem_keys"); plain identifiers only.
    std::string table = "idem_keys";
    /// Bound on connecting to one host.
    std::chrono::milliseconds connect_timeout{std::chrono::seconds(5)};
    /// Server-side statement_timeout, and the client's bound on each wait for an answer.
    std::chrono::milliseconds statement_timeout{std::chrono::seconds(5)};
    /// How long a claim waits on a concurrent uncommitted claim of its key.
    std::chrono::milliseconds lock_timeout{std::chrono::seconds(1)};
    /// How long a caller waits for a free pooled connection.
    std::chrono::milliseconds pool_wait{std::chrono::seconds(5)};
    /// A connection idle longer than this is pinged before it is used.
    std::chrono::milliseconds health_check_after{std::chrono::seconds(30)};
    /// Prepare idem's statements once per connection; false behind PgBouncer < 1.21 in transaction
    /// mode.
    bool prepared_statements = true;
    /// Send statement_timeout / lock_timeout / idle_in_transaction_session_timeout and
    /// enable_seqscan=off in the startup packet (no round trip). enable_seqscan=off keeps every cached
    /// plan of idem's key lookups on the primary key even after the table was ANALYZEd while empty
    /// (list_stale turns it back on for itself; in-transaction mode for fn's statements). Set false
    /// behind PgBouncer, which refuses startup options unless `ignore_startup_parameters = options`,
    /// and set them on the role (ALTER ROLE … SET) instead (enable_seqscan only matters with
    /// prepared_statements on: unnamed statements are planned afresh every time).
    bool session_options = true;
    /// Lease of a claim when ClaimOptions::lease is not set.
    std::chrono::milliseconds default_lease{std::chrono::seconds(30)};
    /// Retention when ClaimOptions::retention is not set.
    std::chrono::seconds default_retention{std::chrono::hours(24)};
    /// Upper bound of the retry-after hint given with in_progress.
    std::chrono::milliseconds max_retry_after{std::chrono::seconds(1)};
    /// Largest encoded result save() accepts (bytea can hold up to 1 GB; keep rows small).
    std::size_t max_result_bytes = 16u << 20;
    /// Attempts for a claim that hits 40001 / 40P01 / 55P03 or a broken connection; also for any
    /// other single-statement write (release, lease, phase, take-over) that hits 40001 / 40P01.
    int claim_attempts = 3;
    /// How long a save keeps retrying while the database is unreachable (restart, failover) or
    /// answers 40001 / 40P01: the effect already happened, and a fenced save is safe to repeat.
    /// Past it: response_not_saved. It counts from the save's start; an attempt under way at its end
    /// ends by its own bound (a statement's: statement_timeout + lock_timeout + 1 s; a connect's:
    /// connect_timeout). PostgresStore: a save that waits for a pooled connection gives up at
    /// pool_wait (pool_timeout, then response_not_saved), before the window when pool_wait is
    /// shorter. AsyncPostgresStore: no wait for a connection outlasts the window, however many
    /// saves wait for the pool's connections.
    std::chrono::milliseconds save_retry_window{std::chrono::seconds(15)};
    std::string application_name = "idem";  ///< application_name of the sessions (pg_stat_activity)
    /// Group commit: claim() / save() callers that find every pooled connection leased share
    /// transactions (one statement and one commit for a group of them) instead of each waiting for
    /// a connection; a caller that finds one free goes at once, alone, with the plain statements.
    /// Every caller keeps its own outcome, fence and errors. It pays when a service has more
    /// concurrent callers than connections (a thread per request on a pool of 8–16) and changes
    /// nothing otherwise (docs/benchmarks.md has the figures, docs/design.md "Group commit" the
    /// design). false: every call is its own transaction, and a caller waits for a connection.
    /// AsyncPostgresStore follows it too, for the first attempts that find every connection with
    /// a transaction in flight (idem/asio/store.hpp).
    bool group_commit = true;
    /// How claim_batch / save_batch and group commit shape their statements (docs/scale-out.md).
    /// automatic: the database is asked once — one array statement for all rows on one node, and
    /// statements that each stay on one shard on a Citus-distributed table (by scope: one per
    /// scope; by key: one per key; each segment committed on its own). The others force a shape:
    /// per_scope / per_key also run on plain PostgreSQL (slower there; for testing the Citus forms
    /// on one node, or when the catalog cannot be asked). Forced one-shard shapes also put each
    /// claim in an explicit BEGIN … COMMIT, as on Citus.
    enum class StatementShape { automatic, arrays, per_scope, per_key };
    StatementShape statement_shape = StatementShape::automatic;  ///< see StatementShape
    /// How a caller waiting with ClaimOptions::wait learns that the running attempt saved
    /// (docs/design.md, "Waiting instead of 409"). Every strategy reads the key once more at the
    /// wait's end, so a wait never answers in_progress for a key already saved.
    /// automatic: LISTEN/NOTIFY on a connection held while waiting, and the key read again as a
    /// backstop (20 ms after the first look, doubling to 200 ms): a notification that never
    /// comes (the saver's NOTIFY failed, a save through another Citus node) costs at most one
    /// interval. Behind a pooler (PgBouncer in any pool mode: the server's backend pid differs
    /// from the one the pooler gave libpq; asked once per store, on its first wait) it only
    /// polls: a transaction-mode pooler never delivers the notification, and LISTEN would stay on
    /// a server connection that other clients get. Also polls while pool_size - 1 callers listen.
    /// notify: LISTEN/NOTIFY only, no polls: the key is read again when a notification arrives
    /// and at the wait's end (for direct sessions with many long waits). Behind a
    /// transaction-mode pooler a waiter so sleeps the whole wait, then replays or answers
    /// in_progress. Past pool_size - 1 listeners: in_progress at once.
    /// poll: no LISTEN and no connection held: the key is read 20 ms → 200 ms apart (one
    /// primary-key SELECT each), so any number of callers may wait; for poolers.
    enum class WaitStrategy { automatic, notify, poll };
    WaitStrategy wait_strategy = WaitStrategy::automatic;  ///< see WaitStrategy
    /// Sealed responses (idem/sealing.hpp, opt-in): results are stored encrypted and authenticated
    /// under the keyring, and opened as they are read back; a result that does not open is
    /// corrupt_record. max_result_bytes bounds the result before sealing.
    SealingOptions sealing{};
    /// Keyed fingerprints at rest (opt-in; idem/fingerprint_secret.hpp): new rows get
    /// HMAC-SHA256 under this secret (fingerprint_alg 2) instead of the plain SHA-256, so a reader
    /// of the table or a dump cannot confirm guesses of low-entropy requests. Every claim path
    /// keys (single, batch, group commit, in-transaction, idem::asio); found rows are compared by
    /// their own algorithm, so rows written before the secret was set still replay. Without it,
    /// a keyed row is config_error. Rotating: keep the old secret until its rows have expired (a
    /// row keyed with another secret is a mismatch).
    std::optional<FingerprintSecret> fingerprint_secret{};
    /// Retention by generations (opt-in; docs/design.md, "Generations"). The table is partitioned
    /// by the time of each claim, one partition per `length`, and purge_expired() removes a whole
    /// partition (DETACH, DROP) once every key in it has expired and none is in progress, instead
    /// of deleting rows one by one: no WAL, index churn or vacuum work per expired key. Every claim
    /// still sees every live key: it takes a lock on its key and looks the key up in every
    /// generation before it inserts (same round trips; one more index probe per generation).
    /// ensure_schema() creates the partitioned table (an existing plain table is config_error: see
    /// docs/design.md for the migration) and the generations up to `ahead` past the current one;
    /// purge_expired() creates the next ones and retires the old. It attaches generations under
    /// the table's SHARE lock, so writes to the table wait while it does (it waits at most half its
    /// lock_timeout for the writes in flight to end: then it attaches nothing, and tries again next
    /// time; give the maintaining store no longer a lock_timeout than the claiming ones). Every
    /// process of a deployment uses the same length (ensure_schema() records it; a store whose
    /// length differs from the table's gets config_error from purge_expired()).
    struct Generations {
        /// Span of one generation: at least 1 s (shorter ones retire faster than maintenance can
        /// detach them), at most 30 days. Live generations are about retention / length + ahead + 1,
        /// and each lookup probes each of them: a quarter of the retention is a good length.
        std::chrono::milliseconds length{std::chrono::hours(6)};
        /// Generations made ready past the current one (at least 1): ensure_schema() makes all of
        /// them, purge_expired() tops them up once fewer than half are left. A claim whose
        /// generation does not exist fails with store_unavailable ("no generation covers now"),
        /// so run purge_expired() at least every `ahead × length / 4`.
        std::size_t ahead = 2;
    };
    std::optional<Generations> generations{};  ///< see Generations; nullopt: one plain table
};

/// The distribution column of idem's table on a Citus cluster (docs/scale-out.md): `scope` keeps a
/// tenant's keys on one shard (batches and co-located tables stay on one node), `key` spreads a hot
/// tenant over every shard.
enum class DistributeBy { scope, key };

/// What PostgresStore::inspect() found about the database a store serves.
struct Deployment {
    bool citus = false;           ///< the citus extension is installed in the database
    std::string citus_version{};  ///< the extension's version (e.g. "13.2-1"); empty without Citus
    bool coordinator = true;      ///< false: connected to a Citus worker node
    /// The table's distribution column; none: not distributed (plain PostgreSQL, a local table).
    std::optional<DistributeBy> distributed_by{};
    /// What a service should log (or refuse to start on), each with its fix: e.g. idem's
    /// lock_timeout not in force on the Citus workers (session settings do not reach the shards).
    std::vector<std::string> warnings{};
};

/// The IdempotencyStore contract over PostgreSQL, with its connection pool (see the top of this
/// header).
class PostgresStore final : public IdempotencyStore {
public:
    /// `conninfo` is a libpq connection string or URI. Nothing connects until first use.
    /// Throws config_error on invalid options.
    explicit PostgresStore(std::string conninfo, PostgresOptions options = {});
    ~PostgresStore() override;
    PostgresStore(const PostgresStore&) = delete;
    PostgresStore& operator=(const PostgresStore&) = delete;

    /// Creates or upgrades the table and its index. Idempotent and safe to run from several
    /// processes at once (serialised by an advisory lock); records the schema version in
    /// idem_schema_version. The SQL it runs is docs/schema.sql, one statement at a time. Throws
    /// config_error on a Citus worker node (run it against the coordinator).
    void ensure_schema();

    /// Citus: distributes the table over the cluster by `by` (create_distributed_table; existing
    /// rows move to the shards, and their local copies are truncated). Idempotent; call it after ensure_schema(), on
    /// the coordinator. Throws config_error without the citus extension, on a worker node, when the table does not
    /// exist, or when it is already distributed by the other column.
    void distribute(DistributeBy by);

    /// Asks the database how the table is deployed (Citus or not, coordinator or worker,
    /// distribution column) and checks that the settings idem relies on reach the shards; call it
    /// at start-up and log `warnings`. Several round trips on a connection of its own.
    /// Throws store_unavailable / config_error as a connect does.
    [[nodiscard]] Deployment inspect();

    /// The schema version this build of idem writes and expects.
    [[nodiscard]] static int schema_version() noexcept;

    /// The DDL ensure_schema() runs for `table` (for DBAs who apply schema changes themselves).
    /// Throws config_error on an invalid table name.
    [[nodiscard]] static std::string schema_sql(const std::string& table = "idem_keys");

    /// ClaimOptions::wait: woken by LISTEN/NOTIFY, with polls of the key as a backstop, or by polls
    /// alone behind a pooler such as PgBouncer (PostgresOptions::wait_strategy).
    [[nodiscard]] Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) override;
    void save(const Key& key, Fence fence, std::string_view result) override;
    /// One round trip, with one commit for all claims on one node (on a Citus-distributed table,
    /// one per shard segment: docs/scale-out.md).
    [[nodiscard]] std::vector<Claim> claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                                 const ClaimOptions& options = {}) override;
    /// One round trip, one commit on one node (on a Citus-distributed table one per scope or key;
    /// a row whose statement failed is sent again alone).
    [[nodiscard]] std::vector<SaveStatus> save_batch(std::span<const SaveRequest> saves) override;
    void release(const Key& key, Fence fence) override;
    [[nodiscard]] std::optional<Record> read(const Key& key) override;
    void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) override;
    void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) override;
    [[nodiscard]] std::optional<Fence> take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                 bool new_attempt) override;
    /// An exact scope is `scope = $n`, routed to one shard on Citus; all and prefix are multi-shard
    /// reads.
    [[nodiscard]] std::vector<StaleKey> list_stale(std::size_t limit,
                                                   const ScopeFilter& scopes = ScopeFilter::all()) override;
    /// One count(*) over the same scan as list_stale.
    [[nodiscard]] std::size_t count_stale(const ScopeFilter& scopes = ScopeFilter::all()) override;
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    [[nodiscard]] StoreStats stats() const override;
    /// The connection pool now: open, idle and waiting callers, and the acquires so far with how long
    /// they waited (idem/pool_stats.hpp; PrometheusObserver renders it). Takes the pool's lock
    /// briefly; does not touch the database and does not throw. Thread-safe.
    [[nodiscard]] PoolStats pool_stats() const;
    /// What group commit did (PostgresOptions::group_commit; idem/group_commit_stats.hpp). Does not
    /// touch the database and does not throw. Thread-safe.
    [[nodiscard]] GroupCommitStats group_commit_stats() const;
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;
    /// `fp` keyed with PostgresOptions::fingerprint_secret, or `fp` without one.
    [[nodiscard]] Fingerprint key_fingerprint(const Fingerprint& fp) const override;

    /// The options the store was made with.
    [[nodiscard]] const PostgresOptions& options() const noexcept;

    /// What in-transaction mode decided (see idem/postgres_transaction.hpp, which wraps this).
    struct TransactionOutcome {
        ClaimStatus status = ClaimStatus::in_progress;  ///< claimed = executed and committed
        std::string result{};                           ///< completed: the stored bytes
        /// In_progress: when the client should try again.
        std::chrono::milliseconds retry_after{0};
    };
    /// Claim, effect(tx) and save in one transaction; effect returns the encoded result.
    [[nodiscard]] TransactionOutcome run_in_transaction(const Key& key, const Fingerprint& fp,
                                                        const ClaimOptions& options,
                                                        const TransactionOptions& transaction,
                                                        const std::function<std::string(Transaction&)>& effect);
    /// The same with default TransactionOptions.
    [[nodiscard]] TransactionOutcome run_in_transaction(const Key& key, const Fingerprint& fp,
                                                        const ClaimOptions& options,
                                                        const std::function<std::string(Transaction&)>& effect);

private:
    // claim() with a given fence: claim_batch settling a key on its own keeps the fence its batch
    // attempts used (a row that an attempt committed before its answer was lost is then ours).
    // `fp` is already keyed (key_fingerprint()).
    [[nodiscard]] Claim claim_with_fence(const Key& key, const Fingerprint& fp, const ClaimOptions& options,
                                         Fence fence);
    // save() of bytes as they are stored (sealed already when sealing is on): save_batch sending a
    // row again alone keeps the bytes its batch attempts sent.
    void save_stored(const Key& key, Fence fence, std::string_view stored);

    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace idem
