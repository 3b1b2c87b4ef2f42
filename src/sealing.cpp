// Sealed records (include/idem/sealing.hpp): the keyring, seal() and open_sealed().
#include "idem/sealing.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "idem/errors.hpp"

namespace idem {

namespace {

// Format 1 binds a record to its purpose and key; format 2 also to its claim and deployment.
constexpr std::string_view kMagic1 = "idS1";
constexpr std::string_view kMagic2 = "idS2";
constexpr std::string_view kDerive = "idem/seal/v1";
constexpr std::string_view kSiv = "idem/seal/siv/v1";
constexpr std::size_t kSalt = 16;
constexpr std::size_t kNonce = 12;
constexpr std::size_t kTag = 16;
constexpr std::size_t kHeader = 4 + 4 + kSalt + kNonce;
static_assert(seal_overhead == kHeader + kTag);

using KeyBytes = std::array<unsigned char, Keyring::key_size>;

struct CipherCtxDeleter {
    void operator()(EVP_CIPHER_CTX* ctx) const noexcept { EVP_CIPHER_CTX_free(ctx); }
};
struct MacDeleter {
    void operator()(EVP_MAC* mac) const noexcept { EVP_MAC_free(mac); }
};
struct MacCtxDeleter {
    void operator()(EVP_MAC_CTX* ctx) const noexcept { EVP_MAC_CTX_free(ctx); }
};
struct CipherDeleter {
    void operator()(EVP_CIPHER* cipher) const noexcept { EVP_CIPHER_free(cipher); }
};

// Fetched once: an implicit fetch on every init costs a provider lookup under a lock.
const EVP_CIPHER* aes_256_gcm() {
    static const std::unique_ptr<EVP_CIPHER, CipherDeleter> cipher(EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr));
    if (!cipher) throw error("idem: OpenSSL has no AES-256-GCM");
    return cipher.get();
}

// Contexts per thread, set up once with their algorithm and re-keyed for every record: an
// implicit fetch or a fresh context on every call costs more than the cryptography.
struct ThreadContexts {
    std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter> encrypt{EVP_CIPHER_CTX_new()};
    std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter> decrypt{EVP_CIPHER_CTX_new()};
    std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> mac;

