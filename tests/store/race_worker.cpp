// idem_race_worker — one of several OS processes racing on the same keys (see
// concurrency_test.cpp).
//
// Usage: idem_race_worker CONNINFO TABLE EFFECTS_TABLE SCOPE KEYS THREADS START_AT_MS OUTFILE
//
// Built three times: on PostgresStore (TABLE); as idem_redis_race_worker (IDEM_CONCURRENCY_REDIS)
// on RedisStore at the socket in IDEM_RACE_REDIS_SOCKET, under the key prefix "TABLE:"; as
// idem_tiered_race_worker (IDEM_CONCURRENCY_TIERED) on CachedStore{ReplayCache, RedisReplayCache
// at that socket} in front of PostgresStore (TABLE). The effect rows go to PostgreSQL (CONNINFO).
//
// Waits until START_AT_MS (milliseconds since the Unix epoch) so that every process starts
// together, then THREADS threads each walk the keys 0..KEYS-1 in their own shuffled order and call
// execute_once. The effect INSERTs a row (scope, key, pid, tid) into EFFECTS_TABLE over its own
// connection and returns the body "key=K;pid=P;tid=T". Then every thread walks all keys again until
// each one replays. OUTFILE gets one line per call:
//   E <key> <body>    executed here (the effect ran in this process)
//   R <key> <body>    replayed during the race
//   P <key>           in progress during the race
//   F <key> <body>    the final replay of the second pass
// Exit status 0 when every call went as the contract says, 1 otherwise (the reason on stderr).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "race.hpp"
#include "store_env.hpp"
#if defined(IDEM_CONCURRENCY_REDIS) || defined(IDEM_CONCURRENCY_TIERED)
#include <cstdlib>
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#endif

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <latch>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

std::mutex out_mutex;
std::vector<std::string> out_lines;

void emit(std::string line) {
    std::lock_guard lock(out_mutex);
    out_lines.push_back(std::move(line));
}

}  // namespace

