// Races on the same keys — between threads of one process, and between OS processes — on
// PostgreSQL; with IDEM_CONCURRENCY_REDIS on RedisStore (idem_redis_concurrency_tests), with
// IDEM_CONCURRENCY_TIERED on CachedStore{ReplayCache, RedisReplayCache} in front of PostgreSQL
// (idem_tiered_concurrency_tests); the Redis ones on a redis-server of this process's own, whose
// socket the workers get in IDEM_RACE_REDIS_SOCKET.
// The effect records itself in an `effects` table in PostgreSQL over its own connection, so
// "exactly once" is checked outside the store under test, not only by counters in this process.
// Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "race_run.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#if defined(IDEM_CONCURRENCY_REDIS) || defined(IDEM_CONCURRENCY_TIERED)
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#include "redis_server.hpp"
#endif

#include <unistd.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;
namespace race = idem_test::race;
using idem_test::require_db;

namespace {

/// An idem table and an effects table, both dropped at the end.
struct Tables : race::Tables {
    explicit Tables(std::string url) : race::Tables(std::move(url), "idem_t", "idem_effects") {}

    idem::PostgresOptions options(std::size_t pool_size) const {
        idem::PostgresOptions o;
        o.table = idem;
        o.pool_size = pool_size;
        // 64 threads share pool_size connections: on a loaded machine (a Citus coordinator doing
        // the work of three servers) a caller's wait for one, or a statement's answer, can pass the
        // default 5 s. These tests are about one effect per key, not about how long a caller waits.
        o.pool_wait = std::chrono::seconds(120);
        o.statement_timeout = std::chrono::seconds(60);
        o.connect_timeout = std::chrono::seconds(60);  // 32 connections at once, same reason
        o.application_name = "idem_concurrency_test";
        return o;
    }
};

/// The store under test, and what it is made of.
struct StoreUnderTest {
    std::vector<std::shared_ptr<void>> parts;  // destroyed last to first: the primary after its cache
    idem::IdempotencyStore* store = nullptr;
    idem::IdempotencyStore& operator*() const { return *store; }
    idem::IdempotencyStore* get() const { return store; }
    StoreUnderTest() = default;
    StoreUnderTest(StoreUnderTest&&) = default;
    StoreUnderTest& operator=(StoreUnderTest&&) = delete;
    ~StoreUnderTest() {
        while (!parts.empty()) parts.pop_back();
    }
};

#if defined(IDEM_CONCURRENCY_REDIS) || defined(IDEM_CONCURRENCY_TIERED)
/// This process's redis-server; the race workers find its socket in IDEM_RACE_REDIS_SOCKET.
const idem_test::RedisServer& race_redis() {
    static idem_test::RedisServer server;
    ::setenv("IDEM_RACE_REDIS_SOCKET", server.socket().c_str(), 1);
    return server;
}
#endif

/// The store under test on `tables`, with a pool of `pool_size` (its schema made, for PostgreSQL):
/// PostgresStore; RedisStore (IDEM_CONCURRENCY_REDIS); or CachedStore{ReplayCache,
/// RedisReplayCache} in front of PostgresStore (IDEM_CONCURRENCY_TIERED).
StoreUnderTest make_store(const std::string& url, const Tables& tables, std::size_t pool_size) {
    StoreUnderTest made;
#if defined(IDEM_CONCURRENCY_REDIS)
    (void)url;
    idem::RedisOptions options = race_redis().store_options();
    options.key_prefix = tables.idem + ":";
    options.pool_size = pool_size;
    auto store = std::make_shared<idem::RedisStore>(options);
    made.store = store.get();
    made.parts.push_back(store);
#else
    auto primary = std::make_shared<idem::PostgresStore>(url, idem_test::env_options(tables.options(pool_size)));
    primary->ensure_schema();
    made.store = primary.get();
    made.parts.push_back(primary);
#if defined(IDEM_CONCURRENCY_TIERED)
    idem::RedisReplayCacheOptions cache;
    cache.connection.unix_socket = race_redis().socket();
    cache.connection.key_prefix = tables.idem + ":";
    cache.connection.pool_size = pool_size;
    auto cached = std::make_shared<idem::CachedStore>(
        *primary, std::vector<std::shared_ptr<idem::ReplayTier>>{std::make_shared<idem::ReplayCache>(),
                                                                 std::make_shared<idem::RedisReplayCache>(cache)});
    made.store = cached.get();
    made.parts.push_back(cached);
#endif
#endif
    return made;
}

/// How many of the keys (scope, value) hold a completed record: rows of tables.idem on PostgreSQL,
/// records read back through the store on Redis.
long long completed_records(PgConn& admin, const Tables& tables, idem::IdempotencyStore& store,
                            const std::string& scope, const std::vector<std::string>& values) {
#if defined(IDEM_CONCURRENCY_REDIS)
    (void)admin;
    (void)tables;
    long long completed = 0;
    for (const auto& value : values) {
        const auto record = store.read(idem::Key(scope, value));
        completed += record && record->state == idem::RecordState::completed ? 1 : 0;
    }
    return completed;
#else
    (void)store;
    (void)values;
    return admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1 AND state = 'completed'", {scope});
#endif
}

void insert_effect(PgConn& conn, const std::string& table, const std::string& scope, const std::string& key, int tid) {
    conn.exec("INSERT INTO " + table + " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
              {scope, key, std::to_string(::getpid()), std::to_string(tid)});
}

void rethrow_first(const std::vector<std::exception_ptr>& errors) {
    for (const auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
}

}  // namespace

TEST_CASE("64 threads, one key, one start: the effect runs exactly once", "[concurrency]") {
    const auto url = require_db();
    Tables tables(url);
    const auto store_ptr = make_store(url, tables, 16);
    idem::IdempotencyStore& store = *store_ptr;
    const auto scope = idem_test::unique_name("one");
    const idem::Key key(scope, "the-key");
    const auto fp = idem::fingerprint("POST /charges"s, 25000);

    constexpr int kThreads = 64;
    std::atomic<int> runs{0};
    std::latch ready(kThreads);
    std::mutex mutex;
    std::vector<idem::Outcome> outcomes;
    std::vector<std::string> bodies;  // replayed bodies
    std::optional<Response> executed;
    std::vector<std::exception_ptr> errors(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                ready.arrive_and_wait();
                const auto r = idem::execute_once(store, key, fp, [&] {
                    ++runs;
                    PgConn conn(url);
                    insert_effect(conn, tables.effects, scope, key.value(), t);
                    std::this_thread::sleep_for(20ms);  // let the others pile up on the key
                    return Response{
                        201, "charged by thread " + std::to_string(t) + "\0!"s, {{"X-Thread", std::to_string(t)}}};
                });
                std::lock_guard lock(mutex);
                outcomes.push_back(r.outcome());
                if (r.outcome() == Outcome::executed) executed = r.response();
                if (r.outcome() == Outcome::replayed) bodies.push_back(idem::codec<Response>::encode(r.response()));
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& th : threads) th.join();
    rethrow_first(errors);

    CHECK(runs == 1);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::executed) == 1);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::mismatch) == 0);
    CHECK(std::count(outcomes.begin(), outcomes.end(), Outcome::replayed) +
              std::count(outcomes.begin(), outcomes.end(), Outcome::in_progress) ==
          kThreads - 1);
    REQUIRE(executed.has_value());
    const auto stored = idem::codec<Response>::encode(*executed);
    for (const auto& body : bodies) CHECK(body == stored);

    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == 1);
    CHECK(completed_records(admin, tables, store, scope, {"the-key"}) == 1);
    // afterwards, everyone gets the same bytes
    const auto again = idem::execute_once(store, key, fp, [&] {
        ++runs;
        return Response{};
    });
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(idem::codec<Response>::encode(again.response()) == stored);
    CHECK(runs == 1);
    CHECK(store.stats().claims_won == 1);
}

