// idem/key.hpp — an idempotency key: the client's value within a mandatory scope.
//
// The scope separates tenants/accounts/endpoints ("acct_42:POST /payments"); the same value in two
// scopes is two different keys, and no call in one scope can see a key of another.
//
// Contract: scope and value are each 1..255 bytes of valid UTF-8 with no control characters
// (C0 U+0000..U+001F, DEL U+007F, C1 U+0080..U+009F). Anything else throws idem::invalid_key from the constructor, before any
// I/O. Everything else — quotes, semicolons, "'; DROP TABLE x; --" — is stored verbatim: every
// statement idem runs is parameterised.
//
// Thread-safety: immutable value type.
#pragma once

#include <compare>
#include <cstddef>
#include <string>
#include <string_view>

namespace idem {

class Key {
public:
    static constexpr std::size_t max_bytes = 255;

    /// Throws invalid_key if scope or value breaks the contract above.
    Key(std::string scope, std::string value);

    [[nodiscard]] const std::string& scope() const noexcept { return scope_; }
    [[nodiscard]] const std::string& value() const noexcept { return value_; }

    friend bool operator==(const Key&, const Key&) = default;
    friend auto operator<=>(const Key&, const Key&) = default;

private:
    std::string scope_;
    std::string value_;
};

/// Checks one part of a key ("scope" or "value" in the message); throws invalid_key. Exposed so that
/// services can validate a header before doing anything else.
void validate_key_part(std::string_view part, std::string_view what);

}  // namespace idem
