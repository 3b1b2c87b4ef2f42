// tools/idemctl/text.cpp — showing bytes, times and durations (see text.hpp).
#include "text.hpp"

#include "utf8.hpp"

#include <fmt/format.h>
#include <cstdint>
#include <ctime>

namespace idemctl {

bool is_utf8(std::string_view bytes) noexcept {
    char32_t cp = 0;
    for (std::size_t i = 0; i < bytes.size();) {
        const std::size_t n = idem::detail::decode_utf8(bytes, i, cp);
        if (n == 0) return false;
        i += n;
    }
    return true;
}

namespace {

/// Characters a terminal draws as nothing or uses to reorder or split text: bidirectional controls
/// (a key could show as another key), zero-width characters, line and paragraph separators, the
/// byte order mark, interlinear annotation and tag characters. printable() escapes them.
bool invisible(char32_t cp) noexcept {
    return cp == 0xAD || cp == 0x61C || cp == 0x180E || (cp >= 0x200B && cp <= 0x200F) ||
           (cp >= 0x2028 && cp <= 0x202E) || (cp >= 0x2060 && cp <= 0x206F) || cp == 0xFEFF ||
           (cp >= 0xFFF9 && cp <= 0xFFFB) || (cp >= 0xE0000 && cp <= 0xE007F);
}

/// Columns a terminal gives a printable code point: 0 for combining marks, 2 for East Asian wide
/// and fullwidth characters and emoji, 1 otherwise (wcwidth()'s answer for the common scripts).
std::size_t columns_of(char32_t cp) noexcept {
    if ((cp >= 0x300 && cp <= 0x36F) || (cp >= 0x1AB0 && cp <= 0x1AFF) || (cp >= 0x1DC0 && cp <= 0x1DFF) ||
        (cp >= 0x20D0 && cp <= 0x20FF) || (cp >= 0xFE00 && cp <= 0xFE0F) || (cp >= 0xFE20 && cp <= 0xFE2F))
        return 0;
    if ((cp >= 0x1100 && cp <= 0x115F) || (cp >= 0x2E80 && cp <= 0x303E) || (cp >= 0x3041 && cp <= 0x33FF) ||
        (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0xA000 && cp <= 0xA4CF) ||
        (cp >= 0xAC00 && cp <= 0xD7A3) || (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0xFE30 && cp <= 0xFE4F) ||
        (cp >= 0xFF00 && cp <= 0xFF60) || (cp >= 0xFFE0 && cp <= 0xFFE6) || (cp >= 0x1F300 && cp <= 0x1F64F) ||
        (cp >= 0x1F900 && cp <= 0x1F9FF) || (cp >= 0x20000 && cp <= 0x3FFFD))
        return 2;
    return 1;
}

/// Calls piece(text, columns) for each printable piece of `bytes` in order: a code point as it is,
/// or the escape that stands for it (see printable()). Stops when piece returns false.
template <class Piece>
void for_each_piece(std::string_view bytes, Piece&& piece) {
    char32_t cp = 0;
    for (std::size_t i = 0; i < bytes.size();) {
        const std::size_t n = idem::detail::decode_utf8(bytes, i, cp);
        const char c = bytes[i];
        if (n == 0 || cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F)) {
            const std::size_t escaped = n == 0 ? 1 : n;  // a malformed byte, or every byte of a C1 control
            std::string text;
            if (c == '\n') text = "\\n";
            else if (c == '\t') text = "\\t";
            else {
                for (std::size_t k = i; k < i + escaped; ++k) {
                    text += fmt::format("\\x{:02x}", static_cast<unsigned>(static_cast<unsigned char>(bytes[k])));
                }
            }
            i += escaped;
            if (!piece(std::string_view(text), text.size())) return;
            continue;
        }
        bool go_on = true;
        if (c == '\\') go_on = piece(std::string_view("\\\\"), 2);
        else if (invisible(cp)) {
            const std::string text = fmt::format("\\u{{{:04x}}}", static_cast<std::uint32_t>(cp));
            go_on = piece(std::string_view(text), text.size());
        } else go_on = piece(bytes.substr(i, n), columns_of(cp));
        if (!go_on) return;
        i += n;
    }
}

}  // namespace

