// The async scenario: one io_context thread, AsyncPostgresStore, N coroutines started at once, each
// async_execute_once with an effect awaiting a steady_timer (see the top of inflight.cpp).
#include <idem/asio.hpp>
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "../common/util.hpp"
#include "child.hpp"

namespace bench::inflight {
namespace {

namespace net = boost::asio;

struct AsyncRun {
    idem::asio::AsyncPostgresStore& store;
    const std::vector<idem::Key>& keys;
    const idem::Fingerprint& fp;
    std::chrono::milliseconds effect;
    std::vector<std::uint32_t>& runs_per_key;
    Round& round;
    std::uint64_t in_flight = 0;
    std::uint64_t effects = 0;
    Clock::time_point last_done{};
};

net::awaitable<void> async_request(AsyncRun& run, std::size_t i, bool replay) {
    const auto start = Clock::now();
    run.round.in_flight_max = std::max(run.round.in_flight_max, ++run.in_flight);
    try {
        const idem::Key& key = run.keys[i];
        auto r = co_await idem::asio::async_execute_once(
            run.store, key, run.fp,
            [&run, i]() -> net::awaitable<idem::Response> {
                run.round.effects_max = std::max(run.round.effects_max, ++run.effects);
                net::steady_timer timer(co_await net::this_coro::executor, run.effect);
                co_await timer.async_wait(net::use_awaitable);
                --run.effects;
                ++run.runs_per_key[i];
                co_return idem::Response{kStatus, body_for(run.keys[i])};
            },
            net::use_awaitable);
        run.round.check(r, replay ? idem::Outcome::replayed : idem::Outcome::executed, key);
    } catch (const std::exception& e) {
        run.round.error(e.what());
    }
    --run.in_flight;
    ++run.round.answered;
    run.round.hist->record(ns_since(start));
    run.last_done = Clock::now();
}

void async_round(net::io_context& io, AsyncRun& run, bool replay) {
    const auto t0 = Clock::now();
    // Every request is started before the loop runs: all N are in flight at once.
    for (std::size_t i = 0; i < run.keys.size(); ++i) net::co_spawn(io, async_request(run, i, replay), net::detached);
    io.run();  // returns when every request has completed (an idle store keeps no work)
    io.restart();
    run.round.wall_s = bench::seconds_between(t0, run.last_done);
}

}  // namespace

int run_async(const Options& o) {
    net::io_context io(1);
    idem::PostgresOptions po;
    po.table = o.table;
    po.pool_size = o.connections;
    if (o.statement_timeout_ms > 0) po.statement_timeout = std::chrono::milliseconds(o.statement_timeout_ms);
    idem::asio::AsyncPostgresStore store(io.get_executor(), o.db, po);
    store.blocking().ensure_schema();
    const idem::Fingerprint fp = idem::fingerprint("idem-asio-bench", 1);
    const std::chrono::milliseconds effect(o.effect_ms);

    // Warm-up, untimed: as many requests at once as connections, so every connection is open.
    {
        const auto warm_keys = make_keys(o.connections, "warm-");
        std::vector<std::uint32_t> warm_runs(warm_keys.size());
        Round warm;
        AsyncRun run{store, warm_keys, fp, effect, warm_runs, warm};
        async_round(io, run, false);
        if (warm.correct != warm_keys.size()) {
            std::fprintf(stderr, "%s: async warm-up failed: %s\n", kName, warm.first_error.c_str());
            return 1;
        }
    }

    const auto keys = make_keys(o.requests, "");
    std::printf("rss_before_mb %.2f\n", bench::memory_now().rss_mb);
    std::vector<std::uint32_t> runs_per_key(keys.size());
    Round fresh;
    AsyncRun run_new{store, keys, fp, effect, runs_per_key, fresh};
    async_round(io, run_new, false);
    fresh.print("new", keys.size());
    if (o.replay) {
        Round again;
        AsyncRun run_replay{store, keys, fp, effect, runs_per_key, again};
        async_round(io, run_replay, true);
        again.print("replay", keys.size());
    }
    print_common(runs_per_key, store.stats());
    return 0;
}

}  // namespace bench::inflight
