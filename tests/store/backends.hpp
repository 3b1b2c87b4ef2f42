// tests/store/backends.hpp — how the contract suite makes a store of each kind.
//
// A backend object lives for one test case; it owns the stores it makes and, for PostgreSQL, a
// private table (dropped afterwards), so test binaries and test cases never see each other's keys.
//
// The suite calls execute_once through its backend: backend.execute_once(store, key, fp, fn
// [, options]). MemoryBackend and PostgresBackend forward to idem::execute_once;
// AsyncPostgresBackend (IDEM_CONTRACT_ASYNC) goes through idem::asio::async_execute_once(...,
// use_future).get(). RedisBackend (IDEM_CONTRACT_REDIS) makes RedisStores on one redis-server of
// this process's own (appendfsync always), each backend under a key prefix of its own;
// TieredBackend (IDEM_CONTRACT_TIERED) makes CachedStores whose tiers are a ReplayCache and a
// RedisReplayCache in front of a PostgresStore on a private table.
#pragma once

#include "idem/idem.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#include "test_env.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#if defined(IDEM_CONTRACT_POSTGRES) || defined(IDEM_CONTRACT_ASYNC) || defined(IDEM_CONTRACT_TIERED)
#include "pg.hpp"
#endif
#if defined(IDEM_CONTRACT_REDIS) || defined(IDEM_CONTRACT_TIERED)
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#include "redis_server.hpp"
#endif
#if defined(IDEM_CONTRACT_ASYNC)
#include "idem/asio.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <functional>
#include <thread>
#include <type_traits>
#endif

namespace idem_test {

/// The knobs the contract tests turn, in store-neutral terms.
struct StoreConfig {
    std::size_t max_result_bytes = 16u << 20;
    std::chrono::milliseconds max_retry_after{std::chrono::seconds(1)};
    std::chrono::milliseconds default_lease{std::chrono::seconds(30)};
};

/// The blocking execute_once, for the backends whose calls are the blocking ones.
struct BlockingCalls {
    /// Whether replays after the first are answered by a cache in front of the store, so that the
    /// store's own counters (stats(), the primary's) never see them.
    static constexpr bool replays_from_cache = false;

    template <class Fn>
    idem::Result<idem::effect_result_t<Fn>> execute_once(idem::IdempotencyStore& store, const idem::Key& key,
                                                         const idem::Fingerprint& fp, Fn&& fn,
                                                         const idem::ClaimOptions& options = {}) {
        return idem::execute_once(store, key, fp, std::forward<Fn>(fn), options);
    }
};

/// A scope nobody else uses (unique within this process; the table is private to it anyway).
inline std::string fresh_scope(const std::string& what) { return unique_name("scope") + ":" + what; }

class MemoryBackend : public BlockingCalls {
public:
    static constexpr const char* name = "MemoryStore";

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        idem::MemoryStoreOptions options;
        options.max_result_bytes = config.max_result_bytes;
        options.max_retry_after = config.max_retry_after;
        options.default_lease = config.default_lease;
        stores_.push_back(std::make_unique<idem::MemoryStore>(options));
        return *stores_.back();
    }

    /// A second store on the same data, when the backend can share it (memory cannot).
    static constexpr bool shares_data = false;

private:
    std::vector<std::unique_ptr<idem::MemoryStore>> stores_;
};

#if defined(IDEM_CONTRACT_REDIS) || defined(IDEM_CONTRACT_TIERED)
/// This process's redis-server (appendonly yes, appendfsync always), started on first use.
inline RedisServer& contract_redis() {
    static RedisServer server;
    return server;
}
#endif

#if defined(IDEM_CONTRACT_REDIS)
class RedisBackend : public BlockingCalls {
public:
    static constexpr const char* name = "RedisStore";
    static constexpr bool shares_data = true;

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        idem::RedisOptions options = contract_redis().store_options();
        options.key_prefix = prefix_;
        options.pool_size = 4;
        options.max_result_bytes = config.max_result_bytes;
        options.max_retry_after = config.max_retry_after;
        options.default_lease = config.default_lease;
        options.sealing = env_sealing();
        stores_.push_back(std::make_unique<idem::RedisStore>(options));
        return *stores_.back();
    }

private:
    std::string prefix_ = unique_name("idem") + ":";
    std::vector<std::unique_ptr<idem::RedisStore>> stores_;
};
#endif

