// Helpers shared by the stores (internal).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "idem/store.hpp"

namespace idem::detail {

/// A fresh fence token: 63 bits, never 0, positive as a PostgreSQL bigint. Never repeats within a
/// process (a counter through a bijection keyed by a CSPRNG draw); a fork()ed child draws its own
/// key, so parent and child do not share a sequence. Thread-safe; no lock after a thread's first call.
Fence new_fence();

/// Bumped in the child of every fork(): a store compares it with the value at its construction to
/// know it is used (or destroyed) in a process that does not own its connections and thread.
std::uint64_t fork_generation() noexcept;

/// A small per-thread number (0, 1, 2, … in order of first use), for sharding by thread.
inline std::size_t thread_index() noexcept {
    static std::atomic<std::size_t> next{0};
    thread_local const std::size_t index = next.fetch_add(1, std::memory_order_relaxed);
    return index;
}

/// Retry-after hint for an in-progress key: the lease's remaining time, kept within
/// [100 ms, max]. A stale lease (awaiting reconciliation) gives the maximum.
inline std::chrono::milliseconds retry_after_hint(std::chrono::system_clock::time_point lease_until,
                                                  std::chrono::system_clock::time_point now,
                                                  std::chrono::milliseconds max) {
    using std::chrono::milliseconds;
    auto left = std::chrono::duration_cast<milliseconds>(lease_until - now);
    if (left <= milliseconds(0)) return max;
    return std::clamp(left, std::min(milliseconds(100), max), max);
}

}  // namespace idem::detail
