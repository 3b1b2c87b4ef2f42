// fingerprint(): SHA-256 over a domain-tagged, type-tagged, length-prefixed encoding of the parts;
// FingerprintSecret: the keyed form, and how claim_status() compares records of either algorithm.
#include "idem/fingerprint.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint_secret.hpp"
#include "idem/memory_store.hpp"
#include "idem/store.hpp"

#include <array>
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

using namespace std::string_literals;

namespace {
enum class Currency : std::int16_t { brl = 986, usd = 840 };
}

TEST_CASE("fingerprint is deterministic", "[fingerprint]") {
    const auto a = idem::fingerprint("POST /charges"s, 25000, "BRL"s, true);
    const auto b = idem::fingerprint("POST /charges"s, 25000, "BRL"s, true);
    CHECK(a == b);
    CHECK(a.hex() == b.hex());
    CHECK(a.algorithm() == idem::FingerprintAlgorithm::sha256);
}

TEST_CASE("fingerprint hex is stable across builds (hard-coded)", "[fingerprint]") {
    // Computed once, independently (Python hashlib), from the encoding fingerprint.hpp documents:
    // SHA-256 of part('s', "idem.fingerprint.v1") then each part, where part(tag, bytes) is the tag
    // byte, the length as 8 bytes big-endian, then the bytes; integers are 8 bytes big-endian
    // (tag 'i' signed, 'u' unsigned), bool is one byte (tag 'b'). If one of these changes, every
    // stored fingerprint turns into a mismatch: such a change needs a new algorithm tag.
    CHECK(idem::fingerprint().hex() == "fef870d358d5cebddfc41274b71155015eb4ede5071152bfd194a71af135a5b0");
    CHECK(idem::fingerprint("POST /charges"s, 25000, "BRL"s).hex() ==
          "6dbefa391b7b26e1a429654affe2695e9610c0d75c201812d5dfe09676a74f80");
    CHECK(idem::fingerprint("POST /charges"s, std::int64_t{25000}, "BRL"s, true, 7u).hex() ==
          "890e4453089315cbd858709f33c0dba05a1586f74f81ab91fac6d9fee6eec974");
}

TEST_CASE("fingerprint is 32 bytes, 64 lowercase hex digits", "[fingerprint]") {
    const auto fp = idem::fingerprint("x"s);
    CHECK(idem::Fingerprint::size == 32);
    CHECK(fp.bytes().size() == 32);
    const auto hex = fp.hex();
    REQUIRE(hex.size() == 64);
    CHECK(hex.find_first_not_of("0123456789abcdef") == std::string::npos);
    // hex() spells the digest bytes in order.
    static constexpr char digits[] = "0123456789abcdef";
    std::string expected;
    for (unsigned char c : fp.bytes()) {
        expected += digits[c >> 4];
        expected += digits[c & 0xF];
    }
    CHECK(hex == expected);
}

TEST_CASE("fingerprint: order matters and parts do not run together", "[fingerprint]") {
    CHECK(idem::fingerprint("a"s, "b"s) != idem::fingerprint("b"s, "a"s));
    CHECK(idem::fingerprint("ab"s, "c"s) != idem::fingerprint("a"s, "bc"s));
    CHECK(idem::fingerprint("abc"s) != idem::fingerprint("ab"s, "c"s));
    CHECK(idem::fingerprint(""s) != idem::fingerprint());
    CHECK(idem::fingerprint(""s, ""s) != idem::fingerprint(""s));
    CHECK(idem::fingerprint("a"s) != idem::fingerprint("b"s));
    CHECK(idem::fingerprint(1, 2) != idem::fingerprint(2, 1));
}

