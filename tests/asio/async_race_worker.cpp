// idem_async_race_worker — one of several OS processes racing on the same keys through
// idem::asio (see async_concurrency_test.cpp; the blocking counterpart is store/race_worker.cpp).
//
// Usage: idem_async_race_worker CONNINFO TABLE EFFECTS_TABLE SCOPE KEYS COROUTINES START_AT_MS OUTFILE
//
// One AsyncPostgresStore on an io_context run by one thread. Waits until START_AT_MS (milliseconds
// since the Unix epoch) so that every process starts together, then COROUTINES coroutines each walk
// the keys 0..KEYS-1 in their own shuffled order and co_await async_execute_once. The effect INSERTs
// a row (scope, key, pid, tid = coroutine) into EFFECTS_TABLE over a plain libpq connection of its
// own (on a small thread pool: the event loop never blocks on it) and returns the body
// "key=K;pid=P;tid=T". Then every coroutine walks all keys again until each one replays. OUTFILE gets
// one line per call:
//   E <key> <body>    executed here (the effect ran in this process)
//   R <key> <body>    replayed during the race
//   P <key>           in progress during the race
//   F <key> <body>    the final replay of the second pass
// Exit status 0 when every call went as the contract says, 1 otherwise (the reason on stderr).
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "race.hpp"
#include "store_env.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <fstream>
#include <future>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace net = boost::asio;

namespace {

std::vector<std::string> out_lines;  // touched on the store's strand only

}  // namespace

int main(int argc, char** argv) {
    const auto parsed = idem_test::race::WorkerArgs::parse(argc, argv, "COROUTINES");
    if (!parsed) return 2;
    const auto& [conninfo, table, effects, scope, keys, coroutines, start_at_ms, outfile] = *parsed;
    const int pid = static_cast<int>(::getpid());

    std::atomic<int> contract_violations{0};
    int failed = 0;
    try {
        net::io_context io;
        auto work = std::make_optional(net::make_work_guard(io));
        std::thread runner([&] { io.run(); });
        struct Join {
            std::optional<net::executor_work_guard<net::io_context::executor_type>>& work;
            std::thread& runner;
            ~Join() {
                work.reset();
                if (runner.joinable()) runner.join();
            }
        } join{work, runner};

        // The effects' own connections, one per pool thread, opened before the start.
        constexpr int kEffectThreads = 4;
        net::thread_pool pool(kEffectThreads);
        std::vector<std::unique_ptr<idem_test::PgConn>> effect_conns;
        for (int t = 0; t < kEffectThreads; ++t) effect_conns.push_back(std::make_unique<idem_test::PgConn>(conninfo));
        std::atomic<std::size_t> next_conn{0};
        const auto conn_of_this_thread = [&]() -> idem_test::PgConn& {
            thread_local idem_test::PgConn* mine = nullptr;
            if (mine == nullptr) mine = effect_conns.at(next_conn++).get();
            return *mine;
        };

        idem::PostgresOptions options;
        options.table = table;
        options.pool_size = 4;
        options.application_name = "idem_async_race_worker";
        // One effect per key is the point, not how long an answer takes on a loaded machine.
        options.statement_timeout = std::chrono::seconds(60);
        std::optional<idem::asio::AsyncPostgresStore> store;
        store.emplace(io.get_executor(), conninfo, idem_test::env_options(options));
        store->blocking().ensure_schema();  // every process at once: must be harmless
        const auto fp = idem::fingerprint(std::string("race"), std::string(scope));
        (void)store->read(idem::Key(scope, "warm-up"));  // one connection open before the start

        const auto start_at = std::chrono::system_clock::time_point(std::chrono::milliseconds(start_at_ms));
        std::this_thread::sleep_until(start_at);

        const auto walker = [&](int c) -> net::awaitable<void> {
            std::vector<int> order(static_cast<std::size_t>(keys));
            std::iota(order.begin(), order.end(), 0);
            std::mt19937 rng(static_cast<unsigned>(pid * 131 + c));
            std::shuffle(order.begin(), order.end(), rng);
            for (int k : order) {
                const idem::Key key(scope, "key-" + std::to_string(k));
                const auto r = co_await idem::asio::async_execute_once(
                    *store, key, fp,
                    [&, k, c]() -> net::awaitable<std::string> {
                        // The effect, counted outside idem: a row over a plain libpq connection.
                        co_return co_await net::co_spawn(
                            pool,
                            [&, k, c]() -> net::awaitable<std::string> {
                                conn_of_this_thread().exec(
                                    "INSERT INTO " + effects + " (scope, key, pid, tid) VALUES ($1, $2, $3, $4)",
                                    {scope, "key-" + std::to_string(k), std::to_string(pid), std::to_string(c)});
                                co_return idem_test::race::effect_body(k, pid, c);
                            },
                            net::use_awaitable);
                    },
                    net::use_awaitable);
                switch (r.outcome()) {
                    case idem::Outcome::executed:
                        out_lines.push_back("E " + std::to_string(k) + " " + r.response());
                        break;
                    case idem::Outcome::replayed:
                        out_lines.push_back("R " + std::to_string(k) + " " + r.response());
                        break;
                    case idem::Outcome::in_progress:
                        if (r.retry_after().count() <= 0) ++contract_violations;
                        out_lines.push_back("P " + std::to_string(k));
                        break;
                    case idem::Outcome::mismatch:
                        std::cerr << "worker " << pid << ": mismatch on key " << k << "\n";
                        ++contract_violations;
                        break;
                }
            }
            // Second pass: every key must now replay (retry while its executor finishes).
            net::steady_timer pause(co_await net::this_coro::executor);
            for (int k = 0; k < keys; ++k) {
                const idem::Key key(scope, "key-" + std::to_string(k));
                const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
                for (;;) {
                    const auto r = co_await idem::asio::async_execute_once(
                        *store, key, fp,
                        [&, k]() -> std::string {
                            ++contract_violations;  // the effect must never run in the second pass
                            std::cerr << "worker " << pid << ": effect ran again for key " << k << "\n";
                            return "second run";
                        },
                        net::use_awaitable);
                    if (r.outcome() == idem::Outcome::replayed) {
                        out_lines.push_back("F " + std::to_string(k) + " " + r.response());
                        break;
                    }
                    if (r.outcome() != idem::Outcome::in_progress || std::chrono::steady_clock::now() > deadline) {
                        std::cerr << "worker " << pid << ": key " << k << " ended as " << idem::to_string(r.outcome())
                                  << "\n";
                        ++contract_violations;
                        break;
                    }
                    pause.expires_after(std::chrono::milliseconds(5));
                    co_await pause.async_wait(net::use_awaitable);
                }
            }
        };

        std::vector<std::future<void>> all;
        for (int c = 0; c < coroutines; ++c)
            all.push_back(net::co_spawn(store->get_executor(), walker(c), net::use_future));
        for (auto& f : all) {
            try {
                f.get();
            } catch (const std::exception& e) {
                std::cerr << "worker " << pid << ": coroutine failed: " << e.what() << "\n";
                ++failed;
            }
        }
        pool.join();
        const auto stats = store->stats();
        std::cerr << "worker " << pid << ": claims=" << stats.claims << " claims_won=" << stats.claims_won
                  << " round_trips=" << stats.round_trips << " connections_opened=" << stats.connections_opened << "\n";
        store.reset();
    } catch (const std::exception& e) {
        std::cerr << "worker " << pid << ": " << e.what() << "\n";
        return 1;
    }
    failed += contract_violations.load();
    return idem_test::race::finish_worker(*parsed, out_lines, failed);
}