TEST_CASE("64 threads over 1,000 keys: each key's effect exactly once", "[concurrency]") {
    const auto url = require_db();
    Tables tables(url);
    const auto store_ptr = make_store(url, tables, 16);
    idem::IdempotencyStore& store = *store_ptr;
    const auto scope = idem_test::unique_name("many");
    const auto fp = idem::fingerprint("POST /transfers"s);

    constexpr int kThreads = 64;
    constexpr int kKeys = 1000;
    std::array<std::atomic<int>, kKeys> runs{};
    std::mutex mutex;
    std::map<int, std::string> executed_body;
    std::atomic<int> executed{0};
    std::atomic<int> in_progress{0};
    std::atomic<int> mismatched{0};
    std::vector<std::vector<std::pair<int, std::string>>> replays(kThreads);
    std::vector<std::exception_ptr> errors(kThreads);
    std::latch ready(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                PgConn conn(url);  // this thread's connection for its effects
                std::vector<int> order(kKeys);
                std::iota(order.begin(), order.end(), 0);
                std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(t)));
                auto& mine = replays[static_cast<std::size_t>(t)];
                mine.reserve(kKeys);
                ready.arrive_and_wait();
                for (int k : order) {
                    const idem::Key key(scope, "k" + std::to_string(k));
                    const auto r = idem::execute_once(store, key, fp, [&] {
                        ++runs[static_cast<std::size_t>(k)];
                        insert_effect(conn, tables.effects, scope, key.value(), t);
                        return "key " + std::to_string(k) + " done by thread " + std::to_string(t);
                    });
                    switch (r.outcome()) {
                        case Outcome::executed: {
                            ++executed;
                            std::lock_guard lock(mutex);
                            executed_body[k] = r.response();
                            break;
                        }
                        case Outcome::replayed: mine.emplace_back(k, r.response()); break;
                        case Outcome::in_progress: ++in_progress; break;
                        case Outcome::mismatch: ++mismatched; break;
                    }
                }
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& th : threads) th.join();
    rethrow_first(errors);

    CHECK(executed == kKeys);
    CHECK(mismatched == 0);
    CHECK(executed_body.size() == static_cast<std::size_t>(kKeys));
    int multi = 0;
    for (int k = 0; k < kKeys; ++k) {
        if (runs[static_cast<std::size_t>(k)] != 1) ++multi;
    }
    CHECK(multi == 0);
    std::size_t replayed = 0;
    std::size_t wrong_bytes = 0;
    for (const auto& mine : replays) {
        for (const auto& [k, body] : mine) {
            ++replayed;
            if (body != executed_body[k]) ++wrong_bytes;
        }
    }
    CHECK(wrong_bytes == 0);
    CHECK(replayed + static_cast<std::size_t>(in_progress.load()) + static_cast<std::size_t>(kKeys) ==
          static_cast<std::size_t>(kThreads) * kKeys);
    INFO("replayed " << replayed << ", in_progress " << in_progress.load());

    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + tables.effects) == kKeys);
    CHECK(admin.scalar("SELECT count(*) FROM (SELECT key FROM " + tables.effects +
                       " GROUP BY key HAVING count(*) > 1) d") == 0);
    std::vector<std::string> values;
    for (int k = 0; k < kKeys; ++k) values.push_back("k" + std::to_string(k));
    CHECK(completed_records(admin, tables, store, scope, values) == kKeys);
    CHECK(store.stats().claims_won == kKeys);
}

TEST_CASE("4 processes x 8 threads race on 200 keys: one effect row per key", "[concurrency][processes]") {
    const auto url = require_db();
    Tables tables(url);
    const auto store = make_store(url, tables, 1);  // the schema; the workers make it again, all at once
    constexpr int kProcesses = 4;
    constexpr int kKeys = 200;
    constexpr int kThreads = 8;
    // What the database says happened (one effect row per key, and whose) and what the processes
    // say happened must agree, and the outcomes add up.
    const auto ran = race::run_race(IDEM_RACE_WORKER, tables, "procs", kProcesses, kKeys, kThreads, 1500ms);
    PgConn admin(url);
#if defined(IDEM_CONCURRENCY_REDIS)
    race::check_race(admin, tables, ran, kKeys, kThreads, store.get());
#else
    race::check_race(admin, tables, ran, kKeys, kThreads);
#endif
}
