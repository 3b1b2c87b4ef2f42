// Key: scope and value are each 1..255 bytes of valid UTF-8 without control characters.
#include "idem/key.hpp"
#include "idem/errors.hpp"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

using namespace std::string_literals;

namespace {

struct Bad {
    std::string bytes;
    const char* why;
};

// Every one of these must be refused, as a scope and as a value.
std::vector<Bad> bad_parts() {
    return {
        {"", "empty"},
        {std::string(256, 'k'), "256 bytes"},
        {"a\0b"s, "NUL inside"},
        {"\0"s, "NUL alone"},
        {"abc\0"s, "trailing NUL"},
        {"a\tb", "tab"},
        {"a\nb", "newline"},
        {"a\rb", "carriage return"},
        {"\x1f", "U+001F"},
        {"\x01key", "U+0001"},
        {"a\xc2\x80"
         "b",
         "U+0080 (C1 control)"},
        {"a\xc2\x9f"
         "b",
         "U+009F (C1 control)"},
        {"a\x7f", "DEL U+007F"},
        {"\xff", "0xFF is never UTF-8"},
        {"\xfe", "0xFE is never UTF-8"},
        {"\x80", "lone continuation byte"},
        {"abc\xc3", "truncated 2-byte sequence"},
        {"\xe2\x82", "truncated 3-byte sequence"},
        {"\xc3\x28", "bad continuation"},
        {"\xc0\xaf", "overlong '/' (2 bytes)"},
        {"\xc1\xbf", "overlong (2 bytes, C1 lead)"},
        {"\xc0\x80", "overlong NUL"},
        {"\xe0\x80\xaf", "overlong '/' (3 bytes)"},
        {"\xf0\x80\x80\xaf", "overlong '/' (4 bytes)"},
        {"\xed\xa0\x80", "surrogate U+D800"},
        {"\xed\xbf\xbf", "surrogate U+DFFF"},
        {"\xf4\x90\x80\x80", "past U+10FFFF"},
        {"\xf5\x80\x80\x80", "lead byte 0xF5"},
        {"\xf8\x88\x80\x80\x80", "5-byte form"},
    };
}

// Each of these must be accepted and kept byte for byte.
std::vector<std::string> good_parts() {
    return {
        "k",
        "'; DROP TABLE x; --",
        "$1",
        "\\x00",
        "Robert'); DROP TABLE students;--",
        "%_*?[]{}()\"'`\\",
        "with spaces inside",
        "caf\xc3\xa9",               // café
        "\xe6\x97\xa5\xe6\x9c\xac",  // 日本
        "\xf0\x9f\x98\x80",          // U+1F600
        "\xef\xbf\xbf",              // U+FFFF (a noncharacter, but valid UTF-8)
        "\xf4\x8f\xbf\xbf",          // U+10FFFF, the last code point
        "550e8400-e29b-41d4-a716-446655440000",
        std::string(255, 'k'),
    };
}

}  // namespace

TEST_CASE("Key accepts valid scopes and values verbatim", "[key]") {
    for (const auto& part : good_parts()) {
        CAPTURE(part);
        const idem::Key as_value("acct_42:POST /payments", part);
        CHECK(as_value.value() == part);
        CHECK(as_value.scope() == "acct_42:POST /payments");
        const idem::Key as_scope(part, "v");
        CHECK(as_scope.scope() == part);
        CHECK(as_scope.value() == "v");
        CHECK_NOTHROW(idem::validate_key_part(part, "value"));
    }
}

TEST_CASE("Key rejects bad values and bad scopes with invalid_key", "[key]") {
    for (const auto& bad : bad_parts()) {
        CAPTURE(bad.why);
        CHECK_THROWS_AS(idem::Key("scope", bad.bytes), idem::invalid_key);
        CHECK_THROWS_AS(idem::Key(bad.bytes, "value"), idem::invalid_key);
        CHECK_THROWS_AS(idem::validate_key_part(bad.bytes, "value"), idem::invalid_key);
    }
}

TEST_CASE("Key length is counted in bytes: 255 ok, 256 rejected", "[key]") {
    CHECK(idem::Key::max_bytes == 255);
    CHECK_NOTHROW(idem::Key(std::string(255, 's'), std::string(255, 'v')));
    CHECK_THROWS_AS(idem::Key("s", std::string(256, 'v')), idem::invalid_key);
    CHECK_THROWS_AS(idem::Key(std::string(256, 's'), "v"), idem::invalid_key);

    std::string euro255;  // 85 x U+20AC (3 bytes each) = 255 bytes
    for (int i = 0; i < 85; ++i) euro255 += "\xe2\x82\xac";
    REQUIRE(euro255.size() == 255);
    CHECK_NOTHROW(idem::Key("s", euro255));
    CHECK_THROWS_AS(idem::Key("s", euro255 + "\xe2\x82\xac"), idem::invalid_key);  // 258 bytes
    CHECK_THROWS_AS(idem::Key("s", euro255 + "x"), idem::invalid_key);             // 256 bytes
}

TEST_CASE("invalid_key is an idem::error and names the offending part", "[key]") {
    try {
        idem::Key("", "value");
        FAIL("empty scope accepted");
    } catch (const idem::error& e) {
        CHECK(dynamic_cast<const idem::invalid_key*>(&e) != nullptr);
        CHECK(std::string(e.what()).find("scope") != std::string::npos);
        CHECK(e.sqlstate().empty());
    }
    try {
        idem::Key("scope", "bad\x01");
        FAIL("control character accepted");
    } catch (const idem::invalid_key& e) {
        CHECK(std::string(e.what()).find("value") != std::string::npos);
    }
}

TEST_CASE("Key equality and ordering keep scope and value apart", "[key]") {
    const idem::Key a("s1", "v");
    const idem::Key b("s2", "v");
    const idem::Key c("s1", "v");
    CHECK(a == c);
    CHECK_FALSE(a == b);
    CHECK(a < b);
    CHECK_FALSE(idem::Key("ab", "c") == idem::Key("a", "bc"));
}
