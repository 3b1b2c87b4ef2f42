// tools/idemctl/json.hpp — the JSON idemctl prints with --json: nlohmann-json's ordered_json.
//
// Objects keep their members in insertion order (stable, diff-friendly output). Stored bytes go in
// through set_bytes() (text.hpp): a string when they are valid UTF-8, base64 otherwise. Any other
// string that may hold malformed UTF-8 (a message quoting the command line) is still printed as
// valid JSON: dump() writes each malformed byte as U+FFFD instead of throwing. Characters a
// terminal draws as nothing or uses to reorder text (bidirectional controls, zero-width and tag
// characters: the ones printable() escapes in text output) are written as \u escapes, as JSON
// allows for any character: the document means the same, and a terminal shows what is there.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace idemctl {

using Json = nlohmann::ordered_json;

/// `json` (valid UTF-8) with each invisible or reordering character as a \u escape (text.cpp).
[[nodiscard]] std::string escape_invisible(std::string_view json);

/// Compact JSON (RFC 8259), no trailing newline; never throws for a string's bytes.
[[nodiscard]] inline std::string dump(const Json& j) {
    return escape_invisible(j.dump(-1, ' ', false, Json::error_handler_t::replace));
}

}  // namespace idemctl
