// Small rules every store follows alike (internal): the fingerprint a store writes, the retry-after
// of a key in progress, how long a PostgreSQL round trip's answer may take. One copy each, so the
// stores (PostgreSQL blocking and Asio, Redis, memory) cannot drift apart. The result-size rule is
// public (idem/errors.hpp: detail::check_result_size), as batch.hpp needs it.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <vector>

#include "idem/fingerprint.hpp"
#include "idem/fingerprint_secret.hpp"

namespace idem::detail {

/// The fingerprint a store writes and compares found records with: `fp` keyed with the store's
/// secret, or `fp` itself without one (idem/fingerprint_secret.hpp). Keyed once per call: every
/// attempt, a group's statement and the found row's classification use the result.
[[nodiscard]] inline Fingerprint keyed(const std::optional<FingerprintSecret>& secret, const Fingerprint& fp) {
    return secret ? secret->key(fp) : fp;
}

/// keyed() for a batch: `fps` itself without a secret; else the keyed ones, kept in `storage`.
[[nodiscard]] inline std::span<const Fingerprint> keyed(const std::optional<FingerprintSecret>& secret,
                                                        std::span<const Fingerprint> fps,
                                                        std::vector<Fingerprint>& storage) {
    if (!secret) return fps;
    storage.clear();
    storage.reserve(fps.size());
    for (const Fingerprint& fp : fps) storage.push_back(secret->key(fp));
    return storage;
}

/// Retry-after hint for an in-progress key: the lease's remaining time, kept within
/// [100 ms, max]. A stale lease (awaiting reconciliation) gives the maximum.
[[nodiscard]] inline std::chrono::milliseconds retry_after_hint(std::chrono::system_clock::time_point lease_until,
                                                                std::chrono::system_clock::time_point now,
                                                                std::chrono::milliseconds max) {
    using std::chrono::milliseconds;
    auto left = std::chrono::duration_cast<milliseconds>(lease_until - now);
    if (left <= milliseconds(0)) return max;
    return std::clamp(left, std::min(milliseconds(100), max), max);
}

/// How long a PostgreSQL store waits for a round trip's answer: the server's own limits on the
/// statement (statement_timeout) and on its lock wait (lock_timeout), and a second for the
/// network. Past it the connection is given up as broken (outcome unknown for a write).
[[nodiscard]] constexpr std::chrono::milliseconds answer_wait(std::chrono::milliseconds statement_timeout,
                                                              std::chrono::milliseconds lock_timeout) noexcept {
    return statement_timeout + lock_timeout + std::chrono::seconds(1);
}

}  // namespace idem::detail
