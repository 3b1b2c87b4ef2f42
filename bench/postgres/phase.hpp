// A timed phase: one side's calls on T threads for a few seconds (run_phase), with the counters
// read before and after it (round trips, group commit, the WAL position) and the client's CPU time.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "admin.hpp"
#include "cases.hpp"

namespace bench {

struct Counters {
    std::uint64_t round_trips = 0, retries = 0, opened = 0;
    /// Group commit (group_commit_stats(); zeros without it). largest_*: since the store was made.
    std::uint64_t claim_groups = 0, grouped_claims = 0, largest_claim_group = 0;
    std::uint64_t save_groups = 0, grouped_saves = 0, largest_save_group = 0;
    std::uint64_t wal_lsn = 0;  ///< set by run_phase (Admin::wal_lsn), not by the side's snapshot
};

/// after - before for the counts; the largest groups as of `after`.
Counters counters_delta(const Counters& after, const Counters& before);

/// The counters of a PostgresStore or an idem::asio::AsyncPostgresStore since it was made: its
/// stats() and group_commit_stats().
template <class Store>
Counters library_counters(const Store& store) {
    const auto s = store.stats();
    const auto g = store.group_commit_stats();
    Counters c;
    c.round_trips = s.round_trips;
    c.retries = s.retries;
    c.opened = s.connections_opened;
    c.claim_groups = g.claim_groups;
    c.grouped_claims = g.grouped_claims;
    c.largest_claim_group = g.largest_claim_group;
    c.save_groups = g.save_groups;
    c.grouped_saves = g.grouped_saves;
    c.largest_save_group = g.largest_save_group;
    return c;
}

/// This process's CPU time (every thread), in seconds.
double process_cpu_seconds();

struct PhaseResult {
    std::uint64_t calls = 0, unexpected = 0;
    double seconds = 0;
    double cpu_seconds = 0;  ///< this process's CPU time during the phase (client side only)
    Counters delta;
    std::uint64_t lsn_from = 0, lsn_to = 0;  ///< WAL positions when the timed calls began and ended
    Histogram hist;
};

// Runs `op(thread, rng)` (true = the expected outcome) on `threads` threads for `seconds`, after
// kWarmupCalls untimed calls per thread. `snapshot()` is read when every thread is ready and again
// after the last one stopped, so the counters cover exactly the timed calls.
template <class Op, class Snapshot>
PhaseResult run_phase(Admin& admin, int threads, double seconds, std::uint64_t seed, Op& op, Snapshot snapshot) {
    const auto n = static_cast<std::size_t>(threads);
    auto hists = std::make_unique<Histogram[]>(n);
    std::vector<std::uint64_t> calls(n, 0), unexpected(n, 0);
    std::atomic<bool> stop{false};
    std::mutex error_mutex;
    std::string error;
    const auto fail = [&](const char* what) {
        std::lock_guard lock(error_mutex);
        if (error.empty()) error = what;
        stop.store(true);
    };
    Counters before;
    Clock::time_point start;
    double cpu_start = 0;
    std::string wal_error;
    // The WAL position from the admin connection (untimed: read before the clock starts). Only this
    // completion step and the main thread use `admin`, never at once.
    const auto wal_lsn = [&]() noexcept -> std::uint64_t {
        try {
            return admin.wal_lsn();
        } catch (const std::exception& e) {
            wal_error = e.what();
            return 0;
        }
    };
    auto on_ready = [&]() noexcept {
        before = snapshot();
        before.wal_lsn = wal_lsn();
        cpu_start = process_cpu_seconds();
        start = Clock::now();
    };
    std::barrier ready(threads + 1, on_ready);
    // An op whose callers wait for one another (ideal_threads) is told when one stops calling.
    const auto leave = [&op](std::size_t t) noexcept {
        if constexpr (requires { op.leave(0); }) op.leave(static_cast<int>(t));
    };
    std::vector<std::thread> workers;
    workers.reserve(n);
    for (std::size_t t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, t);
            bool ok = true;
            try {
                for (int i = 0; i < kWarmupCalls; ++i) (void)op(static_cast<int>(t), rng);
            } catch (const std::exception& e) {
                fail(e.what());
                ok = false;
                leave(t);  // before the barrier: the others' rounds must not wait for this thread
            }
            ready.arrive_and_wait();
            if (!ok) return;
            std::uint64_t done = 0, bad = 0;
            Histogram& h = hists[t];
            try {
                while (!stop.load(std::memory_order_relaxed)) {
                    const auto t0 = Clock::now();
                    const bool good = op(static_cast<int>(t), rng);
                    const auto t1 = Clock::now();
                    h.record(static_cast<std::uint64_t>(std::chrono::nanoseconds(t1 - t0).count()));
                    ++done;
                    if (!good) ++bad;
                }
            } catch (const std::exception& e) {
                fail(e.what());
            }
            leave(t);
            calls[t] = done;
            unexpected[t] = bad;
        });
    }
    ready.arrive_and_wait();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (!stop.load() && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(10), deadline - Clock::now()));
    }
    stop.store(true);
    for (auto& w : workers) w.join();
    const auto end = Clock::now();
    const double cpu_end = process_cpu_seconds();
    if (!error.empty()) throw std::runtime_error(error);
    Counters after = snapshot();
    after.wal_lsn = wal_lsn();
    if (!wal_error.empty()) throw std::runtime_error(wal_error);

    PhaseResult r;
    r.seconds = seconds_between(start, end);
    r.cpu_seconds = cpu_end - cpu_start;
    for (std::size_t t = 0; t < n; ++t) {
        r.calls += calls[t];
        r.unexpected += unexpected[t];
        r.hist.merge(hists[t]);
    }
    r.delta = counters_delta(after, before);
    r.lsn_from = before.wal_lsn;
    r.lsn_to = after.wal_lsn;
    return r;
}

}  // namespace bench
