// How RedisReplayCache keeps a completed record in Redis (internal): a sealed entry that names the
// tier's key prefix, the key and the request fingerprint it answers.
//
// An entry's bytes, integers 64-bit little-endian, every variable field after its length:
//
//   "idem-c3"  the format version (7 bytes)
//   seal       'h': HMAC-SHA256 under the tier's entry_secret; 's': SHA-256 (no secret);
//              'g': AES-256-GCM under the tier's keyring (1 byte)
//   key prefix (RedisOptions::key_prefix of the tier that wrote it), scope, key value,
//   fingerprint algorithm, fingerprint bytes
//   record     fence, attempt, result, phase and phase data (each after a presence byte),
//              created_at, lease_until, expires_at (Unix ms)
//   tag        the HMAC or SHA-256 of every byte before it (32 bytes)
//
// With a keyring ('g') everything after the seal byte is one record sealed by idem::seal for the
// key as a tier entry (idem/sealing.hpp; it does not open as a stored result): the GCM tag
// authenticates the key prefix, key, fingerprint and record as the HMAC would, and none of them
// is readable in Redis. The version and seal byte stay outside the seal: an entry of another
// version or kind is refused before it is opened.
//
// The length prefixes keep a byte from moving between fields (scope "ab" + key "c" and scope "a"
// + key "bc" are different bytes), and the version and seal kind are inside what the tag covers.
// Only the HMAC defends against whoever can write to the Redis: the checksum detects corruption
// and an entry copied into another key's slot, and anyone can compute it for bytes of their own.
// The key prefix is inside too: an entry copied from a tier of another prefix (another deployment
// sharing the Redis, and perhaps the secret) names another prefix.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "idem/key.hpp"
#include "idem/sealing.hpp"
#include "idem/store.hpp"

namespace idem::redis {

/// What seals a tier's entries: HMAC-SHA256 under a secret, or with none a SHA-256 checksum, over
/// entries that name the tier's key prefix. The secret is wiped from memory when the seal goes.
/// Thread-safety: const members may be called from any number of threads at once.
class EntrySeal {
public:
    /// `secret`: empty (a checksum), or the HMAC key (the caller checks its length); `key_prefix`:
    /// the tier's RedisOptions::key_prefix, named in every entry it seals and required of every
    /// entry it opens; `keyring`: when set, entries are sealed under it ('g') and `secret` is unused.
    EntrySeal(std::string secret, std::string key_prefix, std::shared_ptr<const Keyring> keyring = nullptr);
    ~EntrySeal();
    EntrySeal(const EntrySeal&) = delete;
    EntrySeal& operator=(const EntrySeal&) = delete;

    /// The entry of `record` (completed, with a result) for `key`. Throws idem::error when OpenSSL
    /// fails.
    [[nodiscard]] std::string seal(const Key& key, const Record& record) const;

    /// The completed record in `entry`, which was asked for `key`. Throws corrupt_record when the
    /// entry is not to be trusted: of another format or seal kind, truncated, a tag that does not
    /// verify (compared in constant time), another key prefix or key named, or fields that cannot be
    /// decoded.
    /// The record's read_at is left unset. Throws idem::error when OpenSSL fails.
    [[nodiscard]] Record open(const Key& key, std::string_view entry) const;

private:
    [[nodiscard]] char kind() const noexcept;
    [[nodiscard]] std::string body(const Key& key, const Record& record) const;
    [[nodiscard]] Record parse(const Key& key, std::string_view body) const;

    std::string secret_;
    std::string key_prefix_;
    std::shared_ptr<const Keyring> keyring_;
};

}  // namespace idem::redis
