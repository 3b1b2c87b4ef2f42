// tools/idemctl/percent_decode.cpp — cpp-httplib 0.11's header-value decoding (see
// percent_decode.hpp).
#include "percent_decode.hpp"

#include <cstddef>
#include <cstdint>

namespace idemctl {
namespace {

/// The value of `count` hex digits at text[at], or -1 when there are fewer.
long hex_at(std::string_view text, std::size_t at, std::size_t count) noexcept {
    if (at + count > text.size()) return -1;
    long value = 0;
    for (std::size_t k = at; k < at + count; ++k) {
        const char c = text[k];
        int digit = 0;
        if (c >= '0' && c <= '9') digit = c - '0';
        else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
        else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
        else return -1;
        value = value * 16 + digit;
    }
    return value;
}

/// A code point below U+10000 as UTF-8; nothing for a surrogate (as cpp-httplib's to_utf8).
void append_utf8(std::string& out, long cp) {
    const auto byte = [&](long b) { out += static_cast<char>(static_cast<std::uint8_t>(b)); };
    if (cp < 0x80) {
        byte(cp);
    } else if (cp < 0x800) {
        byte(0xC0 | (cp >> 6));
        byte(0x80 | (cp & 0x3F));
    } else if (cp < 0xD800 || cp >= 0xE000) {
        byte(0xE0 | (cp >> 12));
        byte(0x80 | ((cp >> 6) & 0x3F));
        byte(0x80 | (cp & 0x3F));
    }
}

}  // namespace

std::string percent_decode_like_httplib(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '%' || i + 1 >= text.size()) {
            out += text[i];
        } else if (text[i + 1] == 'u') {
            const long cp = hex_at(text, i + 2, 4);
            if (cp < 0) {
                out += '%';
            } else {
                append_utf8(out, cp);
                i += 5;
            }
        } else {
            const long b = hex_at(text, i + 1, 2);
            if (b < 0) {
                out += '%';
            } else {
                out += static_cast<char>(static_cast<std::uint8_t>(b));
                i += 2;
            }
        }
    }
    return out;
}

}  // namespace idemctl
