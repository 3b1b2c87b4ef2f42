// idem/fingerprint_secret.hpp — the secret that keys request fingerprints at rest (opt-in).
//
//   idem::PostgresOptions options;
//   options.fingerprint_secret = idem::FingerprintSecret(secret_bytes);  // >= 32 bytes, e.g. random
//   idem::PostgresStore store{conninfo, options};
//
// A request's plain fingerprint (SHA-256 of its parts) lets whoever reads the idempotency table, a
// dump or the Redis keys confirm a guess of a low-entropy request (an amount, a currency, a card
// token): hash the guess and compare. A store given a FingerprintSecret writes
// HMAC-SHA256(secret, "idem.fingerprint.hmac.v1" || plain SHA-256) instead, with algorithm
// hmac_sha256 (2). The store keys the fingerprint itself, on every claim path; callers keep passing
// the plain one.
//
// Comparison follows the row's algorithm (claim_status()): a row written without a secret (sha256) is
// compared with the plain digest, a keyed row with the keyed one. So a table moves to keyed rows
// without false mismatches, and without rewriting anything. A keyed row met by a store without a
// secret is config_error, never a mismatch or a re-run. A keyed row met with another secret is a
// mismatch: rotating the secret means keeping the old one until its rows' retention has passed.
//
// Not printable: no accessor, no stream operator. The secret's bytes are not kept: only the HMAC's
// two absorbed SHA-256 states, which OpenSSL clears when the last copy goes.
// Thread-safety: immutable; copies share the keyed state, and key() may run on any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "idem/fingerprint.hpp"

namespace idem {

/// The key of the HMAC that keys fingerprints at rest (see the top of this header).
class FingerprintSecret {
public:
    /// The shortest secret accepted, in bytes.
    static constexpr std::size_t min_size = 32;

    /// Takes a copy of `bytes` (at least min_size of secret, e.g. 32 random bytes; the same on
    /// every instance sharing the store). Throws config_error when shorter.
    explicit FingerprintSecret(std::string_view bytes);
    /// The last copy frees (and OpenSSL clears) the keyed state.
    ~FingerprintSecret();
    /// Copies (and moves: a moved-from secret stays usable) share the keyed state.
    FingerprintSecret(const FingerprintSecret&) noexcept;
    /// Shares `other`'s keyed state.
    FingerprintSecret& operator=(const FingerprintSecret& other) noexcept;

    /// The keyed form of `fp`: algorithm hmac_sha256, digest HMAC-SHA256(secret, domain tag ||
    /// fp's SHA-256), carrying fp's plain digest too. A fingerprint already keyed (not sha256) is
    /// returned as it is, so keying twice is harmless.
    [[nodiscard]] Fingerprint key(const Fingerprint& fp) const;

private:
    struct Impl;
    std::shared_ptr<const Impl> impl_;
};

}  // namespace idem