#if defined(IDEM_CONTRACT_POSTGRES) || defined(IDEM_CONTRACT_ASYNC) || defined(IDEM_CONTRACT_TIERED)
/// The private table of one database backend: its name, and its removal (best effort: the cluster
/// is throwaway) once the backend's stores are gone.
struct PrivateTable {
    explicit PrivateTable(const std::string& prefix) : conninfo(require_db()), name(unique_name(prefix)) {}
    void drop() const noexcept {
        if (created) drop_idem_table(conninfo, name);
    }
    std::string conninfo;
    std::string name;
    bool created = false;  // ensure_schema() ran
};

/// The store options of a contract backend on `table`, with the environment's choices applied.
inline idem::PostgresOptions contract_options(const std::string& table, const StoreConfig& config,
                                              const char* application) {
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = 4;
    options.max_result_bytes = config.max_result_bytes;
    options.max_retry_after = config.max_retry_after;
    options.default_lease = config.default_lease;
    options.application_name = application;
    return env_options(options);
}
#endif

#if defined(IDEM_CONTRACT_POSTGRES)
class PostgresBackend : public BlockingCalls {
public:
    static constexpr const char* name = "PostgresStore";
    static constexpr bool shares_data = true;

    PostgresBackend() : table_("idem_t") {}

    ~PostgresBackend() {
        stores_.clear();  // close every pooled connection before dropping the table
        table_.drop();
    }

    PostgresBackend(const PostgresBackend&) = delete;
    PostgresBackend& operator=(const PostgresBackend&) = delete;

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        auto store = std::make_unique<idem::PostgresStore>(table_.conninfo,
                                                           contract_options(table_.name, config, "idem_contract_test"));
        if (!table_.created) {
            store->ensure_schema();
            table_.created = true;
        }
        stores_.push_back(std::move(store));
        return *stores_.back();
    }

    [[nodiscard]] const std::string& table() const { return table_.name; }
    [[nodiscard]] const std::string& conninfo() const { return table_.conninfo; }

private:
    PrivateTable table_;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores_;
};
#endif

#if defined(IDEM_CONTRACT_TIERED)
/// CachedStore{ReplayCache, RedisReplayCache} in front of a PostgresStore on a private table: the
/// contract holds through the tiers (replays from either cache, everything else from PostgreSQL).
class TieredBackend : public BlockingCalls {
public:
    static constexpr const char* name = "CachedStore(ReplayCache, RedisReplayCache, PostgresStore)";
    static constexpr bool shares_data = true;
    static constexpr bool replays_from_cache = true;

    TieredBackend() : table_("idem_tt") {}
    ~TieredBackend() {
        stores_.clear();
        primaries_.clear();
        table_.drop();
    }
    TieredBackend(const TieredBackend&) = delete;
    TieredBackend& operator=(const TieredBackend&) = delete;

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        auto primary = std::make_unique<idem::PostgresStore>(
            table_.conninfo, contract_options(table_.name, config, "idem_contract_tiered_test"));
        if (!table_.created) {
            primary->ensure_schema();
            table_.created = true;
        }
        idem::RedisReplayCacheOptions cache;
        cache.connection = idem::RedisReplayCacheOptions::cache_connection_defaults();
        cache.connection.unix_socket = contract_redis().socket();
        cache.connection.key_prefix = prefix_;
        cache.connection.sealing = env_sealing();  // entries sealed too (IDEM_TEST_SEALED)
        // A busy test machine: the cache's 50 ms default would turn into misses, which the
        // contract would survive, but then the tier would not be what is tested.
        cache.connection.command_timeout = std::chrono::seconds(5);
        std::vector<std::shared_ptr<idem::ReplayTier>> tiers{std::make_shared<idem::ReplayCache>(),
                                                             std::make_shared<idem::RedisReplayCache>(cache)};
        stores_.push_back(std::make_unique<idem::CachedStore>(*primary, std::move(tiers)));
        primaries_.push_back(std::move(primary));
        return *stores_.back();
    }

private:
    PrivateTable table_;
    std::string prefix_ = unique_name("idem") + ":";
    std::vector<std::unique_ptr<idem::PostgresStore>> primaries_;
    std::vector<std::unique_ptr<idem::CachedStore>> stores_;
};
#endif

