// tests/tools/percent_decode_test.cpp — idemctl's percent_decode_like_httplib
// (tools/idemctl/percent_decode.hpp): the key cpp-httplib 0.11 hands an HTTP adapter for the
// header value a client sent. The table below is the rule; where cpp-httplib is installed, the
// function is also checked against cpp-httplib's own decoder on every string of a small alphabet
// that makes escapes, broken escapes and their neighbours.
#include "percent_decode.hpp"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#ifdef IDEMCTL_TEST_HTTPLIB
#include <httplib.h>
#endif

using idemctl::percent_decode_like_httplib;
using namespace std::string_literals;

TEST_CASE("percent_decode_like_httplib: cpp-httplib 0.11's header-value rule", "[idemctl][unit]") {
    CHECK(percent_decode_like_httplib("k%41") == "kA");
    CHECK(percent_decode_like_httplib("%7e%7E") == "~~");  // either case
    CHECK(percent_decode_like_httplib("%41%42c") == "ABc");
    CHECK(percent_decode_like_httplib("%2541") == "%41");  // decoded once
    CHECK(percent_decode_like_httplib("%%41") == "%A");
    CHECK(percent_decode_like_httplib("a+b%2B") == "a+b+");  // '+' is not a space in a header
    CHECK(percent_decode_like_httplib("k%00x") == "k\0x"s);
    CHECK(percent_decode_like_httplib("%ff") == "\xff");  // any byte, valid UTF-8 or not
    // A '%' that starts no escape stays.
    CHECK(percent_decode_like_httplib("50%off") == "50%off");
    CHECK(percent_decode_like_httplib("100%") == "100%");
    CHECK(percent_decode_like_httplib("%4") == "%4");
    CHECK(percent_decode_like_httplib("%g1") == "%g1");
    CHECK(percent_decode_like_httplib("") == "");
    // %uXXXX: a code point, in UTF-8; a surrogate decodes to nothing.
    CHECK(percent_decode_like_httplib("%u0041") == "A");
    CHECK(percent_decode_like_httplib("caf%u00e9") == "café");
    CHECK(percent_decode_like_httplib("%u65E5") == "日");
    CHECK(percent_decode_like_httplib("a%uD800b") == "ab");
    CHECK(percent_decode_like_httplib("%u004") == "%u004");
    CHECK(percent_decode_like_httplib("%u") == "%u");
    CHECK(percent_decode_like_httplib("%U0041") == "%U0041");  // only a lower-case u
}

#ifdef IDEMCTL_TEST_HTTPLIB
TEST_CASE("percent_decode_like_httplib agrees with cpp-httplib's decoder", "[idemctl][unit]") {
    // Every string of 1 to 6 characters over this alphabet: escapes of both kinds, cut short, next
    // to each other, and the digits and letters around them.
    const std::string alphabet = "%u0dDFg+\xc3";
    std::vector<std::string> level{""};
    std::size_t checked = 0, expected = 0;
    for (int length = 1; length <= 6; ++length) {
        std::vector<std::string> next;
        next.reserve(level.size() * alphabet.size());
        for (const auto& s : level) {
            for (const char c : alphabet) next.push_back(s + c);
        }
        for (const auto& s : next) {
            if (percent_decode_like_httplib(s) != httplib::detail::decode_url(s, false)) {
                FAIL_CHECK("differs from cpp-httplib for '" << s << "'");
            }
            ++checked;
        }
        expected += next.size();
        level = std::move(next);
    }
    CHECK(checked == expected);
    CHECK(checked > 500000);
}
#endif
