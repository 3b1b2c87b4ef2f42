// tools/idemctl/json.hpp — the JSON idemctl prints with --json: nlohmann-json's ordered_json.
//
// Objects keep their members in insertion order (stable, diff-friendly output). Stored bytes go in
// through set_bytes() (text.hpp): a string when they are valid UTF-8, base64 otherwise. Any other
// string that may hold malformed UTF-8 (a message quoting the command line) is still printed as
// valid JSON: dump() writes each malformed byte as U+FFFD instead of throwing.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace idemctl {

using Json = nlohmann::ordered_json;

/// Compact JSON (RFC 8259), no trailing newline; never throws for a string's bytes.
[[nodiscard]] inline std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace idemctl
