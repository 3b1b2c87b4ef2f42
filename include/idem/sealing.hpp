// idem/sealing.hpp — sealed responses: stored results encrypted and authenticated at rest.
//
// With sealing on (PostgresOptions::sealing, RedisOptions::sealing, and a RedisReplayCache's
// connection.sealing) a store writes every result it saves as a sealed record and opens it again
// when it reads it back, so a reader of the table, of a dump or of Redis does not see the bytes
// (their length is visible: the record is the result plus seal_overhead), and a writer cannot make
// idem replay bytes idem did not seal:
//
//   "idS2" | key id (4, big-endian) | salt (16) | nonce (12) | AES-256-GCM ciphertext | tag (16)
//
// The record key is HMAC-SHA256(keyring key, "idem/seal/v1" | salt): every distinct record has a
// key of its own, so one keyring key can seal any number of records without the 2^32 limit of
// random GCM nonces under one key. Salt and nonce are a synthetic IV, HMAC-SHA256 under the keyring
// key of the key id, purpose, key and plaintext: sealing the same result for the same key again
// gives the same bytes (a save repeated after a lost answer is recognised as already stored), and
// no one without the keyring can compute it. The associated data is the header, the purpose (a
// stored result, a replay-tier entry), the key's scope and value (length-prefixed) and, for a
// stored result (format 2, "idS2"), the fence of the claim that saved it and the deployment's
// context (SealBinding): a record copied to another key, purpose, key id, claim of its key (an
// earlier response written back after the key was claimed again) or table or key prefix does not
// open. Format 1 ("idS1", before 1.0) binds the key and purpose only; the stores still open it
// unless SealingOptions::open_format_1 is off.
//
// A record that does not open (altered, truncated, copied from another key, sealed with a key id
// the keyring lacks, or not sealed at all) is corrupt_record: never garbage bytes, never a re-run.
// What stays readable: the key, its state, timestamps, the fingerprint (keyed with a fingerprint
// secret if configured) and the recovery point (record_phase data). docs/security.md says why.
//
// Thread-safety: Keyring is immutable once shared (share it as std::shared_ptr<const Keyring>);
// seal() and open_sealed() may run on any number of threads at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/key.hpp"

namespace idem {

/// AES-256 keys by id: the highest id seals new records; every id opens the records sealed with it.
/// Rotation: add a key with a higher id (new records use it), and drop the old id once no record
/// sealed with it is still kept (retention passed, and no key of that age left in progress).
class Keyring {
public:
    /// Bytes of one key.
    static constexpr std::size_t key_size = 32;

    Keyring() = default;
    /// Wipes the key bytes.
    ~Keyring();
    /// Copies the keys.
    Keyring(const Keyring&) = default;
    /// Copies the keys (the keys it held before are wiped).
    Keyring& operator=(const Keyring& other);

    /// Adds key `id` (1 or more) with `secret` (exactly 32 bytes, e.g. from a secrets manager or
    /// `openssl rand 32`). Throws config_error for id 0, an id already present or another size.
    Keyring& add(std::uint32_t id, std::string_view secret);

    /// A keyring from text: one key per line, `<id> <64 hexadecimal digits>`; blank lines and lines
    /// starting with '#' are skipped. Throws config_error naming the line (never its key).
    [[nodiscard]] static Keyring parse(std::string_view text);
    /// parse() of a file's contents (at most 64 KiB; the bytes read are wiped afterwards); throws
    /// config_error when it cannot be read.
    [[nodiscard]] static Keyring from_file(const std::string& path);

    /// The id new records are sealed with (the highest), or 0 when the keyring is empty.
    [[nodiscard]] std::uint32_t sealing_id() const noexcept;
    /// Whether key `id` is present.
    [[nodiscard]] bool contains(std::uint32_t id) const noexcept;
    /// The ids, ascending.
    [[nodiscard]] std::vector<std::uint32_t> ids() const;
    /// Whether no key was added.
    [[nodiscard]] bool empty() const noexcept { return keys_.empty(); }

