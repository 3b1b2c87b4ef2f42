// idem/key.hpp — an idempotency key: the client's value within a mandatory scope.
//
// The scope separates tenants/accounts/endpoints ("acct_42:POST /payments"); the same value in two
// scopes is two different keys, and no call in one scope can see a key of another.
//
// Contract: scope and value are each 1..255 bytes of valid UTF-8 with no control characters
// (C0 U+0000..U+001F, DEL U+007F, C1 U+0080..U+009F). Anything else throws idem::invalid_key from the constructor,
// before any I/O. Everything else — quotes, semicolons, "'; DROP TABLE x; --" — is stored verbatim: every statement
// idem runs is parameterised.
//
// ScopeFilter (below) says which scopes a listing covers — list_stale() and a Reconciler.
//
// Thread-safety: immutable value types.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace idem {

/// An idempotency key: the client's value within a mandatory scope (see the top of this header).
class Key {
public:
    /// The longest scope, and the longest value, in bytes.
    static constexpr std::size_t max_bytes = 255;

    /// Throws invalid_key if scope or value breaks the contract above.
    Key(std::string scope, std::string value);

    /// The scope, e.g. "acct_42:POST /payments".
    [[nodiscard]] const std::string& scope() const noexcept { return scope_; }
    /// The client's value (the Idempotency-Key header).
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

/// Which scopes a listing of keys covers (IdempotencyStore::list_stale, ReconcilerOptions::scopes).
///
///   ScopeFilter::all()                every scope (also what a default-constructed filter means)
///   ScopeFilter::exact("acct_42")     the scope "acct_42" only — not "acct_420"
///   ScopeFilter::prefix("acct_42:")   every scope that starts with these bytes, "acct_42:" itself
///                                     included; compared byte by byte, so '%' and '_' are plain
///                                     characters, never wildcards
///
/// There is deliberately no conversion from a string: "tenant" as a prefix also selects "tenantB",
/// so every call site has to say which of the two it means. Use exact() for one tenant's scope,
/// prefix() only when scopes are built as "<prefix><something>" and the prefix ends in a separator.
///
/// Errors: exact() throws invalid_key unless its argument is a valid scope (Key's rules: 1..255 bytes
/// of UTF-8 without control characters), so a filter that could never match is refused, not run.
/// prefix() holds its argument to the same rules; in particular an empty prefix is refused rather
/// than read as "every scope": it usually is an unset setting, and it would widen one tenant's
/// reconciler to every tenant. Say all() when every scope is meant.
class ScopeFilter {
public:
    /// Which of the three forms a filter is.
    enum class Kind : std::uint8_t { all, exact, prefix };

    /// Every scope; the same as all().
    ScopeFilter() noexcept = default;

    /// Every scope.
    [[nodiscard]] static ScopeFilter all() noexcept { return ScopeFilter(); }
    /// Only `scope`. Throws invalid_key if it is not a valid scope.
    [[nodiscard]] static ScopeFilter exact(std::string scope);
    /// Scopes starting with `scope_prefix` (literally). Throws invalid_key if it is empty, longer
    /// than Key::max_bytes, not UTF-8 or contains a control character.
    [[nodiscard]] static ScopeFilter prefix(std::string scope_prefix);

    /// all, exact or prefix.
    [[nodiscard]] Kind kind() const noexcept { return kind_; }
    /// The scope (exact) or the prefix (prefix); empty for all.
    [[nodiscard]] const std::string& text() const noexcept { return text_; }
    /// Whether the filter selects `scope`.
    [[nodiscard]] bool matches(std::string_view scope) const noexcept;

    friend bool operator==(const ScopeFilter&, const ScopeFilter&) = default;

private:
    ScopeFilter(Kind kind, std::string text) noexcept : kind_(kind), text_(std::move(text)) {}

    Kind kind_ = Kind::all;
    std::string text_;
};

}  // namespace idem
