// idem/pool_stats.hpp — what a store's connection pool is doing: open, idle and waiting now, and
// how long callers waited for a connection.
//
//   const idem::PoolStats p = store.pool_stats();          // PostgresStore, AsyncPostgresStore
//   if (p.waiters > 0) ...                                 // every connection is leased right now
//   p.waited / double(p.acquires)                          // the share of acquires that had to wait
//
// The figures a pool keeps for monitoring (idem::PrometheusObserver renders them as
// idem_pool_* metrics, see idem/prometheus.hpp). PostgresStore reads the gauges (open, idle,
// waiters) under the pool's lock, so they are consistent with one another; AsyncPostgresStore,
// whose connections each carry many requests, reads open and idle at one instant and waiters
// apart (idem/asio/store.hpp says what each figure means there). The counters only grow.
// Thread-safety: a plain value; both stores' pool_stats() may be called from any thread.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace idem {

/// A snapshot of a connection pool: gauges now, counters since the store was made.
struct PoolStats {
    /// Upper bounds, in seconds, of the acquire-wait histogram (waits_within): from 0.5 ms to 10 s.
    static constexpr std::array<double, 14> wait_bounds{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                        0.1,    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};

    std::size_t size = 0;  ///< the most connections the pool may open (PostgresOptions::pool_size)
    std::size_t open = 0;  ///< connections open now: idle, leased, or being opened
    std::size_t idle = 0;  ///< open connections no caller holds now
    /// Callers waiting now for a connection to come back (none was free), including those group
    /// commit queues. The counters below count the pool's own waits: a caller queued by group
    /// commit waits in the pool only when it leads a group.
    std::size_t waiters = 0;
    /// Requests for a connection (one per statement or pipeline a call sends, roughly), including
    /// those that then waited, timed out, or failed to connect.
    std::uint64_t acquires = 0;
    /// Acquires that found every connection leased and the pool full, so waited for one to come back
    /// (opening a new connection is not waiting).
    std::uint64_t waited = 0;
    std::uint64_t timeouts = 0;             ///< acquires that waited pool_wait in vain: pool_timeout
    std::chrono::nanoseconds wait_time{0};  ///< the time all acquires spent waiting, summed
    /// waits_within[i]: acquires that waited (waited > 0) for at most wait_bounds[i] seconds —
    /// cumulative, so waits_within.back() <= waited; the rest waited longer than the last bound.
    std::array<std::uint64_t, wait_bounds.size()> waits_within{};
};

}  // namespace idem
