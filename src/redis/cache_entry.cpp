#include "cache_entry.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <array>
#include <cstdint>
#include <optional>

#include "connection.hpp"
#include "idem/errors.hpp"
#include "idem/sealing.hpp"

namespace idem::redis {

namespace {

using SysClock = std::chrono::system_clock;

constexpr std::string_view kVersion = "idem-c3";
constexpr char kHmac = 'h';
constexpr char kChecksum = 's';
constexpr char kGcm = 'g';            // the whole entry sealed with idem::seal under the tier's keyring
constexpr std::size_t kTagSize = 32;  // SHA-256
using Tag = std::array<unsigned char, kTagSize>;

class Writer {
public:
    void integer(std::int64_t v) {
        for (int i = 0; i < 8; ++i)
            out_.push_back(static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff));
    }
    void text(std::string_view s) {
        integer(static_cast<std::int64_t>(s.size()));
        out_.append(s);
    }
    void optional_text(const std::optional<std::string>& s) {
        out_.push_back(s ? '\1' : '\0');
        if (s) text(*s);
    }
    std::string& out() { return out_; }

private:
    std::string out_;
};

class Reader {
public:
    explicit Reader(std::string_view in) : in_(in) {}
    std::int64_t integer() {
        need(8);
        std::uint64_t v = 0;
        for (int i = 0; i < 8; ++i)
            v |= static_cast<std::uint64_t>(static_cast<unsigned char>(in_[pos_ + static_cast<std::size_t>(i)]))
                 << (8 * i);
        pos_ += 8;
        return static_cast<std::int64_t>(v);
    }
    std::string_view text() {
        const auto n = integer();
        if (n < 0) throw corrupt_record("idem: a Redis cache entry has a negative length");
        need(static_cast<std::size_t>(n));
        const std::string_view s = in_.substr(pos_, static_cast<std::size_t>(n));
        pos_ += static_cast<std::size_t>(n);
        return s;
    }
    std::optional<std::string> optional_text() {
        need(1);
        const char present = in_[pos_++];
        if (present == '\0') return std::nullopt;
        if (present != '\1') throw corrupt_record("idem: a Redis cache entry has a bad presence byte");
        return std::string(text());
    }
    void done() const {
        if (pos_ != in_.size()) throw corrupt_record("idem: a Redis cache entry has trailing bytes");
    }

private:
    void need(std::size_t n) const {
        if (in_.size() - pos_ < n) throw corrupt_record("idem: a Redis cache entry is truncated");
    }
    std::string_view in_;
    std::size_t pos_ = 0;
};

std::int64_t ms_of(SysClock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

SysClock::time_point time_of(std::int64_t ms) { return time_from_unix_ms(ms, "a Redis cache entry"); }

std::string encode_record(const Record& r) {
    Writer w;
    w.integer(r.fence);
    w.integer(r.attempt);
    w.text(r.result.value_or(std::string()));
    w.optional_text(r.phase);
    w.optional_text(r.phase_data);
    w.integer(ms_of(r.created_at));
    w.integer(ms_of(r.lease_until));
    w.integer(ms_of(r.expires_at));
    return std::move(w.out());
}

Record decode_record(std::string_view bytes) {
    Reader in(bytes);
    Record r;
    r.state = RecordState::completed;
    r.fence = in.integer();
    r.attempt = static_cast<std::int32_t>(in.integer());
    r.result = std::string(in.text());
    r.phase = in.optional_text();
    r.phase_data = in.optional_text();
    r.created_at = time_of(in.integer());
    r.lease_until = time_of(in.integer());
    r.expires_at = time_of(in.integer());
    in.done();
    return r;
}

}  // namespace

EntrySeal::EntrySeal(std::string secret, std::string key_prefix, std::shared_ptr<const Keyring> keyring)
    : secret_(std::move(secret)), key_prefix_(std::move(key_prefix)), keyring_(std::move(keyring)) {}

EntrySeal::~EntrySeal() { OPENSSL_cleanse(secret_.data(), secret_.size()); }

namespace {

// The tag of `bytes`: HMAC-SHA256 under `secret`, or SHA-256 when there is none.
Tag tag_of(const std::string& secret, std::string_view bytes) {
    Tag tag{};
    const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
    if (secret.empty()) {
        unsigned int size = 0;
        if (EVP_Digest(data, bytes.size(), tag.data(), &size, EVP_sha256(), nullptr) != 1 || size != kTagSize)
            throw error("idem: Redis cache: SHA-256 (OpenSSL EVP_Digest) failed");
    } else {
        unsigned int size = 0;
        if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), data, bytes.size(), tag.data(), &size) ==
                nullptr ||
            size != kTagSize)
            throw error("idem: Redis cache: HMAC-SHA256 (OpenSSL HMAC) failed");
    }
    return tag;
}

}  // namespace