std::string escape_invisible(std::string_view json) {
    std::string out;
    out.reserve(json.size());
    char32_t cp = 0;
    for (std::size_t i = 0; i < json.size();) {
        const std::size_t n = idem::detail::decode_utf8(json, i, cp);
        if (n == 0) {  // not expected from a dump; kept as it is
            out += json[i++];
            continue;
        }
        if (!invisible(cp)) {
            out.append(json.substr(i, n));
        } else if (cp <= 0xFFFF) {
            out += fmt::format("\\u{:04x}", static_cast<std::uint32_t>(cp));
        } else {  // a surrogate pair, as JSON writes a character beyond the BMP
            const std::uint32_t v = static_cast<std::uint32_t>(cp) - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        }
        i += n;
    }
    return out;
}

std::string printable(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size());
    for_each_piece(bytes, [&](std::string_view text, std::size_t) {
        out += text;
        return true;
    });
    return out;
}

std::size_t display_width(std::string_view text) noexcept {
    std::size_t width = 0;
    char32_t cp = 0;
    for (std::size_t i = 0; i < text.size();) {
        const std::size_t n = idem::detail::decode_utf8(text, i, cp);
        width += n == 0 ? 1 : columns_of(cp);
        i += n == 0 ? 1 : n;
    }
    return width;
}

std::string printable_cut(std::string_view bytes, std::size_t max_columns, bool& cut) {
    std::string whole = printable(bytes);
    cut = display_width(whole) > max_columns;
    if (!cut) return whole;
    // Whole pieces only (never half an escape), leaving a column for the ellipsis.
    std::string out;
    std::size_t width = 0;
    for_each_piece(bytes, [&](std::string_view text, std::size_t columns) {
        if (width + columns + 1 > max_columns) return false;
        out += text;
        width += columns;
        return true;
    });
    return out + "…";
}

std::string base64(std::string_view bytes) {
    static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((bytes.size() + 2) / 3 * 4);
    for (std::size_t i = 0; i < bytes.size(); i += 3) {
        const std::size_t left = bytes.size() - i;
        std::uint32_t v = static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[i])) << 16;
        if (left > 1) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
        if (left > 2) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[i + 2]));
        out += kAlphabet[(v >> 18) & 63];
        out += kAlphabet[(v >> 12) & 63];
        out += left > 1 ? kAlphabet[(v >> 6) & 63] : '=';
        out += left > 2 ? kAlphabet[v & 63] : '=';
    }
    return out;
}

void set_bytes(Json& obj, const std::string& name, std::string_view bytes) {
    if (is_utf8(bytes)) {
        obj[name] = bytes;
    } else {
        obj[name] = nullptr;
        obj[name + "_base64"] = base64(bytes);
    }
}

void set_optional_bytes(Json& obj, const std::string& name, const std::optional<std::string>& bytes) {
    if (bytes) set_bytes(obj, name, std::string_view(*bytes));
    else obj[name] = nullptr;
}

std::string format_time(TimePoint t) {
    using namespace std::chrono;
    const auto ms = duration_cast<milliseconds>(t.time_since_epoch()).count();
    const std::int64_t secs = ms >= 0 ? ms / 1000 : (ms - 999) / 1000;
    const std::time_t tt = static_cast<std::time_t>(secs);
    std::tm tm{};
    gmtime_r(&tt, &tm);
    return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                       tm.tm_hour, tm.tm_min, tm.tm_sec, ms - secs * 1000);
}

std::string format_duration(std::chrono::milliseconds d) {
    const std::int64_t ms = d.count() < 0 ? -d.count() : d.count();
    const std::int64_t s = ms / 1000;
    if (ms < 1000) return fmt::format("{}ms", ms);
    if (s < 60) return fmt::format("{}s", s);
    if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
    if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
    return fmt::format("{}d{:02}h", s / 86400, s % 86400 / 3600);
}

std::int64_t millis_between(TimePoint from, TimePoint to) noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

std::string relative(TimePoint t, TimePoint now) {
    const auto ms = std::chrono::milliseconds(millis_between(now, t));
    return ms.count() >= 0 ? "in " + format_duration(ms) : format_duration(ms) + " ago";
}

}  // namespace idemctl
