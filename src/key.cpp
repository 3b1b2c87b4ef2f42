#include "idem/key.hpp"

#include <cstdint>
#include <string>

#include "idem/errors.hpp"

namespace idem {
namespace {

// Length of the UTF-8 sequence starting at s[i] and its code point, or 0 if it is not well formed
// (overlong forms, surrogates and code points past U+10FFFF are rejected, as PostgreSQL does).
std::size_t decode_utf8(std::string_view s, std::size_t i, char32_t& cp) {
    const auto byte = [&](std::size_t k) { return static_cast<std::uint8_t>(s[k]); };
    const std::uint8_t b0 = byte(i);
    std::size_t n = 0;
    char32_t min = 0;
    if (b0 < 0x80) {
        cp = b0;
        return 1;
    } else if ((b0 & 0xE0) == 0xC0) {
        n = 2, cp = b0 & 0x1F, min = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
        n = 3, cp = b0 & 0x0F, min = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
        n = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (i + n > s.size()) return 0;
    for (std::size_t k = 1; k < n; ++k) {
        if ((byte(i + k) & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (byte(i + k) & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return n;
}

}  // namespace

void validate_key_part(std::string_view part, std::string_view what) {
    const auto fail = [&](const std::string& why) {
        throw invalid_key("idem: invalid key " + std::string(what) + ": " + why);
    };
    if (part.empty()) fail("empty");
    if (part.size() > Key::max_bytes) {
        fail(std::to_string(part.size()) + " bytes, at most " + std::to_string(Key::max_bytes));
    }
    for (std::size_t i = 0; i < part.size();) {
        // Printable ASCII, the common case (UUIDs, hex ids), without decoding.
        const auto b = static_cast<std::uint8_t>(part[i]);
        if (b >= 0x20 && b < 0x7F) {
            ++i;
            continue;
        }
        char32_t cp = 0;
        const std::size_t n = decode_utf8(part, i, cp);
        if (n == 0) fail("not valid UTF-8 at byte " + std::to_string(i));
        if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) {
            fail("control character at byte " + std::to_string(i));
        }
        i += n;
    }
}

Key::Key(std::string scope, std::string value) : scope_(std::move(scope)), value_(std::move(value)) {
    validate_key_part(scope_, "scope");
    validate_key_part(value_, "value");
}

ScopeFilter ScopeFilter::exact(std::string scope) {
    validate_key_part(scope, "scope");
    return ScopeFilter(Kind::exact, std::move(scope));
}

ScopeFilter ScopeFilter::prefix(std::string scope_prefix) {
    // The scope rules: a prefix breaking them either matches nothing (too long) or would be compared
    // differently by each store (a UTF-8 sequence cut short: PostgreSQL refuses the parameter).
    validate_key_part(scope_prefix, "scope prefix");
    return ScopeFilter(Kind::prefix, std::move(scope_prefix));
}

bool ScopeFilter::matches(std::string_view scope) const noexcept {
    switch (kind_) {
        case Kind::all: return true;
        case Kind::exact: return scope == text_;
        case Kind::prefix: return scope.starts_with(text_);
    }
    return false;
}

}  // namespace idem