// What an entry names and holds, after its version and seal kind: the key prefix, the key, the
// fingerprint and the record.
std::string EntrySeal::body(const Key& key, const Record& record) const {
    Writer w;
    w.text(key_prefix_);
    w.text(key.scope());
    w.text(key.value());
    w.integer(static_cast<std::int64_t>(record.fingerprint.algorithm()));
    w.text(record.fingerprint.bytes());
    w.text(encode_record(record));
    return std::move(w.out());
}

Record EntrySeal::parse(const Key& key, std::string_view body) const {
    Reader in(body);
    if (in.text() != key_prefix_)
        throw corrupt_record("idem: a Redis cache entry written by a tier of another key_prefix");
    const std::string_view scope = in.text();
    const std::string_view value = in.text();
    if (scope != key.scope() || value != key.value())
        throw corrupt_record("idem: a Redis cache entry that names another key");
    const auto algorithm = in.integer();
    const std::string_view fp = in.text();
    Record record = decode_record(in.text());
    in.done();
    if (algorithm < INT16_MIN || algorithm > INT16_MAX)
        throw corrupt_record("idem: a Redis cache entry names an unknown fingerprint algorithm");
    record.fingerprint = Fingerprint::from_bytes(static_cast<std::int16_t>(algorithm), fp);
    return record;
}

char EntrySeal::kind() const noexcept { return keyring_ ? kGcm : secret_.empty() ? kChecksum : kHmac; }

std::string EntrySeal::seal(const Key& key, const Record& record) const {
    std::string out(kVersion);
    out.push_back(kind());
    if (keyring_) {
        std::string plain = body(key, record);
        out.append(idem::seal(*keyring_, key, plain, SealPurpose::tier_entry));
        OPENSSL_cleanse(plain.data(), plain.size());
        return out;
    }
    out.append(body(key, record));
    const Tag tag = tag_of(secret_, out);
    out.append(reinterpret_cast<const char*>(tag.data()), tag.size());
    return out;
}

Record EntrySeal::open(const Key& key, std::string_view entry) const {
    if (entry.size() < kVersion.size() + 1 || entry.substr(0, kVersion.size()) != kVersion)
        throw corrupt_record("idem: not a Redis cache entry of this version");
    if (entry[kVersion.size()] != kind())
        throw corrupt_record("idem: a Redis cache entry sealed another way (keyring, entry_secret or neither)");
    if (keyring_) {
        std::string plain = open_sealed(*keyring_, key, entry.substr(kVersion.size() + 1), SealPurpose::tier_entry);
        try {
            Record record = parse(key, plain);
            OPENSSL_cleanse(plain.data(), plain.size());
            return record;
        } catch (...) {
            OPENSSL_cleanse(plain.data(), plain.size());
            throw;
        }
    }
    if (entry.size() < kVersion.size() + 1 + kTagSize) throw corrupt_record("idem: a truncated Redis cache entry");
    const std::string_view sealed = entry.substr(0, entry.size() - kTagSize);
    const Tag tag = tag_of(secret_, sealed);
    if (CRYPTO_memcmp(tag.data(), entry.data() + sealed.size(), kTagSize) != 0)
        throw corrupt_record("idem: a Redis cache entry whose tag does not verify");
    return parse(key, sealed.substr(kVersion.size() + 1));
}

}  // namespace idem::redis
