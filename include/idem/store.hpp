// idem/store.hpp — IdempotencyStore: the interface every backend implements.
//
// A key moves through these states (docs/design.md has the full machine):
//
//   (none) --claim--> in_progress{fence} --save(fence)--> completed{result}
//                         |
//                         +--release(fence): the effect certainly did not happen--> (none)
//
// * claim() is the only way to create a record, and the database arbitrates it: exactly one of any
//   number of concurrent claims on a key wins. The winning claim is durable (committed) before
//   claim() returns. Losers get the existing record, classified as in_progress, completed or mismatch.
// * Every write after the claim names the fence token the claim returned. A save or release whose
//   fence no longer owns the key throws lease_lost and changes nothing.
// * Stores are reconnect-safe: a claim/save/release interrupted by a broken connection is retried on
//   a fresh one with the same fence, and recognises its own earlier write.
//
// Thread-safety: every member function may be called from any number of threads at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/fingerprint.hpp"
#include "idem/key.hpp"

namespace idem {

/// Proof of ownership of a claimed key: random, 63 bits, never reused in practice.
using Fence = std::int64_t;

/// Per-call settings; what is left empty takes the store's default.
struct ClaimOptions {
    /// How long the claimer owns the key before it counts as stale (default 30 s).
    std::optional<std::chrono::milliseconds> lease;
    /// How long the record (and so the replay) is kept, counted from the claim (default 24 h).
    std::optional<std::chrono::seconds> retention;
};

enum class RecordState { in_progress, completed };

[[nodiscard]] constexpr std::string_view to_string(RecordState state) noexcept {
    return state == RecordState::in_progress ? "in_progress" : "completed";
}

/// A stored key, as read back.
struct Record {
    RecordState state = RecordState::in_progress;
    Fingerprint fingerprint{FingerprintAlgorithm::sha256, {}};
    Fence fence = 0;
    std::int32_t attempt = 1;
    /// The stored result bytes; set when state == completed.
    std::optional<std::string> result;
    std::chrono::system_clock::time_point created_at;
    std::chrono::system_clock::time_point lease_until;
    std::chrono::system_clock::time_point expires_at;
};

enum class ClaimStatus { claimed, in_progress, completed, mismatch };

/// What claim() decided.
struct Claim {
    ClaimStatus status = ClaimStatus::in_progress;
    /// claimed: the token every later write for this key must carry.
    Fence fence = 0;
    /// in_progress, completed, mismatch: the record found.
    std::optional<Record> existing;
    /// in_progress: when the client should try again.
    std::chrono::milliseconds retry_after{0};
};

/// An in-progress key whose lease has passed: its owner crashed, hangs, or met an unknown outcome.
struct StaleKey {
    Key key;
    Record record;
};

/// Counters since the store was made. A "round trip" is one wait for the database's answer: a
/// pipeline of statements flushed together counts once.
struct StoreStats {
    std::uint64_t round_trips = 0;
    std::uint64_t claims = 0;             ///< claim() calls
    std::uint64_t claims_won = 0;         ///< claims that created the record
    std::uint64_t saves = 0;
    std::uint64_t releases = 0;
    std::uint64_t reads = 0;
    std::uint64_t retries = 0;            ///< statements retried (broken connection, 40001, 55P03...)
    std::uint64_t connections_opened = 0;
    std::uint64_t connections_discarded = 0;  ///< closed after an error or a failed health check
};

class IdempotencyStore {
public:
    virtual ~IdempotencyStore() = default;

    /// Claims `key` for a request with fingerprint `fp`. Durable before it returns.
    /// Throws store_unavailable (nothing claimed by this call) or database_error.
    [[nodiscard]] virtual Claim claim(const Key& key, const Fingerprint& fp,
                                      const ClaimOptions& options = {}) = 0;

    /// Completes the key with `result`. Throws lease_lost if `fence` no longer owns it,
    /// response_too_large if result.size() > max_result_bytes() (before any I/O),
    /// store_unavailable / database_error otherwise.
    virtual void save(const Key& key, Fence fence, std::string_view result) = 0;

    /// Deletes an in-progress claim whose effect certainly did not happen, so the key may run again.
    /// Throws lease_lost if `fence` no longer owns it.
    virtual void release(const Key& key, Fence fence) = 0;

    /// The stored record, if any (expired records included until purged).
    [[nodiscard]] virtual std::optional<Record> read(const Key& key) = 0;

    /// Up to `limit` in-progress keys whose lease has passed, oldest lease first, for a reconciler:
    /// it learns the real outcome and calls save(key, record.fence, ...) or release(...). Two
    /// reconcilers may list the same key; the first write wins and the other gets lease_lost.
    [[nodiscard]] virtual std::vector<StaleKey> list_stale(std::size_t limit) = 0;

    [[nodiscard]] virtual StoreStats stats() const = 0;

    /// Largest result save() accepts, in bytes.
    [[nodiscard]] virtual std::size_t max_result_bytes() const noexcept = 0;

protected:
    IdempotencyStore() = default;
    IdempotencyStore(const IdempotencyStore&) = default;
    IdempotencyStore& operator=(const IdempotencyStore&) = default;
};

/// How a found record answers a claim for fingerprint `fp` (shared by every backend).
[[nodiscard]] ClaimStatus classify(const Record& existing, const Fingerprint& fp) noexcept;

}  // namespace idem
