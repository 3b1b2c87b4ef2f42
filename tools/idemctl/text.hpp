// tools/idemctl/text.hpp — how idemctl shows bytes, times and durations.
//
// Stored bytes (keys, result bodies, phase data) may be anything. On a terminal, printable()
// escapes whatever is not printable UTF-8, so nothing stored can move the cursor, change colours
// or reorder what is shown; tables are aligned by display_width() and cut by printable_cut(); in
// JSON, set_bytes() puts valid UTF-8 in a string member and anything else in a base64 member. Times
// are shown in UTC, ISO 8601 with milliseconds; ages and leases relative to the database's clock
// (the read time it reported), never the local one.
#pragma once

#include "json.hpp"

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace idemctl {

using TimePoint = std::chrono::system_clock::time_point;

/// Whether `bytes` is well-formed UTF-8 (as PostgreSQL and idem's keys define it).
[[nodiscard]] bool is_utf8(std::string_view bytes) noexcept;

/// `bytes` for a terminal: printable UTF-8 kept, '\n' '\t' and '\\' as C escapes, any other
/// control character or malformed byte as \xNN, and a character a terminal would draw as nothing
/// or use to reorder text (bidirectional controls, zero-width characters) as \u{XXXX}.
[[nodiscard]] std::string printable(std::string_view bytes);

/// The columns printable text (printable()'s, or any UTF-8 without control characters) takes on a
/// terminal: East Asian wide characters and emoji take two, combining marks none.
[[nodiscard]] std::size_t display_width(std::string_view text) noexcept;

/// printable(bytes) in at most `max_columns` columns (at least 1): when it is wider, as much of it as
/// fits before a final "…", and `cut` is set. An escape is never cut in half.
[[nodiscard]] std::string printable_cut(std::string_view bytes, std::size_t max_columns, bool& cut);

/// Standard base64 (RFC 4648, with padding).
[[nodiscard]] std::string base64(std::string_view bytes);

/// obj[name] = bytes as a string when they are UTF-8; otherwise obj[name] = null and
/// obj[name + "_base64"] = their base64.
void set_bytes(Json& obj, const std::string& name, std::string_view bytes);

/// set_bytes() for a value that may be absent (obj[name] = null then).
void set_optional_bytes(Json& obj, const std::string& name, const std::optional<std::string>& bytes);

/// "2026-12-02T02:40:00.123Z".
[[nodiscard]] std::string format_time(TimePoint t);

/// A rough, readable length: "850ms", "42s", "3m12s", "2h05m", "3d04h".
[[nodiscard]] std::string format_duration(std::chrono::milliseconds d);

/// `t` relative to `now`: "in 29s" or "3m12s ago" (milliseconds are whole: both are exact).
[[nodiscard]] std::string relative(TimePoint t, TimePoint now);

/// Whole milliseconds from `from` to `to` (negative when `to` is earlier).
[[nodiscard]] std::int64_t millis_between(TimePoint from, TimePoint to) noexcept;

}  // namespace idemctl
