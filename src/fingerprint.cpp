#include "idem/fingerprint.hpp"

#include <openssl/evp.h>

#include <cstring>
#include <stdexcept>

#include "idem/errors.hpp"

namespace idem {
namespace {

// Domain tag: a fingerprint made by another scheme (or a later version of this one) never collides.
constexpr std::string_view kDomain = "idem.fingerprint.v1";

// Part type tags.
constexpr char kString = 's';
constexpr char kBytes = 'x';
constexpr char kSigned = 'i';
constexpr char kUnsigned = 'u';
constexpr char kBool = 'b';

void put_u64(unsigned char* out, std::uint64_t v) {
    for (int i = 7; i >= 0; --i, v >>= 8) out[i] = static_cast<unsigned char>(v & 0xFF);
}

struct MdCtxDeleter {
    void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
};

}  // namespace

struct FingerprintBuilder::Impl {
    std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx{EVP_MD_CTX_new()};
    bool finished = false;

    void update(const void* data, std::size_t size) {
        if (finished) throw std::logic_error("idem::FingerprintBuilder used after finish()");
        if (size != 0 && EVP_DigestUpdate(ctx.get(), data, size) != 1) {
            throw error("idem: EVP_DigestUpdate failed");
        }
    }
    // type tag, 8-byte big-endian length, bytes
    void part(char tag, const void* data, std::size_t size) {
        unsigned char header[9];
        header[0] = static_cast<unsigned char>(tag);
        put_u64(header + 1, size);
        update(header, sizeof header);
        update(data, size);
    }
};

FingerprintBuilder::FingerprintBuilder() : impl_(std::make_unique<Impl>()) {
    if (!impl_->ctx || EVP_DigestInit_ex(impl_->ctx.get(), EVP_sha256(), nullptr) != 1) {
        throw error("idem: cannot initialise SHA-256 (OpenSSL EVP)");
    }
    impl_->part(kString, kDomain.data(), kDomain.size());
}

FingerprintBuilder::~FingerprintBuilder() = default;
FingerprintBuilder::FingerprintBuilder(FingerprintBuilder&&) noexcept = default;
FingerprintBuilder& FingerprintBuilder::operator=(FingerprintBuilder&&) noexcept = default;

FingerprintBuilder& FingerprintBuilder::add_string(std::string_view text) {
    impl_->part(kString, text.data(), text.size());
    return *this;
}

FingerprintBuilder& FingerprintBuilder::add_bytes(std::span<const std::byte> bytes) {
    impl_->part(kBytes, bytes.data(), bytes.size());
    return *this;
}

FingerprintBuilder& FingerprintBuilder::add_signed(std::int64_t number) {
    unsigned char v[8];
    put_u64(v, static_cast<std::uint64_t>(number));
    impl_->part(kSigned, v, sizeof v);
    return *this;
}

FingerprintBuilder& FingerprintBuilder::add_unsigned(std::uint64_t number) {
    unsigned char v[8];
    put_u64(v, number);
    impl_->part(kUnsigned, v, sizeof v);
    return *this;
}

FingerprintBuilder& FingerprintBuilder::add_bool(bool flag) {
    const unsigned char v = flag ? 1 : 0;
    impl_->part(kBool, &v, 1);
    return *this;
}

Fingerprint FingerprintBuilder::finish() {
    if (impl_->finished) throw std::logic_error("idem::FingerprintBuilder::finish() called twice");
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(impl_->ctx.get(), out, &len) != 1 || len != Fingerprint::size) {
        throw error("idem: EVP_DigestFinal_ex failed");
    }
    impl_->finished = true;
    Fingerprint::Digest digest;
    std::memcpy(digest.data(), out, Fingerprint::size);
    return Fingerprint(FingerprintAlgorithm::sha256, digest);
}

Fingerprint Fingerprint::from_bytes(std::int16_t algorithm, std::string_view bytes) {
    if (algorithm != static_cast<std::int16_t>(FingerprintAlgorithm::sha256) &&
        algorithm != static_cast<std::int16_t>(FingerprintAlgorithm::hmac_sha256)) {
        throw corrupt_record("idem: unknown fingerprint algorithm " + std::to_string(algorithm));
    }
    if (bytes.size() != size) {
        throw corrupt_record("idem: fingerprint of " + std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(size));
    }
    Digest digest;
    std::memcpy(digest.data(), bytes.data(), size);
    return Fingerprint(static_cast<FingerprintAlgorithm>(algorithm), digest);
}

std::string Fingerprint::hex() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    out.reserve(size * 2);
    for (std::byte b : digest_) {
        const auto v = std::to_integer<unsigned>(b);
        out.push_back(digits[v >> 4]);
        out.push_back(digits[v & 0xF]);
    }
    return out;
}

}  // namespace idem
