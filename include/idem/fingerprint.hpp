// idem/fingerprint.hpp — what the request said, so a reused key with a different request is caught.
//
// fingerprint(parts...) is SHA-256 (OpenSSL EVP) over an unambiguous encoding: a domain tag, then for
// each part a type tag, its length (8 bytes, big-endian) and its bytes. So ("ab","c") != ("a","bc"),
// 1 != "1", and int64 123 == int 123 (integers are encoded as 8-byte big-endian two's complement,
// signed and unsigned tagged apart). Floating point is refused at compile time: money is integer cents.
// Field order matters and is the caller's: list the parts in a fixed order, not in the order of a
// JSON object. Stored as bytes together with an algorithm tag.
//
// Keyed at rest (opt-in): a store given a FingerprintSecret (idem/fingerprint_secret.hpp) writes
// HMAC-SHA256(secret, domain tag || this SHA-256) with algorithm hmac_sha256 instead, so whoever
// reads the table, a dump or the Redis keys cannot confirm a guess of a low-entropy request. The
// store keys the fingerprint itself; callers go on passing the plain one.
//
// Thread-safety: Fingerprint is an immutable value; FingerprintBuilder is not shareable while in use.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace idem {

/// The digest a Fingerprint holds; stored with it (fingerprint_alg), so rows of both kinds coexist.
enum class FingerprintAlgorithm : std::int16_t {
    sha256 = 1,       ///< the plain SHA-256 of the request's parts (fingerprint())
    hmac_sha256 = 2,  ///< that digest keyed with a FingerprintSecret (idem/fingerprint_secret.hpp)
};

/// "sha256" or "hmac-sha256" (what idemctl prints before the hex digest).
[[nodiscard]] constexpr std::string_view to_string(FingerprintAlgorithm algorithm) noexcept {
    return algorithm == FingerprintAlgorithm::hmac_sha256 ? "hmac-sha256" : "sha256";
}

/// The SHA-256 of a request's parts (see fingerprint()), or that digest keyed with a
/// FingerprintSecret: a reused key with another fingerprint is a mismatch (claim_status()).
class Fingerprint {
public:
    /// Digest size in bytes.
    static constexpr std::size_t size = 32;
    /// The digest's bytes.
    using Digest = std::array<std::byte, size>;

    /// A fingerprint from a digest computed elsewhere (fingerprint() and FingerprintBuilder make
    /// them).
    Fingerprint(FingerprintAlgorithm algorithm, const Digest& digest) noexcept
        : algorithm_(algorithm), digest_(digest) {}

    /// A keyed fingerprint (hmac_sha256) that also carries the plain SHA-256 it was made from
    /// (FingerprintSecret::key() makes them): a claim compares a row written before the secret was
    /// set (algorithm sha256) with `plain`. The plain digest is never stored: bytes() is `digest`.
    Fingerprint(FingerprintAlgorithm algorithm, const Digest& digest, const Digest& plain) noexcept
        : algorithm_(algorithm), digest_(digest), plain_(plain) {}

    /// Rebuilds a fingerprint from stored bytes; throws corrupt_record on a wrong length or an
    /// unknown algorithm. A keyed one rebuilt this way knows no plain digest.
    static Fingerprint from_bytes(std::int16_t algorithm, std::string_view bytes);

    /// The algorithm of the digest.
    [[nodiscard]] FingerprintAlgorithm algorithm() const noexcept { return algorithm_; }
    /// The digest.
    [[nodiscard]] const Digest& digest() const noexcept { return digest_; }
    /// The plain SHA-256 of the request: digest() for sha256; for a keyed fingerprint, the digest it
    /// was made from, or null when it was rebuilt from stored bytes (from_bytes()).
    [[nodiscard]] const Digest* plain_digest() const noexcept {
        if (algorithm_ == FingerprintAlgorithm::sha256) return &digest_;
        return plain_ ? &*plain_ : nullptr;
    }
    /// The same fingerprint without the plain digest it carries: what a store keeps.
    [[nodiscard]] Fingerprint stored() const noexcept { return Fingerprint(algorithm_, digest_); }
    /// The digest as 32 raw bytes (what the store keeps).
    [[nodiscard]] std::string_view bytes() const noexcept {
        return {reinterpret_cast<const char*>(digest_.data()), digest_.size()};
    }
    /// The digest in lower-case hexadecimal (64 characters), for logs.
    [[nodiscard]] std::string hex() const;

