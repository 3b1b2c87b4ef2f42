// idem/memory_store.hpp — the IdempotencyStore contract in process memory, for your unit tests.
//
// Same semantics as PostgresStore (claims, fences, leases, retention, classification, size limit),
// so code tested against it behaves the same in production — but nothing survives the process, and
// two processes do not share it. Not for production use.
//
// Thread-safety: all members may be called concurrently (one mutex).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

#include "idem/fingerprint_secret.hpp"
#include "idem/store.hpp"

namespace idem {

/// Settings of a MemoryStore.
struct MemoryStoreOptions {
    /// Lease of a claim when ClaimOptions::lease is not set.
    std::chrono::milliseconds default_lease{std::chrono::seconds(30)};
    /// Retention of a completed record when ClaimOptions::retention is not set.
    std::chrono::seconds default_retention{std::chrono::hours(24)};
    /// Upper bound of the retry-after hint of an in_progress answer.
    std::chrono::milliseconds max_retry_after{std::chrono::seconds(1)};
    /// Largest result save() accepts, in bytes.
    std::size_t max_result_bytes = 16u << 20;
    /// The time leases, retention and retry hints are measured against; empty means
    /// std::chrono::system_clock::now. A test injects a clock it moves by hand, so that expiry
    /// happens exactly when the test says. Called from every thread that calls the store, at times
    /// with the store's mutex held: it must be thread-safe and must not call back into the store.
    /// ClaimOptions::wait stays a real wait (steady clock), whatever this clock says.
    std::function<std::chrono::system_clock::time_point()> clock{};
    /// Keyed fingerprints (idem/fingerprint_secret.hpp), as PostgresOptions::fingerprint_secret:
    /// for testing code that runs against a keyed store (records in process memory are not at rest).
    std::optional<FingerprintSecret> fingerprint_secret{};
};

/// The IdempotencyStore contract in process memory, for unit tests (see the top of this header).
class MemoryStore final : public IdempotencyStore {
public:
    /// An empty store.
    explicit MemoryStore(MemoryStoreOptions options = {});
    ~MemoryStore() override;
    MemoryStore(const MemoryStore&) = delete;
    MemoryStore& operator=(const MemoryStore&) = delete;

    [[nodiscard]] Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) override;
    void save(const Key& key, Fence fence, std::string_view result) override;
    void release(const Key& key, Fence fence) override;
    [[nodiscard]] std::optional<Record> read(const Key& key) override;
    void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) override;
    void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) override;
    [[nodiscard]] std::optional<Fence> take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                 bool new_attempt) override;
    [[nodiscard]] std::vector<StaleKey> list_stale(std::size_t limit,
                                                   const ScopeFilter& scopes = ScopeFilter::all()) override;
    [[nodiscard]] std::size_t count_stale(const ScopeFilter& scopes = ScopeFilter::all()) override;
    std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) override;
    /// Calls counted as a database store counts them (each call counts as one round trip).
    [[nodiscard]] StoreStats stats() const override;
    [[nodiscard]] std::size_t max_result_bytes() const noexcept override;
    /// `fp` keyed with MemoryStoreOptions::fingerprint_secret, or `fp` without one.
    [[nodiscard]] Fingerprint key_fingerprint(const Fingerprint& fp) const override;

    /// Number of records held (expired ones included).
    [[nodiscard]] std::size_t size() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace idem
