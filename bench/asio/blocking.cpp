// The blocking scenario: --threads threads, PostgresStore, the same N requests through
// idem::execute_once with an effect that sleeps (see the top of inflight.cpp).
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "child.hpp"

namespace bench::inflight {

int run_blocking(const Options& o) {
    idem::PostgresOptions po;
    po.table = o.table;
    po.pool_size = o.blocking_pool;
    if (o.statement_timeout_ms > 0) po.statement_timeout = std::chrono::milliseconds(o.statement_timeout_ms);
    idem::PostgresStore store(o.db, po);
    store.ensure_schema();
    const idem::Fingerprint fp = idem::fingerprint("idem-asio-bench", 1);
    const std::chrono::milliseconds effect(o.effect_ms);
    const auto keys = make_keys(o.requests, "");
    const auto warm_keys = make_keys(o.threads, "warm-");
    std::vector<std::atomic<std::uint32_t>> runs(keys.size());
    std::atomic<std::uint64_t> in_flight{0}, effects{0}, in_flight_max{0}, effects_max{0};
    const auto raise = [](std::atomic<std::uint64_t>& max, std::uint64_t v) {
        for (auto m = max.load(); v > m && !max.compare_exchange_weak(m, v);) {
        }
    };

    const int phases = o.replay ? 2 : 1;
    std::vector<Round> rounds(o.threads * static_cast<std::size_t>(phases));  // [phase * threads + thread]
    std::atomic<std::size_t> next{0};
    std::atomic<bool> warm_ok{true};
    // The barrier's completion stamps the time before any thread is released: start and end of
    // each phase as the workers see them (the main thread may be scheduled late).
    std::vector<Clock::time_point> marks;
    marks.reserve(static_cast<std::size_t>(1 + 2 * phases));
    const auto mark = [&marks]() noexcept { marks.push_back(Clock::now()); };
    std::barrier sync(static_cast<std::ptrdiff_t>(o.threads + 1), mark);
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < o.threads; ++t) {
        workers.emplace_back([&, t] {
            try {
                // Warm-up, untimed: one call per thread at once, so every connection is open.
                auto w = idem::execute_once(store, warm_keys[t], fp, [] { return idem::Response{kStatus, "warm"}; });
                if (w.outcome() != idem::Outcome::executed) warm_ok = false;
            } catch (const std::exception& e) {
                std::fprintf(stderr, "%s: blocking warm-up: %s\n", kName, e.what());
                warm_ok = false;
            }
            sync.arrive_and_wait();  // warmed up
            for (int phase = 0; phase < phases; ++phase) {
                const bool replay = phase == 1;
                Round& round = rounds[static_cast<std::size_t>(phase) * o.threads + t];
                sync.arrive_and_wait();  // start
                for (std::size_t i = next.fetch_add(1); i < keys.size(); i = next.fetch_add(1)) {
                    const auto start = Clock::now();
                    raise(in_flight_max, ++in_flight);
                    try {
                        auto r = idem::execute_once(store, keys[i], fp, [&, i] {
                            raise(effects_max, ++effects);
                            std::this_thread::sleep_for(effect);
                            --effects;
                            runs[i].fetch_add(1);
                            return idem::Response{kStatus, body_for(keys[i])};
                        });
                        round.check(r, replay ? idem::Outcome::replayed : idem::Outcome::executed, keys[i]);
                    } catch (const std::exception& e) {
                        round.error(e.what());
                    }
                    --in_flight;
                    ++round.answered;
                    round.hist->record(ns_since(start));
                }
                sync.arrive_and_wait();  // done
            }
        });
    }
    sync.arrive_and_wait();  // every thread warmed up
    std::printf("rss_before_mb %.2f\n", bench::memory_now().rss_mb);
    for (int phase = 0; phase < phases; ++phase) {
        next = 0;
        in_flight_max = 0, effects_max = 0;
        sync.arrive_and_wait();
        sync.arrive_and_wait();
        const auto p = static_cast<std::size_t>(1 + 2 * phase);  // marks[0]: the warm-up's end
        const double wall = bench::seconds_between(marks[p], marks[p + 1]);
        Round total;
        for (std::size_t t = 0; t < o.threads; ++t)
            total.merge(rounds[static_cast<std::size_t>(phase) * o.threads + t]);
        total.wall_s = wall;
        total.in_flight_max = in_flight_max;
        total.effects_max = effects_max;
        total.print(phase == 0 ? "new" : "replay", keys.size());
    }
    for (auto& w : workers) w.join();
    if (!warm_ok) {
        std::fprintf(stderr, "%s: blocking warm-up failed\n", kName);
        return 1;
    }
    std::vector<std::uint32_t> runs_per_key(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) runs_per_key[i] = runs[i].load();
    print_common(runs_per_key, store.stats());
    return 0;
}

}  // namespace bench::inflight
