// The waits of a connection pool's acquires, for PoolStats (internal): one count per acquire that
// waited, in the bucket of its total wait, and the waits summed. Used by the blocking pool
// (src/postgres/pool.cpp) and by AsyncPostgresStore's connections (src/asio/pool_gauges.hpp).
// Lock-free; record() and add_to() may run on any threads at once.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "idem/pool_stats.hpp"

namespace idem::detail {

class PoolWaits {
public:
    /// One acquire that waited `waited` in all.
    void record(std::chrono::nanoseconds waited) noexcept {
        const std::int64_t nanos = waited.count();
        std::size_t bucket = 0;
        while (bucket < kBoundNanos.size() && nanos > kBoundNanos[bucket]) ++bucket;
        buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
        nanos_.fetch_add(nanos, std::memory_order_relaxed);
    }

    /// Sets s.waited, s.wait_time and s.waits_within (cumulative) from the waits recorded so far.
    void add_to(PoolStats& s) const noexcept {
        std::uint64_t within = 0;
        for (std::size_t i = 0; i < buckets_.size(); ++i) {
            within += buckets_[i].load(std::memory_order_relaxed);
            if (i < s.waits_within.size()) s.waits_within[i] = within;
        }
        s.waited = within;
        s.wait_time = std::chrono::nanoseconds(nanos_.load(std::memory_order_relaxed));
    }

private:
    // PoolStats::wait_bounds in whole nanoseconds (a wait of exactly a bound is within it).
    static constexpr auto kBoundNanos = [] {
        std::array<std::int64_t, PoolStats::wait_bounds.size()> nanos{};
        for (std::size_t i = 0; i < nanos.size(); ++i) {
            nanos[i] = static_cast<std::int64_t>(PoolStats::wait_bounds[i] * 1e9 + 0.5);
        }
        return nanos;
    }();

    // buckets_[i]: within wait_bounds[i] and above the bound before; the last: longer than all.
    std::array<std::atomic<std::uint64_t>, PoolStats::wait_bounds.size() + 1> buckets_{};
    std::atomic<std::int64_t> nanos_{0};
};

}  // namespace idem::detail
