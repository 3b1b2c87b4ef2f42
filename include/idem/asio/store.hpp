// idem/asio/store.hpp — AsyncPostgresStore: PostgreSQL for event loops (component idem::asio).
//
//   boost::asio::io_context io;
//   idem::asio::AsyncPostgresStore store(io.get_executor(), "postgresql://app@db/payments");
//   store.blocking().ensure_schema();          // once, at deployment (a blocking call)
//   ... co_await idem::asio::async_execute_once(store, key, fp, effect, boost::asio::use_awaitable);
//
// No thread waits on the database: the store keeps up to PostgresOptions::pool_size non-blocking
// libpq connections in pipeline mode, watched by the executor's event loop, and sends the
// statements of many requests on each one at once — each its own transaction (a claim is committed
// when its Sync is answered) unless group commit puts concurrent ones together (below). The same
// SQL, the same fences, and the same decisions as PostgresStore (one copy of the rules:
// src/postgres/sansio/machine.hpp and rows.hpp), so every guarantee of
// store.hpp holds: the winning claim is durable before the claim completes; a claim, save or
// release interrupted by a broken connection is sent again on another connection with the same
// fence and recognises its own earlier write; a server that cannot be reached is store_unavailable
// at once for a claim (the effect is not run) and is tried for save_retry_window by a save.
//
// Differences from PostgresStore, all on purpose:
//   * ClaimOptions::wait polls the key (every 20 ms, then up to 200 ms apart) instead of LISTENing:
//     no connection is held by a waiter. A save still NOTIFYs blocking waiters of other stores.
//   * Group commit follows PostgresOptions::group_commit (pool_wait is ignored), and a lone
//     request never waits: while no transaction is in flight and nothing queues, it goes at once
//     with the single-key statements. With group_commit on (the default) the store grows the
//     group it sends next rather than spreading requests over connections: at most one claim
//     transaction and one save transaction are in flight (one in all with pool_size 1; a further
//     one of a kind only when a full group waits, never more than pool_size), and the first
//     attempts that arrive meanwhile — the next requests of the calls a transaction just answered
//     included — go out together as one transaction when their kind's ends (up to 256 rows and,
//     for saves, 4 MiB of results; the batch statements), saves first; a group's failure reaches
//     each member as its own call's would (a member whose row failed goes alone with its fence).
//     With group_commit off, at most pool_size transactions are in flight, one per connection: a
//     first attempt that finds every connection with one waits for one to end, then goes alone
//     with the single-key statements (saves first), and group_commit_stats() stays 0. Not on a
//     Citus coordinator: there every request goes alone. stats() counts the groups.
//   * Statement deadlines (statement_timeout + lock_timeout + 1 s, as PostgresStore) are kept by a
//     timer per connection: a connection that does not answer in time fails every request on it
//     (each is retried or reported as the blocking store would).
//
// Operations: the async_* members take any Asio completion token (a callback, use_future,
// use_awaitable, deferred...) and complete on the token's associated executor, with
// void(std::exception_ptr, T) — the exception is one of idem's (errors.hpp) exactly as the
// blocking store would throw it. They may be started from any thread.
//
// Replay cache (opt-in: set_replay_cache): a ReplayCache (idem/replay_cache.hpp) in front of the
// database, with CachedStore's rules (idem/cached_store.hpp): a claim whose key has a cached
// completed record answers completed, or mismatch for another fingerprint (compared as the
// database compares its row: key_fingerprint(), claim_status()), with no round trip; a completed
// answer of the database (or a mismatch on a completed record) is kept for the retention the
// database stated, from the cache's clock read before the database was asked; in-progress records
// never are, so in_progress, waiting and resume mode always ask the database. The cache holds the
// records as this store hands them out — opened when PostgresOptions::sealing is on — so a hit
// replays the bytes the database's answer would (and, sealed, a mismatch carries no result, as
// from the database). Every claim goes through it: async_claim, co_claim, claim() (so the default
// claim_batch), async_execute_once and the HTTP and gRPC adapters over this store; read() and the
// other members never use it. Only the in-process ReplayCache, never a ReplayTier with network
// I/O such as RedisReplayCache: a tier is called synchronously, so on this store it would block the
// event loop for up to its timeout on every miss; ReplayCache waits for nothing but a shard's lock.
// A hit is reported as the database's answer would be: async_execute_once reports replayed or
// mismatch to this store's observer, as through a CachedStore. stats() counts what reaches the
// database only — a hit adds nothing to claims or round_trips, as CachedStore::stats() — and the
// cache's own stats() count the hits. Share a cache only between stores of the same table (its
// entries are keyed by scope and key alone). Staleness as CachedStore's: a completed row deleted or
// edited by hand is replayed until its entry expires; erase() the key or clear() the cache.
//
// The IdempotencyStore interface is implemented too, so the same object serves the Reconciler,
// idem::http::respond or tests: claim/save/release/extend_lease/record_phase/take_over/read run
// through the asynchronous connections and wait for the answer (never call them on the store's
// own executor: they would wait for themselves — they throw config_error instead; and the event
// loop must be running on another thread). claim_batch / save_batch are IdempotencyStore's
// defaults (one claim or save per key, through those connections); list_stale and purge_expired go
// through blocking(), a small blocking PostgresStore on the same database and table.
//
// Thread-safety: every member may be called from any thread. The store's state lives on a strand of
// the given executor, so an io_context run by several threads is fine. Destroy the store after the
// operations started on it have completed and before its io_context (which may still be running);
// connections are closed by the destructor. An idle store keeps no operation pending on the
// io_context, so io_context::run() returns when the work is done.
#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/strand.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "idem/postgres_store.hpp"
#include "idem/replay_cache.hpp"
#include "idem/store.hpp"

