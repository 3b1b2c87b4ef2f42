// The checks (see checks.hpp).
#include "checks.hpp"

#include <fmt/format.h>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "floor.hpp"
#include "phase.hpp"
#include "sides.hpp"

namespace bench {

RssResult rss_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                    const idem::Fingerprint& fp, std::uint64_t seed) {
    RssResult r;
    r.total = static_cast<std::uint64_t>(o.rss_calls);
    const std::string table = tables.add(prefix + "_rss");
    admin.preload(table, Admin::Preload::completed, kReplayBase, o.preload, fp.bytes(), false);
    admin.exec("VACUUM (ANALYZE) " + quote_ident(table));
    idem::PostgresOptions options;
    options.pool_size = static_cast<std::size_t>(o.rss_threads);
    options.table = table;
    idem::PostgresStore store(o.db, options);
    const LibraryOp fresh{{&store}, fp, Case::fresh, o.preload};
    const LibraryOp replay{{&store}, fp, Case::replay, o.preload};

    std::atomic<std::uint64_t> tickets{0};
    std::atomic<std::uint64_t> unexpected{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;
    std::barrier sync(o.rss_threads + 1);
    const auto work = [&](Rng& rng, std::uint64_t limit) {
        while (!failed.load(std::memory_order_relaxed) && tickets.fetch_add(1) < limit) {
            const bool is_new = (rng.next() & 1) != 0;
            const bool ok = is_new ? fresh(0, rng) : replay(0, rng);
            if (!ok && unexpected.fetch_add(1, std::memory_order_relaxed) < 5) {
                std::fprintf(stderr, "  unexpected outcome for a %s call\n", is_new ? "new" : "replay");
            }
        }
    };
    std::vector<std::thread> workers;
    const auto t0 = Clock::now();
    std::fprintf(stderr, "rss check: %llu calls on %d threads (half new, half replay)...\n",
                 static_cast<unsigned long long>(r.total), o.rss_threads);
    for (int t = 0; t < o.rss_threads; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, static_cast<std::uint64_t>(t));
            for (int stage = 0; stage < 2; ++stage) {
                try {
                    work(rng, stage == 0 ? r.first : r.total);
                } catch (const std::exception& e) {
                    std::lock_guard lock(error_mutex);
                    if (error.empty()) error = e.what();
                    failed.store(true);
                }
                if (stage == 0) {
                    sync.arrive_and_wait();  // main reads the RSS
                    sync.arrive_and_wait();  // and lets us go on
                }
            }
        });
    }
    sync.arrive_and_wait();
    r.first_seconds = seconds_between(t0, Clock::now());
    r.at_first = memory_now();
    std::fprintf(stderr, "  %llu calls in %.1f s: RSS %.2f MB\n", static_cast<unsigned long long>(r.first),
                 r.first_seconds, r.at_first.rss_mb);
    tickets.store(r.first);
    sync.arrive_and_wait();
    for (auto& w : workers) w.join();
    r.total_seconds = seconds_between(t0, Clock::now());
    r.at_total = memory_now();
    r.unexpected = unexpected.load();
    if (!error.empty()) throw std::runtime_error(error);
    std::printf("rss check (%d threads, half new / half replay):\n", o.rss_threads);
    std::printf("  after %9llu calls: RSS %7.2f MB  peak %7.2f MB  (%.1f s)\n",
                static_cast<unsigned long long>(r.first), r.at_first.rss_mb, r.at_first.peak_mb, r.first_seconds);
    std::printf("  after %9llu calls: RSS %7.2f MB  peak %7.2f MB  (%.1f s)\n",
                static_cast<unsigned long long>(r.total), r.at_total.rss_mb, r.at_total.peak_mb, r.total_seconds);
    std::printf("  RSS ratio: %.3f   (target 0.95..1.05); unexpected outcomes: %llu\n",
                r.at_total.rss_mb / r.at_first.rss_mb, static_cast<unsigned long long>(r.unexpected));
    std::fflush(stdout);
    return r;
}

bool round_trips_as_expected(const Options& o, const std::vector<Run>& runs) {
    bool ok = true;
    for (const Run& r : runs) {
        const std::uint64_t want = expected_round_trips(r.kind);
        for (const Side& side : r.sides) {
            const std::uint64_t rt = side.counters.round_trips;
            bool good = side.calls > 0 && side.unexpected == 0;
            if (r.kind == Case::replay_cached && (side.kind == SideKind::idem || side.kind == SideKind::idem_gc)) {
                // The cache was filled before timing: at most one miss per hot key and thread
                // (an entry evicted, or threads missing the same key at once).
                good = good && rt <= static_cast<std::uint64_t>(std::min(o.cached_keys, o.preload)) *
                                         static_cast<std::uint64_t>(r.threads);
            } else if (side.kind == SideKind::ideal) {
                good = good && rt * static_cast<std::uint64_t>(r.ideal_group()) == want * side.calls;  // per round
            } else if (side.kind == SideKind::async) {
                // The store's group commit puts calls in flight together: never more than alone.
                good = good && rt > 0 && rt <= want * side.calls;
            } else if (side.kind == SideKind::ideal_threads) {
                // Per round of T callers, plus the smaller rounds while the callers stop: each
                // caller makes at most one call after the phase ends, so at most T of them.
                const auto threads = static_cast<std::uint64_t>(r.threads);
                good = good && rt * threads >= want * side.calls &&
                       rt * threads <= want * side.calls + want * threads * threads;
            } else if (side.kind != SideKind::idem_gc) {
                good = good && rt == want * side.calls;
            }
            if (!good) {
                std::fprintf(stderr,
                             "FAIL: %s at %d %s, %s: %llu round trips for %llu calls (want %llu per "
                             "call), %llu unexpected outcomes\n",
                             case_name(r.kind), r.in_flight > 0 ? r.in_flight : r.threads,
                             r.in_flight > 0 ? "in flight" : "threads", side_name(side.kind),
                             static_cast<unsigned long long>(rt), static_cast<unsigned long long>(side.calls),
                             static_cast<unsigned long long>(want), static_cast<unsigned long long>(side.unexpected));
                ok = false;
            }
        }
    }
    return ok;
}

}  // namespace bench
