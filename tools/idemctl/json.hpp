// tools/idemctl/json.hpp — the JSON idemctl prints with --json: a small ordered value tree.
//
// Objects keep their members in insertion order (stable, diff-friendly output). Strings must be
// valid UTF-8 — text() in text.hpp says whether bytes are; callers put other bytes in a base64
// member instead. dump() escapes quotes, backslashes and control characters (RFC 8259).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace idemctl {

class Json {
public:
    using Array = std::vector<Json>;
    using Object = std::vector<std::pair<std::string, Json>>;

    Json() = default;  ///< null
    Json(std::nullptr_t) {}
    Json(bool value) : value_(value) {}
    Json(std::int64_t value) : value_(value) {}
    Json(int value) : value_(std::int64_t{value}) {}
    Json(std::uint64_t value) : value_(static_cast<std::int64_t>(value)) {}
    Json(std::string value) : value_(std::move(value)) {}
    Json(std::string_view value) : value_(std::string(value)) {}
    Json(const char* value) : value_(std::string(value)) {}
    Json(Array value) : value_(std::move(value)) {}
    Json(Object value) : value_(std::move(value)) {}

    [[nodiscard]] static Json object() { return Json(Object{}); }
    [[nodiscard]] static Json array() { return Json(Array{}); }

    /// Appends a member (an object) — no check for duplicates; returns *this for chaining.
    Json& set(std::string name, Json value);
    /// Appends an element (an array).
    Json& push(Json value);

    /// Compact JSON, no trailing newline.
    [[nodiscard]] std::string dump() const;

private:
    void dump_to(std::string& out) const;

    std::variant<std::nullptr_t, bool, std::int64_t, std::string, Array, Object> value_{nullptr};
};

}  // namespace idemctl
