// codec<Response>: a replay gives back exactly the bytes stored; bad bytes are corrupt_record,
// never a crash.
#include "idem/response.hpp"
#include "idem/errors.hpp"

#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace std::string_literals;
using Codec = idem::codec<idem::Response>;

namespace {

std::string all_bytes() {
    std::string s;
    for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
    return s;
}

idem::Response round_trip(const idem::Response& r) { return Codec::decode(Codec::encode(r)); }

std::string be32(std::uint32_t v) {
    std::string s;
    for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return s;
}

std::string be64(std::uint64_t v) {
    std::string s;
    for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return s;
}

// Decoding must either succeed or throw corrupt_record; anything else fails the test.
void decode_or_corrupt(std::string_view bytes) {
    try {
        (void)Codec::decode(bytes);
    } catch (const idem::corrupt_record&) {
    }
}

}  // namespace

TEST_CASE("Response round trips field for field", "[response]") {
    const idem::Response plain;
    CHECK(round_trip(plain) == plain);

    const idem::Response created{
        201, R"({"id":"ch_1","amount":25000})", {{"Content-Type", "application/json"}, {"Location", "/charges/ch_1"}}};
    const auto back = round_trip(created);
    CHECK(back.status == 201);
    CHECK(back.body == created.body);
    CHECK(back.headers == created.headers);
    CHECK(back == created);
}

TEST_CASE("Response keeps NUL bytes, every byte value, and header order", "[response]") {
    idem::Response r;
    r.status = 402;
    r.body = "before\0after\0\0"s;
    r.headers = {{"Z-Last", "1"}, {"A-First", "2"}, {"Set-Cookie", "a=1"}, {"Set-Cookie", "b=2"},
                 {"Empty", ""},   {"Nul", "x\0y"s}, {"Bin", all_bytes()}};
    const auto back = round_trip(r);
    CHECK(back.body.size() == 14);
    CHECK(back.body == r.body);
    REQUIRE(back.headers.size() == 7);
    CHECK(back.headers == r.headers);  // same order, duplicates kept
    CHECK(back.headers[5].second.size() == 3);

    idem::Response binary{200, all_bytes(), {}};
    CHECK(round_trip(binary).body == all_bytes());
}

TEST_CASE("Response with a 1 MiB body round trips byte for byte", "[response]") {
    std::mt19937 rng(42);
    std::string body(1u << 20, '\0');
    for (auto& c : body) c = static_cast<char>(rng() & 0xFF);
    const idem::Response big{200, body, {{"Content-Type", "application/octet-stream"}}};
    const auto encoded = Codec::encode(big);
    CHECK(encoded.size() > body.size());
    const auto back = Codec::decode(encoded);
    CHECK(back.body.size() == body.size());
    CHECK(back.body == body);
    CHECK(back == big);
}

TEST_CASE("Response status values survive, including odd ones", "[response]") {
    for (int status : {0, 100, 200, 402, 409, 422, 599, 999, -1, 2147483647}) {
        CAPTURE(status);
        CHECK(round_trip(idem::Response{status, "b", {}}).status == status);
    }
}

TEST_CASE("Response encoding is deterministic and pinned (it is stored)", "[response]") {
    const idem::Response r{201, "ok", {{"a", "b"}}};
    CHECK(Codec::encode(r) == Codec::encode(r));
    // "IDR1" | status u32 | header count u32 | (name str32, value str32)* | body u64 + bytes,
    // big-endian
    const std::string expected = "IDR1"s + be32(201) + be32(1) + be32(1) + "a" + be32(1) + "b" + be64(2) + "ok";
    CHECK(Codec::encode(r) == expected);
    CHECK(Codec::decode(expected) == r);
}

TEST_CASE("codec<std::string> stores the string as is", "[response]") {
    const std::string s = "a\0b\xff"s;
    CHECK(idem::codec<std::string>::encode(s) == s);
    CHECK(idem::codec<std::string>::decode(s) == s);
}

TEST_CASE("decode refuses every truncation of a valid encoding", "[response][corrupt]") {
    const idem::Response r{200, "body\0bytes"s, {{"h1", "v1"}, {"h2", "v2"}}};
    const auto encoded = Codec::encode(r);
    for (std::size_t n = 0; n < encoded.size(); ++n) {
        CAPTURE(n);
        CHECK_THROWS_AS(Codec::decode(std::string_view(encoded).substr(0, n)), idem::corrupt_record);
    }
}

TEST_CASE("decode refuses trailing bytes and a wrong magic", "[response][corrupt]") {
    const auto encoded = Codec::encode(idem::Response{200, "x", {}});
    CHECK_THROWS_AS(Codec::decode(encoded + "y"), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode(encoded + "\0"s), idem::corrupt_record);
    auto wrong = encoded;
    wrong[3] = '2';  // "IDR2"
    CHECK_THROWS_AS(Codec::decode(wrong), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode(""), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode("garbage that is not a response"), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode(std::string(64, '\0')), idem::corrupt_record);
}

TEST_CASE("decode refuses huge counts and lengths without allocating them", "[response][corrupt]") {
    // header count 2^32-1 with no headers behind it
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(0xFFFFFFFFu) + be64(0)), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(0x10000000u) + std::string(64, '\0')),
                    idem::corrupt_record);
    // a header name claiming 4 GiB
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(1) + be32(0xFFFFFFFFu) + "abc"), idem::corrupt_record);
    // a body claiming 2^64-1 bytes, or more than there is, or less
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(0) + be64(~std::uint64_t{0}) + "abc"),
                    idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(0) + be64(4) + "abc"), idem::corrupt_record);
    CHECK_THROWS_AS(Codec::decode("IDR1"s + be32(200) + be32(0) + be64(2) + "abc"), idem::corrupt_record);
    // and the well-formed neighbour decodes
    CHECK(Codec::decode("IDR1"s + be32(200) + be32(0) + be64(3) + "abc").body == "abc");
}

TEST_CASE("decode of random and mutated bytes never crashes", "[response][corrupt]") {
    std::mt19937 rng(20240601);
    auto random_bytes = [&](std::size_t n) {
        std::string s(n, '\0');
        for (auto& c : s) c = static_cast<char>(rng() & 0xFF);
        return s;
    };
    for (int i = 0; i < 5000; ++i) {
        decode_or_corrupt(random_bytes(rng() % 64));
        decode_or_corrupt("IDR1"s + random_bytes(rng() % 64));
    }
    const auto encoded = Codec::encode(idem::Response{200, "hello", {{"a", "b"}, {"cc", "dd"}}});
    for (std::size_t pos = 0; pos < encoded.size(); ++pos) {
        for (int bit = 0; bit < 8; ++bit) {
            auto mutated = encoded;
            mutated[pos] = static_cast<char>(mutated[pos] ^ (1 << bit));
            decode_or_corrupt(mutated);
        }
    }
    SUCCEED("no crash, no exception other than corrupt_record");
}
