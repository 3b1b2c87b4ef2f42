// Helpers shared by the stores (internal).
#pragma once

#include <algorithm>
#include <chrono>

#include "idem/store.hpp"

namespace idem::detail {

/// A fresh fence token: 63 random bits from OpenSSL's CSPRNG, never 0. Drawn in per-thread batches;
/// a fork() discards the batch in the child, so parent and child never share a fence.
Fence new_fence();

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
