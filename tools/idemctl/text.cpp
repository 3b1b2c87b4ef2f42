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

std::string printable(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size());
    char32_t cp = 0;
    for (std::size_t i = 0; i < bytes.size();) {
        const std::size_t n = idem::detail::decode_utf8(bytes, i, cp);
        const char c = bytes[i];
        if (n == 0 || cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F)) {
            const std::size_t escaped = n == 0 ? 1 : n;  // a malformed byte, or every byte of a C1 control
            if (c == '\n') out += "\\n";
            else if (c == '\t') out += "\\t";
            else {
                for (std::size_t k = i; k < i + escaped; ++k) {
                    out += fmt::format("\\x{:02x}", static_cast<unsigned>(static_cast<unsigned char>(bytes[k])));
                }
            }
            i += escaped;
            continue;
        }
        if (c == '\\') out += "\\\\";
        else out.append(bytes.substr(i, n));
        i += n;
    }
    return out;
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
