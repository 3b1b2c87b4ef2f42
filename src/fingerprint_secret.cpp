#include "idem/fingerprint_secret.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <array>
#include <cstring>
#include <string>

#include "idem/errors.hpp"

namespace idem {
namespace {

// Domain tag of the keyed digest: this HMAC key used for something else never yields a keyed
// fingerprint, and a later keyed scheme gets a tag of its own. Fixed length, followed by the
// 32-byte plain digest: the input is unambiguous.
constexpr std::string_view kDomain = "idem.fingerprint.hmac.v1";

constexpr std::size_t kBlock = 64;  // SHA-256's block size

struct MdCtxDeleter {
    void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxDeleter>;

[[noreturn]] void evp_failed() { throw error("idem: FingerprintSecret: SHA-256 (OpenSSL EVP) failed"); }

}  // namespace

// HMAC (RFC 2104) with SHA-256, its two padded keys absorbed once: each key() copies the inner and
// outer states instead of hashing the key again (two of the four compressions an HMAC of 56 bytes
// costs). Only the absorbed states are kept; the key bytes are wiped after use.
struct FingerprintSecret::Impl {
    MdCtx inner{EVP_MD_CTX_new()};
    MdCtx outer{EVP_MD_CTX_new()};

    explicit Impl(std::string_view secret) {
        std::array<unsigned char, kBlock> key{};
        if (secret.size() > kBlock) {
            unsigned int n = 0;
            if (EVP_Digest(secret.data(), secret.size(), key.data(), &n, EVP_sha256(), nullptr) != 1) evp_failed();
        } else {
            std::memcpy(key.data(), secret.data(), secret.size());
        }
        std::array<unsigned char, kBlock> pad{};
        const auto absorb = [&](EVP_MD_CTX* ctx, unsigned char x) {
            for (std::size_t i = 0; i < kBlock; ++i) pad[i] = key[i] ^ x;
            if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1 ||
                EVP_DigestUpdate(ctx, pad.data(), pad.size()) != 1) {
                OPENSSL_cleanse(key.data(), key.size());
                OPENSSL_cleanse(pad.data(), pad.size());
                evp_failed();
            }
        };
        absorb(inner.get(), 0x36);
        absorb(outer.get(), 0x5c);
        OPENSSL_cleanse(key.data(), key.size());
        OPENSSL_cleanse(pad.data(), pad.size());
    }
};

FingerprintSecret::FingerprintSecret(std::string_view bytes) {
    if (bytes.size() < min_size) {
        throw config_error("idem: a FingerprintSecret needs at least " + std::to_string(min_size) +
                           " bytes of secret, got " + std::to_string(bytes.size()));
    }
    impl_ = std::make_shared<const Impl>(bytes);
}

FingerprintSecret::~FingerprintSecret() = default;
FingerprintSecret::FingerprintSecret(const FingerprintSecret&) noexcept = default;
FingerprintSecret& FingerprintSecret::operator=(const FingerprintSecret&) noexcept = default;

Fingerprint FingerprintSecret::key(const Fingerprint& fp) const {
    if (fp.algorithm() != FingerprintAlgorithm::sha256) return fp;
    MdCtx ctx{EVP_MD_CTX_new()};
    unsigned char inner[EVP_MAX_MD_SIZE];
    unsigned char outer[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (!ctx || EVP_MD_CTX_copy_ex(ctx.get(), impl_->inner.get()) != 1 ||
        EVP_DigestUpdate(ctx.get(), kDomain.data(), kDomain.size()) != 1 ||
        EVP_DigestUpdate(ctx.get(), fp.digest().data(), Fingerprint::size) != 1 ||
        EVP_DigestFinal_ex(ctx.get(), inner, &n) != 1 || n != Fingerprint::size ||
        EVP_MD_CTX_copy_ex(ctx.get(), impl_->outer.get()) != 1 ||
        EVP_DigestUpdate(ctx.get(), inner, Fingerprint::size) != 1 || EVP_DigestFinal_ex(ctx.get(), outer, &n) != 1 ||
        n != Fingerprint::size) {
        evp_failed();
    }
    Fingerprint::Digest keyed;
    std::memcpy(keyed.data(), outer, Fingerprint::size);
    return Fingerprint(FingerprintAlgorithm::hmac_sha256, keyed, fp.digest());
}

}  // namespace idem