#if defined(IDEM_CONTRACT_ASYNC)
/// AsyncPostgresStore on a private table, its io_context run by one thread of its own. The suite's
/// direct store calls (claim, save, read...) are the store's blocking members, which run its
/// asynchronous operations and wait; list_stale and purge_expired go through blocking(). execute_once
/// is idem::asio::async_execute_once(..., use_future).get(), the suite's effect made an awaitable that
/// runs it on a thread of `effects_` (the suite's effects block — latches, store.read — and the
/// store's strand must not), with an idem::Context over the same store for the effects that take
/// one: its record_phase / extend_lease are the store's blocking members, from that thread.
class AsyncPostgresBackend {
public:
    static constexpr const char* name = "AsyncPostgresStore";
    static constexpr bool shares_data = true;
    static constexpr bool replays_from_cache = false;

    AsyncPostgresBackend() : table_("idem_ta"), work_(io_.get_executor()), runner_([this] { io_.run(); }) {}

    ~AsyncPostgresBackend() {
        stores_.clear();  // every call made through them has completed (the suite waits for each)
        work_.reset();
        runner_.join();
        effects_.join();
        table_.drop();
    }

    AsyncPostgresBackend(const AsyncPostgresBackend&) = delete;
    AsyncPostgresBackend& operator=(const AsyncPostgresBackend&) = delete;

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        auto store = std::make_unique<idem::asio::AsyncPostgresStore>(
            io_.get_executor(), table_.conninfo, contract_options(table_.name, config, "idem_contract_async_test"));
        if (!table_.created) {
            store->blocking().ensure_schema();
            table_.created = true;
        }
        stores_.push_back(std::move(store));
        return *stores_.back();
    }

    /// idem::execute_once's contract through idem::asio::async_execute_once. `store` is one this
    /// backend made. The effect is passed on as a std::function so that the coroutines below are
    /// instantiated once per result type, not once per lambda of the suite (each instantiation of
    /// async_execute_once is a large piece of code to compile).
    template <class Fn>
    idem::Result<idem::effect_result_t<Fn>> execute_once(idem::IdempotencyStore& store, const idem::Key& key,
                                                         const idem::Fingerprint& fp, Fn&& fn,
                                                         const idem::ClaimOptions& claim = {}) {
        using R = idem::effect_result_t<Fn>;
        std::function<R(idem::Context&)> call = [&fn](idem::Context& context) -> R {
            if constexpr (std::is_invocable_v<Fn&, idem::Context&>) {
                return fn(context);
            } else {
                return fn();
            }
        };
        return run<R>(dynamic_cast<idem::asio::AsyncPostgresStore&>(store), key, fp, call, claim);
    }

    [[nodiscard]] const std::string& table() const { return table_.name; }
    [[nodiscard]] const std::string& conninfo() const { return table_.conninfo; }

private:
    template <class R>
    idem::Result<R> run(idem::asio::AsyncPostgresStore& async, const idem::Key& key, const idem::Fingerprint& fp,
                        const std::function<R(idem::Context&)>& call, const idem::ClaimOptions& claim) {
        namespace net = boost::asio;
        auto effect = [&call, &async,
                       ex = effects_.get_executor()](idem::asio::AsyncContext& ctx) -> net::awaitable<R> {
            // On the store's strand: hop to an effects thread, run the effect there, come back with
            // its value or its exception (the very object: exception_ptr).
            co_return co_await net::co_spawn(
                ex,
                [&call, &async, &ctx]() -> net::awaitable<R> {
                    std::optional<idem::Record> taken_over;
                    if (ctx.attempt() > 1) {
                        taken_over.emplace();
                        taken_over->attempt = ctx.attempt();
                        taken_over->phase = ctx.phase();
                        taken_over->phase_data = ctx.phase_data();
                    }
                    idem::Context context(async, ctx.key(), ctx.fence(), taken_over ? &*taken_over : nullptr);
                    co_return call(context);
                },
                net::use_awaitable);
        };
        idem::asio::AsyncOptions options;
        options.claim = claim;
        return idem::asio::async_execute_once(async, key, fp, std::move(effect), options, net::use_future).get();
    }

    PrivateTable table_;
    boost::asio::io_context io_;
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
    std::thread runner_;
    boost::asio::thread_pool effects_{8};
    std::vector<std::unique_ptr<idem::asio::AsyncPostgresStore>> stores_;
};
#endif

}  // namespace idem_test