    ThreadContexts() {
        static const std::unique_ptr<EVP_MAC, MacDeleter> hmac_alg(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
        if (!hmac_alg) throw error("idem: OpenSSL has no HMAC");
        mac.reset(EVP_MAC_CTX_new(hmac_alg.get()));
        char digest[] = "SHA256";
        const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                     OSSL_PARAM_construct_end()};
        if (!encrypt || !decrypt || !mac || EVP_MAC_CTX_set_params(mac.get(), params) != 1 ||
            EVP_EncryptInit_ex(encrypt.get(), aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
            EVP_DecryptInit_ex(decrypt.get(), aes_256_gcm(), nullptr, nullptr, nullptr) != 1) {
            throw error("idem: cannot set up AES-256-GCM and HMAC-SHA256 (OpenSSL)");
        }
    }
};

ThreadContexts& contexts() {
    thread_local ThreadContexts c;
    return c;
}

KeyBytes hmac(const KeyBytes& master, std::string_view message) {
    EVP_MAC_CTX* ctx = contexts().mac.get();
    KeyBytes out{};
    std::size_t len = 0;
    if (EVP_MAC_init(ctx, master.data(), master.size(), nullptr) != 1 ||
        EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1 ||
        EVP_MAC_final(ctx, out.data(), &len, out.size()) != 1 || len != out.size()) {
        throw error("idem: HMAC-SHA256 failed (OpenSSL)");
    }
    return out;
}

// The record's own key: HMAC-SHA256(keyring key, "idem/seal/v1" | salt).
KeyBytes record_key(const KeyBytes& master, const unsigned char* salt) {
    std::string message(kDerive);
    message.append(reinterpret_cast<const char*>(salt), kSalt);
    return hmac(master, message);
}

void put_be32(std::string& out, std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
}

std::uint32_t get_be32(std::string_view in) {
    std::uint32_t v = 0;
    for (std::size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(in[i]);
    return v;
}

// What binds a record to its place: the purpose, then the key's scope and value, each with a
// 2-byte length (a key part is at most 255 bytes).
std::string binding(SealPurpose purpose, const Key& key) {
    std::string out(1, static_cast<char>(purpose));
    for (const std::string* part : {&key.scope(), &key.value()}) {
        out.push_back(static_cast<char>((part->size() >> 8) & 0xff));
        out.push_back(static_cast<char>(part->size() & 0xff));
        out.append(*part);
    }
    return out;
}

// Format 2: the binding of format 1 (as a stored result), then the claim's fence (8 bytes,
// big-endian) and the deployment's context with a 2-byte length.
std::string binding(const Key& key, const SealBinding& bound) {
    if (bound.context.size() > 0xffff) throw config_error("idem: a sealing context is longer than 65535 bytes");
    std::string out = binding(SealPurpose::result, key);
    const auto fence = static_cast<std::uint64_t>(bound.fence);
    for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>((fence >> shift) & 0xff));
    out.push_back(static_cast<char>((bound.context.size() >> 8) & 0xff));
    out.push_back(static_cast<char>(bound.context.size() & 0xff));
    out.append(bound.context);
    return out;
}

const unsigned char* bytes(std::string_view s) { return reinterpret_cast<const unsigned char*>(s.data()); }

// A key is never part of an error message.
[[noreturn]] void bad_line(std::size_t line, std::string_view why) {
    throw config_error("idem: keyring line " + std::to_string(line) + ": " + std::string(why));
}

int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

}  // namespace

Keyring::~Keyring() {
    for (auto& [id, key] : keys_) OPENSSL_cleanse(key.data(), key.size());
}

Keyring& Keyring::add(std::uint32_t id, std::string_view secret) {
    if (id == 0) throw config_error("idem: keyring key ids start at 1");
    if (secret.size() != key_size) {
        throw config_error("idem: keyring key " + std::to_string(id) + " has " + std::to_string(secret.size()) +
                           " bytes; AES-256 needs exactly 32");
    }
    if (keys_.contains(id)) throw config_error("idem: keyring key id " + std::to_string(id) + " added twice");
    KeyBytes& key = keys_[id];
    std::copy(bytes(secret), bytes(secret) + key_size, key.begin());
    return *this;
}

Keyring Keyring::parse(std::string_view text) {
    Keyring ring;
    std::size_t line_no = 0;
    while (!text.empty()) {
        ++line_no;
        const std::size_t end = text.find('\n');
        std::string_view line = text.substr(0, end);
        text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
        while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t'))
            line.remove_suffix(1);
        while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
        if (line.empty() || line.front() == '#') continue;
        const std::size_t space = line.find_first_of(" \t");
        if (space == std::string_view::npos) bad_line(line_no, "expected `<id> <64 hexadecimal digits>`");
        const std::string_view id_text = line.substr(0, space);
        std::string_view hex = line.substr(space);
        while (!hex.empty() && (hex.front() == ' ' || hex.front() == '\t')) hex.remove_prefix(1);
        std::uint32_t id = 0;
        const auto [ptr, ec] = std::from_chars(id_text.data(), id_text.data() + id_text.size(), id);
        if (ec != std::errc() || ptr != id_text.data() + id_text.size() || id == 0) {
            bad_line(line_no, "the id must be a whole number from 1 to 4294967295");
        }
        if (hex.size() != 2 * key_size) bad_line(line_no, "the key must be 64 hexadecimal digits (32 bytes)");
        std::string secret(key_size, '\0');
        for (std::size_t i = 0; i < key_size; ++i) {
            const int hi = hex_value(hex[2 * i]);
            const int lo = hex_value(hex[2 * i + 1]);
            if (hi < 0 || lo < 0) {
                OPENSSL_cleanse(secret.data(), secret.size());
                bad_line(line_no, "the key must be 64 hexadecimal digits (32 bytes)");
            }
            secret[i] = static_cast<char>(hi * 16 + lo);
        }
        if (ring.contains(id)) {
            OPENSSL_cleanse(secret.data(), secret.size());
            bad_line(line_no, "key id " + std::to_string(id) + " appears twice");
        }
        ring.add(id, secret);
        OPENSSL_cleanse(secret.data(), secret.size());
    }
    return ring;
}

Keyring Keyring::from_file(const std::string& path) {
    // Read with read(2) into one buffer that is wiped afterwards: a stream would leave copies of
    // the keys in buffers of its own.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw config_error("idem: cannot read the keyring file " + path + ": " + std::strerror(errno));
    // The keyring opens every stored response: as ssh does with a private key, refuse a file that
    // its group or others may read or write.
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int why = errno;
        ::close(fd);
        throw config_error("idem: cannot read the keyring file " + path + ": " + std::strerror(why));
    }
    if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
        ::close(fd);
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
        throw config_error("idem: the keyring file " + path + " has mode " + mode +
                           ": its group or others may read it, and it opens every stored response. Make it "
                           "readable by the service's user only (chmod 600; a mounted secret: mode 0400)");
    }
    std::string contents;
    contents.reserve(1 << 16);
    char chunk[4096];
    for (;;) {
        const ssize_t n = ::read(fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const int why = n < 0 ? errno : 0;
            ::close(fd);
            OPENSSL_cleanse(chunk, sizeof chunk);
            if (n < 0) {
                OPENSSL_cleanse(contents.data(), contents.size());
                throw config_error("idem: cannot read the keyring file " + path + ": " + std::strerror(why));
            }
            break;
        }
        if (contents.size() + static_cast<std::size_t>(n) > contents.capacity()) {
            ::close(fd);
            OPENSSL_cleanse(chunk, sizeof chunk);
            OPENSSL_cleanse(contents.data(), contents.size());
            throw config_error("idem: the keyring file " + path + " is larger than 64 KiB");
        }
        contents.append(chunk, static_cast<std::size_t>(n));  // within capacity: never reallocates
    }
    try {
        Keyring ring = parse(contents);
        OPENSSL_cleanse(contents.data(), contents.size());
        return ring;
    } catch (...) {
        OPENSSL_cleanse(contents.data(), contents.size());
        throw;
    }
}