    /// The key bytes of `id`, or null (for the implementation).
    [[nodiscard]] const std::array<unsigned char, key_size>* find(std::uint32_t id) const noexcept;

private:
    std::map<std::uint32_t, std::array<unsigned char, key_size>> keys_;
};

/// A store's sealing settings. With no keyring, results are stored as given.
struct SealingOptions {
    /// The keys; null turns sealing off. Must not be empty when set (the store's constructor
    /// throws config_error).
    std::shared_ptr<const Keyring> keyring{};
    /// While a table that was written without sealing still holds completed records in their
    /// retention: a stored result that is not a sealed record is returned as stored instead of
    /// corrupt_record. Turn it off once one retention period has passed since sealing was turned on
    /// (and no key of that age is left in progress): with it on, a writer of the table can plant an
    /// unsealed result.
    bool open_unsealed = false;
    /// The deployment a sealed result is bound to, beside its key and claim. Empty: the store's own
    /// — PostgresStore's and AsyncPostgresStore's PostgresOptions::table as given, RedisStore's
    /// key_prefix. Set it to keep records readable across a rename of the table or prefix (to the
    /// old name), or to let deployments that share a keyring read each other's records (one name).
    std::string context{};
    /// Records sealed in format 1 (before 1.0: bound to their key only) still open. Turn it off
    /// once one retention period has passed since the upgrade (and no key of that age is left in
    /// progress): with it on, a writer of the table who kept a format-1 record of a key can put it
    /// back under any later claim of that key.
    bool open_format_1 = true;
};

/// What a sealed result is bound to besides its key (format 2): the claim that saves it and the
/// deployment that keeps it.
struct SealBinding {
    std::int64_t fence = 0;      ///< the fence of the claim that saves the result (idem::Fence)
    std::string_view context{};  ///< the deployment (SealingOptions::context, or the store's table or prefix)
};

/// Bytes a sealed record adds to the result.
inline constexpr std::size_t seal_overhead = 4 + 4 + 16 + 12 + 16;

/// What a sealed record is for: part of what it is bound to, so a record made for one purpose does
/// not open as the other.
enum class SealPurpose : std::uint8_t {
    result = 1,      ///< a stored result (the stores)
    tier_entry = 2,  ///< a replay-tier entry (RedisReplayCache)
};

/// `plaintext` sealed for `key` with the keyring's sealing key (the same bytes each time for the
/// same key, plaintext and keyring). Throws config_error for an empty keyring, error if OpenSSL
/// fails.
[[nodiscard]] std::string seal(const Keyring& keyring, const Key& key, std::string_view plaintext,
                               SealPurpose purpose = SealPurpose::result);

/// A stored result sealed for `key`, bound to its claim and deployment (format 2, what the stores
/// write).
[[nodiscard]] std::string seal(const Keyring& keyring, const Key& key, std::string_view plaintext,
                               const SealBinding& bound);

/// The plaintext of a format-1 record seal() made for `key` and `purpose`. Throws corrupt_record
/// (saying which: not a sealed record, a format-2 record, truncated, unknown key id, or
/// authentication failed) — the message never contains record bytes.
[[nodiscard]] std::string open_sealed(const Keyring& keyring, const Key& key, std::string_view sealed,
                                      SealPurpose purpose = SealPurpose::result);

/// The plaintext of a stored result sealed for `key` and `bound` (format 2), or of a format-1 one
/// when `open_format_1`. Throws corrupt_record as above, also for a record of another claim or
/// deployment.
[[nodiscard]] std::string open_sealed(const Keyring& keyring, const Key& key, std::string_view sealed,
                                      const SealBinding& bound, bool open_format_1 = true);

/// Whether `stored` starts as a sealed record does (it may still be truncated or altered).
[[nodiscard]] bool looks_sealed(std::string_view stored) noexcept;

/// The key id of a sealed record, or nullopt when `stored` is not one or too short (e.g. for
/// idemctl).
[[nodiscard]] std::optional<std::uint32_t> sealed_key_id(std::string_view stored) noexcept;

}  // namespace idem