int main(int argc, char** argv) {
    const auto parsed = idem_test::race::WorkerArgs::parse(argc, argv, "THREADS");
    if (!parsed) return 2;
    const auto& [conninfo, table, effects, scope, keys, thread_count, start_at_ms, outfile] = *parsed;
    const int pid = static_cast<int>(::getpid());

    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(thread_count));
    std::atomic<int> contract_violations{0};
    try {
#if defined(IDEM_CONCURRENCY_REDIS)
        // RedisStore on the parent's redis-server, under the key prefix TABLE:.
        const char* socket = std::getenv("IDEM_RACE_REDIS_SOCKET");
        if (socket == nullptr) {
            std::cerr << "idem_redis_race_worker: IDEM_RACE_REDIS_SOCKET is not set\n";
            return 2;
        }
        idem::RedisOptions options;
        options.unix_socket = socket;
        options.key_prefix = table + ":";
        options.pool_size = static_cast<std::size_t>(thread_count);
        idem::RedisStore store(options);
#else
        idem::PostgresOptions options;
        options.table = table;
        options.pool_size = static_cast<std::size_t>(thread_count);
        // Fewer connections than threads (the group commit suite): callers that find none free
        // group their claims and saves.
        if (const char* pool = std::getenv("IDEM_RACE_POOL_SIZE")) options.pool_size = std::stoul(pool);
        options.application_name = "idem_race_worker";
        // A race on a loaded machine (a Citus coordinator doing the work of three servers): one
        // effect per key is the point, not how long a caller waits for a connection or an answer.
        options.pool_wait = std::chrono::seconds(120);
        options.statement_timeout = std::chrono::seconds(60);
        options.connect_timeout = std::chrono::seconds(60);  // 32 connections at once, same reason
#if defined(IDEM_CONCURRENCY_TIERED)
        idem::PostgresStore primary(conninfo, idem_test::env_options(options));
        primary.ensure_schema();  // every process at once: must be harmless
        const char* socket = std::getenv("IDEM_RACE_REDIS_SOCKET");
        if (socket == nullptr) {
            std::cerr << "idem_tiered_race_worker: IDEM_RACE_REDIS_SOCKET is not set\n";
            return 2;
        }
        idem::RedisReplayCacheOptions cache;
        cache.connection.unix_socket = socket;
        cache.connection.key_prefix = table + ":";
        cache.connection.pool_size = static_cast<std::size_t>(thread_count);
        idem::CachedStore store(
            primary, {std::make_shared<idem::ReplayCache>(), std::make_shared<idem::RedisReplayCache>(cache)});
#else
        idem::PostgresStore store(conninfo, idem_test::env_options(options));
        store.ensure_schema();  // every process at once: must be harmless
#endif
#endif
        const auto fp = idem::fingerprint(std::string("race"), std::string(scope));

        // Each thread connects for its effect before the start, so the race is about idem only.
        std::vector<std::unique_ptr<idem_test::PgConn>> effect_conns;
        for (int t = 0; t < thread_count; ++t) {
            effect_conns.push_back(std::make_unique<idem_test::PgConn>(conninfo));
        }

        const auto start_at = std::chrono::system_clock::time_point(std::chrono::milliseconds(start_at_ms));
        std::this_thread::sleep_until(start_at);

        std::latch go(thread_count);
        std::vector<std::thread> threads;
        for (int t = 0; t < thread_count; ++t) {
            threads.emplace_back([&, t] {
                try {
                    auto& conn = *effect_conns[static_cast<std::size_t>(t)];
                    std::vector<int> order(static_cast<std::size_t>(keys));
                    std::iota(order.begin(), order.end(), 0);
                    std::mt19937 rng(static_cast<unsigned>(pid * 131 + t));
                    std::shuffle(order.begin(), order.end(), rng);
                    go.arrive_and_wait();

                    for (int k : order) {
                        const idem::Key key(scope, "key-" + std::to_string(k));
                        const auto r = idem::execute_once(store, key, fp, [&] {
                            conn.exec("INSERT INTO " + effects + " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
                                      {scope, key.value(), std::to_string(pid), std::to_string(t)});
                            return idem_test::race::effect_body(k, pid, t);
                        });
                        switch (r.outcome()) {
                            case idem::Outcome::executed: emit("E " + std::to_string(k) + " " + r.response()); break;
                            case idem::Outcome::replayed: emit("R " + std::to_string(k) + " " + r.response()); break;
                            case idem::Outcome::in_progress:
                                if (r.retry_after().count() <= 0) ++contract_violations;
                                emit("P " + std::to_string(k));
                                break;
                            case idem::Outcome::mismatch:
                                std::cerr << "worker " << pid << ": mismatch on key " << k << "\n";
                                ++contract_violations;
                                break;
                        }
                    }
                    // Second pass: every key must now replay (retry while its executor finishes).
                    for (int k = 0; k < keys; ++k) {
                        const idem::Key key(scope, "key-" + std::to_string(k));
                        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
                        for (;;) {
                            const auto r = idem::execute_once(store, key, fp, [&]() -> std::string {
                                ++contract_violations;  // the effect must never run in the second
                                                        // pass
                                std::cerr << "worker " << pid << ": effect ran again for key " << k << "\n";
                                return "second run";
                            });
                            if (r.outcome() == idem::Outcome::replayed) {
                                emit("F " + std::to_string(k) + " " + r.response());
                                break;
                            }
                            if (r.outcome() != idem::Outcome::in_progress ||
                                std::chrono::steady_clock::now() > deadline) {
                                std::cerr << "worker " << pid << ": key " << k << " ended as "
                                          << idem::to_string(r.outcome()) << "\n";
                                ++contract_violations;
                                break;
                            }
                            std::this_thread::sleep_for(std::chrono::milliseconds(5));
                        }
                    }
                } catch (...) {
                    errors[static_cast<std::size_t>(t)] = std::current_exception();
                }
            });
        }
        for (auto& th : threads) th.join();
    } catch (const std::exception& e) {
        std::cerr << "worker " << pid << ": " << e.what() << "\n";
        return 1;
    }
    int failed = contract_violations.load();
    for (auto& e : errors) {
        if (!e) continue;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            std::cerr << "worker " << pid << ": thread failed: " << ex.what() << "\n";
        }
        ++failed;
    }
    return idem_test::race::finish_worker(*parsed, out_lines, failed);
}
