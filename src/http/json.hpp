// Strict JSON for idem::http (internal): the value a JSON Pointer (RFC 6901) names in a body.
// canonical_json in include/idem/http.hpp is the public part of the same parser (json.cpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/http.hpp"

namespace idem::http {

/// What a JSON value is.
enum class JsonKind { absent, object, array, string, number, boolean, null };

/// The value at a pointer: its kind (absent: nothing there) and, for a string, its decoded bytes.
struct JsonMember {
    JsonKind kind = JsonKind::absent;
    std::string string;
};

/// Parses `json` as canonical_json does (strict RFC 8259, no duplicate member names, nesting up to
/// 64); nullopt if it is not such JSON, else the value at `pointer` (unescaped tokens, as from
/// parse_json_pointer). An array element is named by its index in decimal ("0", "12"): "00", "-"
/// and anything else name nothing.
[[nodiscard]] std::optional<JsonMember> json_member(std::string_view json, const std::vector<std::string>& pointer);

/// A JSON Pointer's tokens, "~1" and "~0" unescaped; nullopt if `pointer` is not one (not empty and
/// not starting with '/', or a '~' not followed by '0' or '1').
[[nodiscard]] std::optional<std::vector<std::string>> parse_json_pointer(std::string_view pointer);

}  // namespace idem::http
