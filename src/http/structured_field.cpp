// The key header's field value (RFC 8941 Structured Fields; parse_key in include/idem/http.hpp), and
// what to tell a client whose value is not a key.
#include <string>

#include "structured_field.hpp"

#include "chars.hpp"

namespace idem::http {
namespace {

/// A cursor over one Structured Field value (RFC 8941 §4.2); every parse_* returns false on failure.
struct SfParser {
    std::string_view in;
    std::size_t at = 0;

    [[nodiscard]] bool done() const noexcept { return at >= in.size(); }
    [[nodiscard]] char peek() const noexcept { return done() ? '\0' : in[at]; }

    KeyFault string_fault = KeyFault::none;  ///< why the last parse_string failed

    bool parse_string(std::string& out) {  // §4.2.5
        if (peek() != '"') return false;
        ++at;
        while (!done()) {
            const char c = in[at++];
            if (c == '\\') {
                if (done()) break;
                const char next = in[at++];
                if (next != '"' && next != '\\') {
                    string_fault = KeyFault::bad_escape;
                    return false;
                }
                out.push_back(next);
            } else if (c == '"') {
                return true;
            } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) {
                string_fault = KeyFault::not_printable_ascii;
                return false;
            } else {
                out.push_back(c);
            }
        }
        string_fault = KeyFault::unterminated;  // no closing DQUOTE
        return false;
    }
    bool parse_number() {  // §4.2.4 (integer or decimal), value unused
        if (peek() == '-') ++at;
        std::size_t digits = 0;
        if (!lex::is_digit(peek())) return false;
        while (lex::is_digit(peek())) ++at, ++digits;
        if (peek() != '.') return digits <= 15;
        if (digits > 12) return false;
        ++at;
        std::size_t fraction = 0;
        while (lex::is_digit(peek())) ++at, ++fraction;
        return fraction >= 1 && fraction <= 3;
    }
    bool parse_token() {  // §4.2.6
        if (!(lex::is_alpha(peek()) || peek() == '*')) return false;
        ++at;
        while (lex::is_tchar(peek()) || peek() == ':' || peek() == '/') ++at;
        return true;
    }
    bool parse_bytes() {  // §4.2.7
        ++at;
        while (lex::is_alpha(peek()) || lex::is_digit(peek()) || peek() == '+' || peek() == '/' || peek() == '=') ++at;
        if (peek() != ':') return false;
        ++at;
        return true;
    }
    bool parse_bare_item(std::string* string_out) {  // §4.2.3.1
        const char c = peek();
        if (c == '"') {
            std::string ignored;
            return parse_string(string_out ? *string_out : ignored);
        }
        if (string_out) return false;  // the key must be a String
        if (c == '-' || lex::is_digit(c)) return parse_number();
        if (c == '*' || lex::is_alpha(c)) return parse_token();
        if (c == ':') return parse_bytes();
        if (c == '?') {
            ++at;
            if (peek() != '0' && peek() != '1') return false;
            ++at;
            return true;
        }
        return false;
    }
    bool parse_parameters() {  // §4.2.3.2: parsed to be valid, then ignored
        while (peek() == ';') {
            ++at;
            while (peek() == ' ') ++at;
            if (!(lex::is_lcalpha(peek()) || peek() == '*')) return false;
            while (lex::is_lcalpha(peek()) || lex::is_digit(peek()) || peek() == '_' || peek() == '-' ||
                   peek() == '.' || peek() == '*') {
                ++at;
            }
            if (peek() == '=') {
                ++at;
                if (!parse_bare_item(nullptr)) return false;
            }
        }
        return true;
    }
};

}  // namespace

std::optional<std::string> parse_key(std::string_view field_value, KeyForm form) {
    return read_key(field_value, form).key;
}

KeyReading read_key(std::string_view field_value, KeyForm form) {
    const std::string_view value = lex::trim(field_value);
    if (value.empty()) return {std::nullopt, KeyFault::empty};
    if (value.front() == '"') {
        SfParser p{value};
        std::string key;
        if (!p.parse_string(key)) return {std::nullopt, p.string_fault};
        if (!p.parse_parameters() || !p.done()) return {std::nullopt, KeyFault::after_string};
        return {std::move(key), KeyFault::none};
    }
    if (form != KeyForm::sf_string_or_token) return {std::nullopt, KeyFault::bare};
    if (value.find(',') != std::string_view::npos) return {std::nullopt, KeyFault::comma};
    return {std::string(value), KeyFault::none};
}

std::string sf_string_of(std::string_view key) {
    if (key.empty() || key.size() > 255) return {};
    std::string out = "\"";
    for (const char c : key) {
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) return {};
        if (c == '"' || c == '\\') out += '\\';
        out += c;
    }
    out += '"';
    return out;
}

std::string key_advice(std::string_view field_value, KeyFault fault, KeyForm form, std::string_view header) {
    const std::string_view value = lex::trim(field_value);
    const std::string line = std::string(header) + ": ";
    const std::string example = line + "\"<key>\"";
    switch (fault) {
        case KeyFault::none: break;
        case KeyFault::empty: return "The header is empty; send " + example + ".";
        case KeyFault::bare: {
            if (const std::string quoted = sf_string_of(value); !quoted.empty()) {
                return "Send the key as a quoted string (an RFC 8941 sf-string): " + line + quoted;
            }
            return "Send the key as a quoted string (an RFC 8941 sf-string) of 1 to 255 printable ASCII "
                   "characters: " +
                   example;
        }
        case KeyFault::comma: {
            const std::string quoted = sf_string_of(value);
            return "A bare key cannot hold ',' (it separates the values of header lines joined into one); "
                   "to send one key holding ',', quote it: " +
                   line + (quoted.empty() ? "\"<key>\"" : quoted);
        }
        case KeyFault::unterminated: return "The quoted string has no closing quote; send " + example + ".";
        case KeyFault::bad_escape: return "Inside the quotes only \\\" and \\\\ are escapes; send " + example + ".";
        case KeyFault::not_printable_ascii:
            return form == KeyForm::sf_string_or_token
                       ? "A quoted key holds printable ASCII only (RFC 8941 sf-string); send any other UTF-8 "
                         "key without quotes: " +
                             line + "<key>"
                       : "A quoted key holds printable ASCII only (RFC 8941 sf-string); send " + example + ".";
        case KeyFault::after_string:
            return "Send only one key: nothing may follow the closing quote but ;parameters (" + example + ").";
    }
    return {};
}

}  // namespace idem::http