namespace idem::asio {

/// PostgreSQL for event loops: non-blocking, pipelined connections on an Asio executor, operations
/// with completion tokens (see the top of this header).
class AsyncPostgresStore final : public IdempotencyStore {
public:
    /// The strand the store's work runs on.
    using executor_type = boost::asio::strand<boost::asio::any_io_executor>;

    /// Connects lazily (the first operation opens the first connection). Throws config_error for
    /// invalid options or table name (as PostgresStore does), before any I/O.
    AsyncPostgresStore(boost::asio::any_io_executor executor, std::string conninfo, PostgresOptions options = {});
    ~AsyncPostgresStore() override;
    AsyncPostgresStore(const AsyncPostgresStore&) = delete;
    AsyncPostgresStore& operator=(const AsyncPostgresStore&) = delete;

    /// The strand every operation of this store runs on (and async_execute_once's effect too).
    [[nodiscard]] executor_type get_executor() const noexcept;
    /// The options the store was made with.
    [[nodiscard]] const PostgresOptions& options() const noexcept;

    /// A blocking PostgresStore on the same database and table (2 connections, made on first use):
    /// ensure_schema, inspect, distribute, list_stale, purge_expired, batches. Thread-safe.
    [[nodiscard]] PostgresStore& blocking();

    /// Puts `cache` in front of the database for every claim (see "Replay cache" at the top of
    /// this header); null turns it off (the default). A cache may serve several stores of the same
    /// table. Thread-safety: may be called from any thread at any time — the pointer is atomic; a
    /// claim uses the cache it read when it started (a claim in flight may still insert into the
    /// cache it read). Call it before operations start for every claim to use it. Does not throw.
    void set_replay_cache(std::shared_ptr<ReplayCache> cache) noexcept;
    /// The cache set_replay_cache() put in front of the database, or null. Thread-safe.
    [[nodiscard]] std::shared_ptr<ReplayCache> replay_cache() const noexcept;

    // ---- Asynchronous operations: the contract of IdempotencyStore's members of the same name.

