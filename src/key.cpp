#include "idem/key.hpp"

#include <cstdint>
#include <string>

#include "idem/errors.hpp"
#include "utf8.hpp"

namespace idem {

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
        const std::size_t n = detail::decode_utf8(part, i, cp);
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
