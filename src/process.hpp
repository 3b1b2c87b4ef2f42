// What the stores keep per process (internal): the fence counter no other process shares, the
// fork generation that tells a store it was inherited by a child, and a thread's small index for
// sharding counters.
#pragma once

#include <atomic>
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

}  // namespace idem::detail
