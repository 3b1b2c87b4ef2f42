// The Redis connection pool (internal: src/redis/connection.hpp), against a throwaway redis-server:
// waiting callers are served first come, first served — a caller that gives a connection back and
// asks again queues behind the one already waiting — a wait ends in pool_timeout and leaves the
// queue, and a closed connection's place goes to the longest waiter.
#include "redis/connection.hpp"

#include "idem/errors.hpp"
#include "redis_server.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using idem::redis::Pool;
using idem_test::RedisServer;

namespace {

RedisServer& server() {
    static RedisServer s;
    return s;
}

Pool::Opener opener() {
    return [] { return std::make_unique<idem::redis::Connection>(server().store_options()); };
}

// Polls (generously bounded) until `n` callers wait in pool.acquire().
void wait_for_waiters(const Pool& pool, std::size_t n) {
    const auto give_up = std::chrono::steady_clock::now() + 60s;
    while (pool.waiting() != n) {
        REQUIRE(std::chrono::steady_clock::now() < give_up);
        std::this_thread::sleep_for(1ms);
    }
}

// Who got the connection, in order.
class Order {
public:
    void add(const std::string& who) {
        std::lock_guard lock(mutex_);
        names_.push_back(who);
    }
    std::vector<std::string> names() {
        std::lock_guard lock(mutex_);
        return names_;
    }

private:
    std::mutex mutex_;
    std::vector<std::string> names_;
};

}  // namespace

TEST_CASE("a caller that gives back and asks again queues behind the one waiting", "[redis][pool]") {
    Pool pool(1, 60s, opener());
    Order order;
    std::optional<Pool::Lease> held(pool.acquire());
    auto waiter = std::async(std::launch::async, [&] {
        auto lease = pool.acquire();
        order.add("waiter");
        std::this_thread::sleep_for(20ms);  // holds it a while: the asker must wait, not barge in
    });
    wait_for_waiters(pool, 1);
    held.reset();  // given back while the waiter waits...
    {
        auto again = pool.acquire();  // ...and asked for again at once
        order.add("asker");
    }
    waiter.get();
    CHECK(order.names() == std::vector<std::string>{"waiter", "asker"});
    CHECK(pool.opened == 1);
}

TEST_CASE("waiters are served in the order they came", "[redis][pool]") {
    Pool pool(1, 60s, opener());
    Order order;
    std::optional<Pool::Lease> held(pool.acquire());
    std::vector<std::future<void>> waiters;
    for (int i = 0; i < 5; ++i) {
        const std::string name = "w" + std::to_string(i);
        waiters.push_back(std::async(std::launch::async, [&, name] {
            auto lease = pool.acquire();
            order.add(name);
        }));
        wait_for_waiters(pool, static_cast<std::size_t>(i) + 1);
    }
    held.reset();
    for (auto& w : waiters) w.get();
    CHECK(order.names() == std::vector<std::string>{"w0", "w1", "w2", "w3", "w4"});
    CHECK(pool.waiting() == 0);
}

TEST_CASE("a wait ends in pool_timeout and leaves the queue", "[redis][pool]") {
    Pool pool(1, 100ms, opener());
    std::optional<Pool::Lease> held(pool.acquire());
    CHECK_THROWS_AS(pool.acquire(), idem::pool_timeout);
    CHECK(pool.waiting() == 0);
    held.reset();
    auto lease = pool.acquire();  // the connection given back is there for the next caller
    CHECK(pool.opened == 1);
}

TEST_CASE("a discarded connection's place goes to the longest waiter", "[redis][pool]") {
    Pool pool(1, 60s, opener());
    std::optional<Pool::Lease> held(pool.acquire());
    auto waiter = std::async(std::launch::async, [&] {
        auto lease = pool.acquire();
        lease->append({"PING"});
        const auto reply = lease->read("PING");
        return std::string(idem::redis::text_of(*reply));
    });
    wait_for_waiters(pool, 1);
    held->discard();
    CHECK(waiter.get() == "PONG");
    CHECK(pool.opened == 2);
    CHECK(pool.discarded == 1);
}

