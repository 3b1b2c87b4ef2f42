// The key header's field value, read with the reason it is not a key and the advice for the client
// (internal to idem::http; parse_key in include/idem/http.hpp is the public part).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "idem/http.hpp"

namespace idem::http {

/// Why a field value is not a key of the route's form.
enum class KeyFault {
    none,
    empty,                ///< nothing but whitespace
    bare,                 ///< not quoted, on a route that accepts only sf-strings
    comma,                ///< a bare value holding ','
    unterminated,         ///< a quoted string without its closing quote
    bad_escape,           ///< a backslash before anything but '"' or '\'
    not_printable_ascii,  ///< a quoted string holding a byte outside 0x20-0x7E
    after_string,         ///< something other than parameters after the closing quote
};

struct KeyReading {
    std::optional<std::string> key;  ///< set when fault is none
    KeyFault fault = KeyFault::none;
};

/// parse_key with the reason it failed.
[[nodiscard]] KeyReading read_key(std::string_view field_value, KeyForm form);

/// `key` as an sf-string (quoted, '"' and '\' escaped), or "" when it cannot be one (empty, over 255
/// bytes, a byte outside 0x20-0x7E).
[[nodiscard]] std::string sf_string_of(std::string_view key);

/// The problem detail for a value `fault` refused: what to send instead, as a header line naming
/// `header` (the value itself, quoted, when it can be sent as one).
[[nodiscard]] std::string key_advice(std::string_view field_value, KeyFault fault, KeyForm form,
                                     std::string_view header);

}  // namespace idem::http