TEST_CASE("fingerprint: types are tagged", "[fingerprint]") {
    // 1 != "1"
    CHECK(idem::fingerprint(1) != idem::fingerprint("1"s));
    CHECK(idem::fingerprint(std::int64_t{49}) != idem::fingerprint("1"s));  // '1' == 49
    // int and int64 of the same value are the same part
    CHECK(idem::fingerprint(123) == idem::fingerprint(std::int64_t{123}));
    CHECK(idem::fingerprint(static_cast<short>(-5)) == idem::fingerprint(std::int64_t{-5}));
    CHECK(idem::fingerprint(123u) == idem::fingerprint(std::uint64_t{123}));
    // signed and unsigned are tagged apart
    CHECK(idem::fingerprint(123) != idem::fingerprint(123u));
    CHECK(idem::fingerprint(std::int64_t{-1}) != idem::fingerprint(std::uint64_t{0xFFFFFFFFFFFFFFFFull}));
    // bool is not an integer
    CHECK(idem::fingerprint(true) != idem::fingerprint(1));
    CHECK(idem::fingerprint(true) != idem::fingerprint(1u));
    CHECK(idem::fingerprint(true) != idem::fingerprint(false));
    // a char is a one-character string
    CHECK(idem::fingerprint('a') == idem::fingerprint("a"s));
    // enums are their underlying integer
    CHECK(idem::fingerprint(Currency::brl) == idem::fingerprint(986));
    CHECK(idem::fingerprint(Currency::brl) != idem::fingerprint(Currency::usd));
    // string types agree with each other
    CHECK(idem::fingerprint("abc") == idem::fingerprint("abc"s));
    CHECK(idem::fingerprint(std::string_view("abc")) == idem::fingerprint("abc"s));
    // bytes are tagged apart from strings
    const std::array<std::byte, 3> raw{std::byte{'a'}, std::byte{'b'}, std::byte{'c'}};
    CHECK(idem::fingerprint(std::span<const std::byte>(raw)) != idem::fingerprint("abc"s));
}

TEST_CASE("fingerprint: embedded NUL bytes count", "[fingerprint]") {
    CHECK(idem::fingerprint("a\0b"s) != idem::fingerprint("a"s));
    CHECK(idem::fingerprint("a\0b"s) != idem::fingerprint("a\0c"s));
}

TEST_CASE("FingerprintBuilder equals fingerprint() and is spent after finish", "[fingerprint]") {
    idem::FingerprintBuilder builder;
    builder.add("POST /charges"s).add(25000).add_string("BRL").add_bool(true);
    const auto built = builder.finish();
    CHECK(built == idem::fingerprint("POST /charges"s, 25000, "BRL"s, true));
    CHECK_THROWS_AS(builder.finish(), std::logic_error);
    CHECK_THROWS_AS(builder.add_string("more"), std::logic_error);
}

TEST_CASE("Fingerprint::from_bytes round trips and refuses bad input", "[fingerprint]") {
    const auto fp = idem::fingerprint("x"s, 1);
    const auto back = idem::Fingerprint::from_bytes(1, fp.bytes());
    CHECK(back == fp);

    const std::string bytes(fp.bytes());
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(1, bytes.substr(0, 31)), idem::corrupt_record);
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(1, bytes + "x"), idem::corrupt_record);
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(1, ""), idem::corrupt_record);
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(0, bytes), idem::corrupt_record);
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(3, bytes), idem::corrupt_record);
    // 2: keyed (hmac_sha256); rebuilt from storage it knows no plain digest.
    const auto keyed = idem::Fingerprint::from_bytes(2, bytes);
    CHECK(keyed.algorithm() == idem::FingerprintAlgorithm::hmac_sha256);
    CHECK(keyed.bytes() == fp.bytes());
    CHECK(keyed.plain_digest() == nullptr);
    CHECK_FALSE(keyed == fp);
    CHECK_THROWS_AS(idem::Fingerprint::from_bytes(-1, bytes), idem::corrupt_record);
}