TEST_CASE("a failed open gives its place to the next waiter", "[redis][pool]") {
    std::atomic<int> opens{0};
    Pool pool(1, 60s, [&]() -> std::unique_ptr<idem::redis::Connection> {
        if (opens++ == 1) throw idem::store_unavailable("refused for the test");
        return std::make_unique<idem::redis::Connection>(server().store_options());
    });
    std::optional<Pool::Lease> held(pool.acquire());                             // open #0
    auto first = std::async(std::launch::async, [&] { (void)pool.acquire(); });  // open #1 fails
    wait_for_waiters(pool, 1);
    auto second = std::async(std::launch::async, [&] { (void)pool.acquire(); });  // open #2 succeeds
    wait_for_waiters(pool, 2);
    held->discard();
    CHECK_THROWS_AS(first.get(), idem::store_unavailable);
    CHECK_NOTHROW(second.get());
    CHECK(opens == 3);
    CHECK(pool.waiting() == 0);
}

TEST_CASE("64 threads on 4 connections, each giving back and asking again: nobody starves", "[redis][pool]") {
    // Without first come, first served, a thread that gives back and asks again takes the
    // connection before the woken waiter runs; the pool's wait is far above any fair turn.
    Pool pool(4, 30s, opener());
    constexpr int kThreads = 64;
    constexpr int kRounds = 200;
    std::atomic<int> timeouts{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&] {
            for (int i = 0; i < kRounds; ++i) {
                try {
                    auto lease = pool.acquire();
                    lease->append({"PING"});
                    (void)lease->read("PING");
                } catch (const idem::pool_timeout&) {
                    ++timeouts;
                }
            }
        });
    }
    for (auto& t : threads) t.join();
    CHECK(timeouts == 0);
    CHECK(pool.opened == 4);
}

TEST_CASE("discards, answers owed, failed opens, drop_idle and timeouts leave exactly size places", "[redis][pool]") {
    constexpr std::size_t kSize = 3;
    std::atomic<int> opens{0};
    std::atomic<bool> fail_opens{true};
    Pool pool(kSize, 5ms, [&]() -> std::unique_ptr<idem::redis::Connection> {
        const int n = opens++;
        if (fail_opens && n % 4 == 1) throw idem::store_unavailable("refused for the test");
        return std::make_unique<idem::redis::Connection>(server().store_options());
    });
    constexpr int kThreads = 12;
    std::atomic<int> timeouts{0}, failed{0}, ok{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            std::mt19937 rng(static_cast<unsigned>(t * 7919 + 1));
            for (int i = 0; i < 400; ++i) {
                try {
                    auto lease = pool.acquire();
                    ++ok;
                    switch (rng() % 6) {
                        case 0: lease.discard(); break;
                        case 1: lease->append({"PING"}); break;  // given back owing an answer: closed
                        case 2: pool.drop_idle(); break;
                        case 3: {
                            Pool::Lease moved(std::move(lease));  // moved-from lease gives nothing back
                            (void)moved;
                            break;
                        }
                        default: {
                            lease->append({"PING"});
                            (void)lease->read("PING");
                        }
                    }
                } catch (const idem::pool_timeout&) {
                    ++timeouts;
                } catch (const idem::store_unavailable&) {
                    ++failed;
                }
            }
        });
    }
    for (auto& t : threads) t.join();
    INFO("ok " << ok << " timeouts " << timeouts << " failed opens " << failed << " opened " << pool.opened
               << " discarded " << pool.discarded);
    CHECK(pool.waiting() == 0);
    fail_opens = false;
    // Exactly kSize places: kSize leases at once, and one more times out.
    std::vector<std::optional<Pool::Lease>> held;
    for (std::size_t i = 0; i < kSize; ++i) REQUIRE_NOTHROW(held.emplace_back(pool.acquire()));
    CHECK_THROWS_AS(pool.acquire(), idem::pool_timeout);
    held.clear();
    // Every connection opened and not closed is idle now: opened - discarded of them.
    const auto alive = pool.opened.load() - pool.discarded.load();
    CHECK(alive <= kSize);
    pool.drop_idle();
    CHECK(pool.opened.load() - pool.discarded.load() == 0);
    CHECK(ok > 0);
    CHECK(failed > 0);
}