    /// Same algorithm and digest (the plain digest a keyed one carries is not compared).
    // (memcmp: the defaulted member-wise == compared the 32 bytes one by one, on every replay)
    friend bool operator==(const Fingerprint& a, const Fingerprint& b) noexcept {
        return a.algorithm_ == b.algorithm_ && std::memcmp(a.digest_.data(), b.digest_.data(), size) == 0;
    }

private:
    FingerprintAlgorithm algorithm_;
    Digest digest_;
    std::optional<Digest> plain_{};  // a keyed fingerprint's plain digest (FingerprintSecret::key())
};

/// Incremental form of fingerprint(): add parts, then finish() once.
class FingerprintBuilder {
public:
    FingerprintBuilder();
    ~FingerprintBuilder();
    /// Moves the digest in progress.
    FingerprintBuilder(FingerprintBuilder&&) noexcept;
    /// Moves the digest in progress.
    FingerprintBuilder& operator=(FingerprintBuilder&&) noexcept;
    FingerprintBuilder(const FingerprintBuilder&) = delete;
    FingerprintBuilder& operator=(const FingerprintBuilder&) = delete;

    /// Adds a text part (tagged as text: "1" differs from the integer 1).
    FingerprintBuilder& add_string(std::string_view text);
    /// Adds a binary part.
    FingerprintBuilder& add_bytes(std::span<const std::byte> bytes);
    /// Adds a signed integer (8 bytes, big-endian two's complement).
    FingerprintBuilder& add_signed(std::int64_t number);
    /// Adds an unsigned integer (8 bytes, big-endian; tagged apart from signed ones).
    FingerprintBuilder& add_unsigned(std::uint64_t number);
    /// Adds a boolean.
    FingerprintBuilder& add_bool(bool flag);

    template <class T>
    /// Adds `part` by its type: bool, char, integers, enums (their underlying value), anything
    /// convertible to std::string_view or to std::span<const std::byte>. Floating point does not
    /// compile.
    FingerprintBuilder& add(const T& part) {
        using U = std::remove_cvref_t<T>;
        static_assert(!std::is_floating_point_v<U>,
                      "idem::fingerprint: floating point is ambiguous; use integer units (cents)");
        if constexpr (std::is_same_v<U, bool>) {
            return add_bool(part);
        } else if constexpr (std::is_same_v<U, char>) {
            return add_string(std::string_view(&part, 1));
        } else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) {
            return add_signed(static_cast<std::int64_t>(part));
        } else if constexpr (std::is_integral_v<U>) {
            return add_unsigned(static_cast<std::uint64_t>(part));
        } else if constexpr (std::is_enum_v<U>) {
            return add(static_cast<std::underlying_type_t<U>>(part));
        } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
            return add_string(std::string_view(part));
        } else if constexpr (std::is_convertible_v<const U&, std::span<const std::byte>>) {
            return add_bytes(std::span<const std::byte>(part));
        } else {
            static_assert(sizeof(U) == 0, "idem::fingerprint: unsupported part type");
        }
    }

    /// Finishes the digest; the builder is spent afterwards (adding again throws std::logic_error).
    [[nodiscard]] Fingerprint finish();

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

/// SHA-256 of the canonical encoding of `parts`, in the order given.
template <class... Parts>
[[nodiscard]] Fingerprint fingerprint(const Parts&... parts) {
    FingerprintBuilder builder;
    (builder.add(parts), ...);
    return builder.finish();
}

}  // namespace idem