Keyring& Keyring::operator=(const Keyring& other) {
    if (this == &other) return *this;
    for (auto& [id, key] : keys_) OPENSSL_cleanse(key.data(), key.size());
    keys_.clear();
    keys_ = other.keys_;
    return *this;
}

std::uint32_t Keyring::sealing_id() const noexcept { return keys_.empty() ? 0 : keys_.rbegin()->first; }

bool Keyring::contains(std::uint32_t id) const noexcept { return keys_.contains(id); }

std::vector<std::uint32_t> Keyring::ids() const {
    std::vector<std::uint32_t> out;
    for (const auto& [id, key] : keys_) out.push_back(id);
    return out;
}

const std::array<unsigned char, Keyring::key_size>* Keyring::find(std::uint32_t id) const noexcept {
    auto it = keys_.find(id);
    return it == keys_.end() ? nullptr : &it->second;
}

namespace {

// `plaintext` sealed in format `magic`, bound to `bound` (the associated data after the header).
std::string seal_bound(const Keyring& keyring, std::string_view magic, const std::string& bound,
                       std::string_view plaintext) {
    const std::uint32_t id = keyring.sealing_id();
    if (id == 0) throw config_error("idem: cannot seal with an empty keyring");
    const KeyBytes& master = *keyring.find(id);
    std::string out;
    out.reserve(seal_overhead + plaintext.size());
    out.append(magic);
    put_be32(out, id);
    // Salt and nonce from a keyed hash of everything sealed (a synthetic IV): the same bytes for
    // the same key and plaintext, so a save sent again, or saved again, stores what is already
    // there; other plaintexts get other record keys. Without the keyring key nobody can compute it.
    std::string siv_input(kSiv);
    siv_input.append(out.substr(4, 4));
    siv_input.append(bound);
    siv_input.append(plaintext);
    const KeyBytes siv = hmac(master, siv_input);
    OPENSSL_cleanse(siv_input.data(), siv_input.size());
    out.append(reinterpret_cast<const char*>(siv.data()), kSalt + kNonce);
    KeyBytes rkey = record_key(master, siv.data());
    const std::string aad = out + bound;

    EVP_CIPHER_CTX* ctx = contexts().encrypt.get();
    out.resize(kHeader + plaintext.size() + kTag);
    auto* body = reinterpret_cast<unsigned char*>(out.data()) + kHeader;
    int len = 0, final_len = 0;
    const bool ok =
        EVP_EncryptInit_ex(ctx, nullptr, nullptr, rkey.data(), siv.data() + kSalt) == 1 &&
        EVP_EncryptUpdate(ctx, nullptr, &len, bytes(aad), static_cast<int>(aad.size())) == 1 &&
        (plaintext.empty() ||
         EVP_EncryptUpdate(ctx, body, &len, bytes(plaintext), static_cast<int>(plaintext.size())) == 1) &&
        EVP_EncryptFinal_ex(ctx, body + (plaintext.empty() ? 0 : len), &final_len) == 1 &&
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kTag), body + plaintext.size()) == 1;
    OPENSSL_cleanse(rkey.data(), rkey.size());
    if (!ok) throw error("idem: AES-256-GCM encryption failed (OpenSSL)");
    return out;
}