    /// Completes with void(std::exception_ptr, Claim).
    template <class Token>
    auto async_claim(Key key, Fingerprint fp, ClaimOptions options, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_claim(std::move(key), std::move(fp), options),
                                     std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr).
    template <class Token>
    auto async_save(Key key, Fence fence, std::string result, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_save(std::move(key), fence, std::move(result)),
                                     std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr).
    template <class Token>
    auto async_release(Key key, Fence fence, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_release(std::move(key), fence), std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr).
    template <class Token>
    auto async_extend_lease(Key key, Fence fence, std::chrono::milliseconds lease, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_extend_lease(std::move(key), fence, lease),
                                     std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr).
    template <class Token>
    auto async_record_phase(Key key, Fence fence, std::string phase, std::string data, Token&& token) {
        return boost::asio::co_spawn(get_executor(),
                                     co_record_phase(std::move(key), fence, std::move(phase), std::move(data)),
                                     std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr, std::optional<Fence>).
    template <class Token>
    auto async_take_over(Key key, Fence stale_fence, std::chrono::milliseconds lease, bool new_attempt, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_take_over(std::move(key), stale_fence, lease, new_attempt),
                                     std::forward<Token>(token));
    }
    /// Completes with void(std::exception_ptr, std::optional<Record>).
    template <class Token>
    auto async_read(Key key, Token&& token) {
        return boost::asio::co_spawn(get_executor(), co_read(std::move(key)), std::forward<Token>(token));
    }

    // ---- The same operations as coroutines, for code already running on get_executor() (as
    // async_execute_once's effect does): co_await them there, and only there.
    /// claim() as a coroutine.
    boost::asio::awaitable<Claim> co_claim(Key key, Fingerprint fp, ClaimOptions options = {});
    /// save() as a coroutine.
    boost::asio::awaitable<void> co_save(Key key, Fence fence, std::string result);
    /// release() as a coroutine.
    boost::asio::awaitable<void> co_release(Key key, Fence fence);
    /// extend_lease() as a coroutine.
    boost::asio::awaitable<void> co_extend_lease(Key key, Fence fence, std::chrono::milliseconds lease);
    /// record_phase() as a coroutine.
    boost::asio::awaitable<void> co_record_phase(Key key, Fence fence, std::string phase, std::string data);
    /// take_over() as a coroutine.
    boost::asio::awaitable<std::optional<Fence>> co_take_over(Key key, Fence stale_fence,
                                                              std::chrono::milliseconds lease, bool new_attempt);
    /// read() as a coroutine.
    boost::asio::awaitable<std::optional<Record>> co_read(Key key);

    // ---- IdempotencyStore (blocking; see the header comment).
    [[nodiscard]] Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) override;
    void save(const Key& key, Fence fence, std::string_view result) override;
    void release(const Key& key, Fence fence) override;
    void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) override;
    void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) override;
    [[nodiscard]] std::optional<Fence> take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                 bool new_attempt) override;
    [[nodiscard]] std::optional<Record> read(const Key& key) override;
    [[nodiscard]] std::vector<StaleKey> list_stale(std::size_t limit,
                                                   const ScopeFilter& scopes = ScopeFilter::all()) override;
    [[nodiscard]] std::size_t count_stale(const ScopeFilter& scopes = ScopeFilter::all()) override;
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    /// This store's own counters (its asynchronous connections), plus blocking()'s if it was made.
    [[nodiscard]] StoreStats stats() const override;
    /// The groups this store sent for requests in flight (idem/group_commit_stats.hpp). Thread-safe.
    [[nodiscard]] GroupCommitStats group_commit_stats() const;
    /// The asynchronous connections now and the acquires so far (idem/pool_stats.hpp), for
    /// PrometheusObserver::set_pool_source([&store] { return store.pool_stats(); }) as with
    /// PostgresStore. Here a connection is shared by many requests: open counts the connections
    /// being opened or open, idle those with no request in flight (open - idle are in use); waiters
    /// the requests waiting for a connection being opened plus the first attempts queued for a
    /// transaction (see "Group commit" at the top); waited and the wait histogram the acquires
    /// that found every connection still being opened. timeouts stays 0: a request never waits
    /// for a connection to come back (pool_wait is ignored). blocking()'s connections are not
    /// included (blocking().pool_stats()).
    /// Thread-safety: reads atomics the strand keeps up to date — never posts to the strand or waits
    /// for it — so it may be called from any thread: the store's strand, or a /metrics handler on
    /// the same io_context, included. open and idle are read in one load (idle <= open); waiters and
    /// the counters each in its own. Does not touch the database; does not throw.
    [[nodiscard]] PoolStats pool_stats() const;
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;
    /// `fp` keyed with PostgresOptions::fingerprint_secret, or `fp` without one.
    [[nodiscard]] Fingerprint key_fingerprint(const Fingerprint& fp) const override;

private:
    struct Impl;
    std::shared_ptr<Impl> impl_;
};

}  // namespace idem::asio
