// Character classes and comparisons of HTTP fields (internal to idem::http).
#pragma once

#include <algorithm>
#include <string_view>

namespace idem::http::lex {

/// ASCII case-insensitive equality (header names).
inline bool iequals(std::string_view a, std::string_view b) noexcept {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
               const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
               return lower(x) == lower(y);
           });
}

inline bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }
inline bool is_alpha(char c) noexcept { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
inline bool is_lcalpha(char c) noexcept { return c >= 'a' && c <= 'z'; }

/// RFC 9110 tchar.
inline bool is_tchar(char c) noexcept {
    return is_alpha(c) || is_digit(c) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

/// Without leading and trailing spaces and tabs (RFC 9110 OWS).
inline std::string_view trim(std::string_view s) noexcept {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

}  // namespace idem::http::lex