// The plaintext of `sealed` (checked to look sealed), bound to `bound`.
std::string open_bound(const Keyring& keyring, std::string_view sealed, const std::string& bound) {
    if (sealed.size() < seal_overhead) throw corrupt_record("idem: the sealed result of this key is truncated");
    const std::uint32_t id = get_be32(sealed.substr(4, 4));
    const KeyBytes* master = keyring.find(id);
    if (master == nullptr) {
        throw corrupt_record("idem: the result of this key is sealed with key id " + std::to_string(id) +
                             ", which the keyring does not hold");
    }
    const auto* salt = bytes(sealed) + 8;
    KeyBytes rkey = record_key(*master, salt);
    const std::string aad = std::string(sealed.substr(0, kHeader)) + bound;
    const std::size_t n = sealed.size() - seal_overhead;
    std::string out(n, '\0');
    unsigned char tag[kTag];
    std::copy(bytes(sealed) + kHeader + n, bytes(sealed) + kHeader + n + kTag, tag);

    EVP_CIPHER_CTX* ctx = contexts().decrypt.get();
    int len = 0, final_len = 0;
    const bool setup = EVP_DecryptInit_ex(ctx, nullptr, nullptr, rkey.data(), salt + kSalt) == 1 &&
                       EVP_DecryptUpdate(ctx, nullptr, &len, bytes(aad), static_cast<int>(aad.size())) == 1 &&
                       (n == 0 || EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                                                    bytes(sealed) + kHeader, static_cast<int>(n)) == 1) &&
                       EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kTag), tag) == 1;
    OPENSSL_cleanse(rkey.data(), rkey.size());
    if (!setup) throw error("idem: AES-256-GCM decryption failed (OpenSSL)");
    if (EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(out.data()) + (n == 0 ? 0 : len), &final_len) != 1) {
        OPENSSL_cleanse(out.data(), out.size());
        throw corrupt_record(
            "idem: the sealed result of this key does not authenticate (altered, or sealed for another key, claim "
            "or deployment)");
    }
    return out;
}

std::string_view magic_of(std::string_view stored) noexcept { return stored.substr(0, kMagic1.size()); }

[[noreturn]] void not_sealed() { throw corrupt_record("idem: the stored result of this key is not a sealed record"); }

}  // namespace

std::string seal(const Keyring& keyring, const Key& key, std::string_view plaintext, SealPurpose purpose) {
    return seal_bound(keyring, kMagic1, binding(purpose, key), plaintext);
}

std::string seal(const Keyring& keyring, const Key& key, std::string_view plaintext, const SealBinding& bound) {
    return seal_bound(keyring, kMagic2, binding(key, bound), plaintext);
}

std::string open_sealed(const Keyring& keyring, const Key& key, std::string_view sealed, SealPurpose purpose) {
    if (magic_of(sealed) == kMagic2) {
        throw corrupt_record(
            "idem: the result of this key is sealed to its claim and deployment (format 2): "
            "open it with its SealBinding");
    }
    if (magic_of(sealed) != kMagic1) not_sealed();
    return open_bound(keyring, sealed, binding(purpose, key));
}

std::string open_sealed(const Keyring& keyring, const Key& key, std::string_view sealed, const SealBinding& bound,
                        bool open_format_1) {
    if (magic_of(sealed) == kMagic2) return open_bound(keyring, sealed, binding(key, bound));
    if (magic_of(sealed) != kMagic1) not_sealed();
    if (!open_format_1) {
        throw corrupt_record(
            "idem: the result of this key is sealed in format 1 (bound to its key only), which "
            "SealingOptions::open_format_1 no longer accepts");
    }
    return open_bound(keyring, sealed, binding(SealPurpose::result, key));
}

bool looks_sealed(std::string_view stored) noexcept {
    return magic_of(stored) == kMagic1 || magic_of(stored) == kMagic2;
}

std::optional<std::uint32_t> sealed_key_id(std::string_view stored) noexcept {
    if (stored.size() < seal_overhead || !looks_sealed(stored)) return std::nullopt;
    return get_be32(stored.substr(4, 4));
}

}  // namespace idem
