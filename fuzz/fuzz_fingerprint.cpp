// Fuzz target: fingerprint encoding.
//
// Input: a list of parts, each a type byte then its payload (string/bytes: 1-byte length + bytes;
// signed/unsigned: 8 bytes; bool: 1 byte; small integer types through the add<T> template).
// Checks:
//   * determinism: the same parts twice (and through add<T>) give the same digest;
//   * the documented encoding: SHA-256 over the domain tag and, per part, type tag + 8-byte
//     big-endian length + bytes (recomputed here with OpenSSL's one-shot SHA256);
//   * unambiguity: every distinct 2-way split of the same bytes, the unsplit string, and the same
//     bytes under another type tag all give different digests;
//   * from_bytes round-trips; a wrong length/algorithm throws corrupt_record; a spent builder throws
//     std::logic_error.
#include <openssl/sha.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"

namespace {

enum class Kind : std::uint8_t { string, bytes, signed_, unsigned_, boolean, i32, u16, character };

struct Part {
    Kind kind;
    std::string text;     // string, bytes, character
    std::int64_t s = 0;   // signed_, i32
    std::uint64_t u = 0;  // unsigned_, u16
    bool b = false;
};

std::vector<Part> decode_parts(idem_fuzz::Reader& in) {
    std::vector<Part> parts;
    while (!in.empty() && parts.size() < 64) {
        Part p{static_cast<Kind>(in.u8() % 8), {}};
        switch (p.kind) {
            case Kind::string:
            case Kind::bytes: p.text = in.bytes(in.u8()); break;
            case Kind::signed_: p.s = static_cast<std::int64_t>(in.u64()); break;
            case Kind::unsigned_: p.u = in.u64(); break;
            case Kind::boolean: p.b = (in.u8() & 1) != 0; break;
            case Kind::i32: p.s = static_cast<std::int32_t>(static_cast<std::uint32_t>(in.u64())); break;
            case Kind::u16: p.u = static_cast<std::uint16_t>(in.u64()); break;
            case Kind::character:
                p.text = in.bytes(1);
                if (p.text.empty()) p.text = "x";
                break;
        }
        parts.push_back(std::move(p));
    }
    return parts;
}

std::span<const std::byte> as_bytes(const std::string& s) {
    return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Through the explicit add_* members.
idem::Fingerprint with_members(const std::vector<Part>& parts) {
    idem::FingerprintBuilder b;
    for (const Part& p : parts) {
        switch (p.kind) {
            case Kind::string:
            case Kind::character: b.add_string(p.text); break;
            case Kind::bytes: b.add_bytes(as_bytes(p.text)); break;
            case Kind::signed_:
            case Kind::i32: b.add_signed(p.s); break;
            case Kind::unsigned_:
            case Kind::u16: b.add_unsigned(p.u); break;
            case Kind::boolean: b.add_bool(p.b); break;
        }
    }
    return b.finish();
}

// Through the add<T> template with the natural C++ types (int32 widens to int64, etc.).
idem::Fingerprint with_template(const std::vector<Part>& parts) {
    idem::FingerprintBuilder b;
    for (const Part& p : parts) {
        switch (p.kind) {
            case Kind::string: b.add(p.text); break;
            case Kind::character: b.add(p.text[0]); break;
            case Kind::bytes: {
                std::vector<std::byte> v(as_bytes(p.text).begin(), as_bytes(p.text).end());
                b.add(std::span<const std::byte>(v));
                break;
            }
            case Kind::signed_: b.add(p.s); break;
            case Kind::i32: b.add(static_cast<std::int32_t>(p.s)); break;
            case Kind::unsigned_: b.add(p.u); break;
            case Kind::u16: b.add(static_cast<std::uint16_t>(p.u)); break;
            case Kind::boolean: b.add(p.b); break;
        }
    }
    return b.finish();
}

// The documented encoding, recomputed independently.
idem::Fingerprint::Digest reference(const std::vector<Part>& parts) {
    std::string enc;
    const auto put = [&](char tag, std::string_view bytes) {
        enc.push_back(tag);
        for (int i = 7; i >= 0; --i)
            enc.push_back(static_cast<char>((static_cast<std::uint64_t>(bytes.size()) >> (8 * i)) & 0xFF));
        enc.append(bytes);
    };
    const auto be64 = [](std::uint64_t v) {
        std::string s(8, '\0');
        for (int i = 7; i >= 0; --i, v >>= 8) s[static_cast<std::size_t>(i)] = static_cast<char>(v & 0xFF);
        return s;
    };
    put('s', "idem.fingerprint.v1");
    for (const Part& p : parts) {
        switch (p.kind) {
            case Kind::string:
            case Kind::character: put('s', p.text); break;
            case Kind::bytes: put('x', p.text); break;
            case Kind::signed_:
            case Kind::i32: put('i', be64(static_cast<std::uint64_t>(p.s))); break;
            case Kind::unsigned_:
            case Kind::u16: put('u', be64(p.u)); break;
            case Kind::boolean: put('b', std::string(1, p.b ? '\1' : '\0')); break;
        }
    }
    idem::Fingerprint::Digest d;
    SHA256(reinterpret_cast<const unsigned char*>(enc.data()), enc.size(), reinterpret_cast<unsigned char*>(d.data()));
    return d;
}

void check_spent_builder() {
    idem::FingerprintBuilder b;
    b.add_string("x");
    (void)b.finish();
    bool threw = false;
    try {
        b.add_string("y");
    } catch (const std::logic_error&) {
        threw = true;
    }
    FUZZ_CHECK(threw, "add after finish() did not throw logic_error");
    threw = false;
    try {
        (void)b.finish();
    } catch (const std::logic_error&) {
        threw = true;
    }
    FUZZ_CHECK(threw, "second finish() did not throw logic_error");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    static const bool once = (check_spent_builder(), true);
    (void)once;

    idem_fuzz::Reader in(data, size);
    const std::size_t split_hint = in.u16();
    const std::vector<Part> parts = decode_parts(in);

    // Determinism and the documented encoding.
    const idem::Fingerprint a = with_members(parts);
    const idem::Fingerprint b = with_members(parts);
    const idem::Fingerprint c = with_template(parts);
    FUZZ_CHECK(a == b, "same parts, different digests: %s vs %s", a.hex().c_str(), b.hex().c_str());
    FUZZ_CHECK(a == c, "add<T> and add_* disagree: %s vs %s", a.hex().c_str(), c.hex().c_str());
    FUZZ_CHECK(a.digest() == reference(parts), "digest differs from the documented encoding: %s", a.hex().c_str());
    FUZZ_CHECK(a.algorithm() == idem::FingerprintAlgorithm::sha256, "algorithm");
    FUZZ_CHECK(a.bytes().size() == idem::Fingerprint::size, "bytes() size");
    const std::string hex = a.hex();
    FUZZ_CHECK(hex.size() == 64 && hex.find_first_not_of("0123456789abcdef") == std::string::npos, "hex %s",
               hex.c_str());
    FUZZ_CHECK(idem::Fingerprint::from_bytes(1, a.bytes()) == a, "from_bytes round trip");

    // from_bytes refuses what is not a stored SHA-256 or HMAC-SHA256 fingerprint.
    std::string stored(a.bytes());
    stored.resize(split_hint % 64);
    const auto alg = static_cast<std::int16_t>(split_hint >> 6);
    if (stored.size() != idem::Fingerprint::size || (alg != 1 && alg != 2)) {
        bool threw = false;
        try {
            (void)idem::Fingerprint::from_bytes(alg, stored);
        } catch (const idem::corrupt_record&) {
            threw = true;
        }
        FUZZ_CHECK(threw, "from_bytes accepted alg %d, %zu bytes", alg, stored.size());
    }

    // Unambiguity of the length prefix: split the concatenated payload bytes of all parts two ways.
    std::string all;
    for (const Part& p : parts) all += p.text;
    const std::size_t k = split_hint % (all.size() + 1);
    const std::size_t j = (k + 1 + split_hint / 7 % (all.size() + 1)) % (all.size() + 1);
    const auto two = [&](std::size_t at) { return idem::fingerprint(all.substr(0, at), all.substr(at)); };
    const idem::Fingerprint fk = two(k);
    FUZZ_CHECK(fk == two(k), "split fingerprint not deterministic");
    if (j != k) FUZZ_CHECK(fk != two(j), "splits at %zu and %zu collide", k, j);
    FUZZ_CHECK(fk != idem::fingerprint(all), "a 2-way split equals the unsplit string");
    // Type tags: the same bytes as string and as bytes, the same number signed and unsigned,
    // a bool and the number 0/1, differ.
    {
        idem::FingerprintBuilder s, x;
        s.add_string(all);
        x.add_bytes(as_bytes(all));
        FUZZ_CHECK(s.finish() != x.finish(), "string and bytes of the same content collide");
    }
    const auto n = static_cast<std::int64_t>(split_hint) - 1;
    FUZZ_CHECK(idem::fingerprint(n) != idem::fingerprint(static_cast<std::uint64_t>(n)), "signed == unsigned");
    FUZZ_CHECK(idem::fingerprint(true) != idem::fingerprint(std::int64_t{1}), "true == 1");
    FUZZ_CHECK(idem::fingerprint(n) != idem::fingerprint(std::to_string(n)), "n == \"n\"");
    return 0;
}