TEST_CASE("FingerprintSecret::key is HMAC-SHA256(secret, domain tag || plain digest) (hard-coded)", "[fingerprint]") {
    // Computed once, independently (Python hmac): HMAC-SHA256(secret, "idem.fingerprint.hmac.v1"
    // || the 32-byte plain digest). If it changes, every keyed row turns into a mismatch.
    const auto plain = idem::fingerprint("POST /charges"s, 25000, "BRL"s);
    std::string long_secret = "a longer secret than one SHA-256 block: " + std::string(60, 'x');
    std::string block(64, '\0');
    for (std::size_t i = 0; i < block.size(); ++i) block[i] = static_cast<char>(i);
    CHECK(idem::FingerprintSecret(std::string(32, 'k')).key(plain).hex() ==
          "9de5b057d3fd8d3d0adb9579e0a4ab0fb0b4e0f151add3abfdd41857e4b3c574");
    CHECK(idem::FingerprintSecret(block).key(plain).hex() ==
          "4ed46a80bdcad265ff284031fe8e9e06eba1a01bf64050c698177e18bdedf207");
    CHECK(idem::FingerprintSecret(long_secret).key(plain).hex() ==
          "d922d7b958a3d9f5e5fa2b1ba422c2b77bb1f076582bfae56bdf91cbacd24560");
    const auto keyed = idem::FingerprintSecret(std::string(32, 'k')).key(plain);
    CHECK(keyed.algorithm() == idem::FingerprintAlgorithm::hmac_sha256);
    CHECK(idem::to_string(keyed.algorithm()) == "hmac-sha256");
    CHECK(idem::to_string(plain.algorithm()) == "sha256");
    CHECK_THROWS_AS(idem::FingerprintSecret(std::string(31, 'k')), idem::config_error);
    CHECK_THROWS_AS(idem::FingerprintSecret(""), idem::config_error);
}

TEST_CASE("claim_status compares a record by its own algorithm", "[fingerprint]") {
    const idem::FingerprintSecret a(std::string(32, 'a')), b(std::string(32, 'b'));
    const auto same = idem::fingerprint("req"s, 1), other = idem::fingerprint("req"s, 2);
    idem::Record plain_row;
    plain_row.state = idem::RecordState::completed;
    plain_row.fingerprint = same;
    idem::Record keyed_row = plain_row;
    keyed_row.fingerprint = a.key(same).stored();
    // A plain row: with the plain digest, whether the request's fingerprint is keyed or not.
    CHECK(idem::claim_status(plain_row, same) == idem::ClaimStatus::completed);
    CHECK(idem::claim_status(plain_row, a.key(same)) == idem::ClaimStatus::completed);
    CHECK(idem::claim_status(plain_row, a.key(other)) == idem::ClaimStatus::mismatch);
    // A keyed row: with the keyed digest; another secret's is a mismatch; none is config_error.
    CHECK(idem::claim_status(keyed_row, a.key(same)) == idem::ClaimStatus::completed);
    CHECK(idem::claim_status(keyed_row, a.key(other)) == idem::ClaimStatus::mismatch);
    CHECK(idem::claim_status(keyed_row, b.key(same)) == idem::ClaimStatus::mismatch);
    CHECK_THROWS_AS(idem::claim_status(keyed_row, same), idem::config_error);
    // A keyed fingerprint rebuilt from storage carries no plain digest: a plain row cannot match it.
    CHECK(idem::claim_status(plain_row, keyed_row.fingerprint) == idem::ClaimStatus::mismatch);
}

TEST_CASE("MemoryStore with a secret keeps keyed fingerprints and replays by them", "[fingerprint]") {
    idem::MemoryStoreOptions o;
    o.fingerprint_secret = idem::FingerprintSecret(std::string(40, 's'));
    idem::MemoryStore store(o);
    const idem::Key key("s", "k");
    const auto fp = idem::fingerprint("req"s, 1);
    const auto c = store.claim(key, fp);
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    store.save(key, c.fence, "r");
    const auto record = store.read(key);
    REQUIRE(record);
    CHECK(record->fingerprint == o.fingerprint_secret->key(fp));
    CHECK(record->fingerprint.plain_digest() == nullptr);  // the plain digest is not kept
    CHECK(store.claim(key, fp).status == idem::ClaimStatus::completed);
    CHECK(store.claim(key, idem::fingerprint("req"s, 2)).status == idem::ClaimStatus::mismatch);
}
