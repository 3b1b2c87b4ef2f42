// The Idempotency-Key field value (RFC 8941 Structured Fields; parse_key in include/idem/http.hpp).
#include <string>

#include "chars.hpp"
#include "idem/http.hpp"

namespace idem::http {
namespace {

/// A cursor over one Structured Field value (RFC 8941 §4.2); every parse_* returns false on failure.
struct SfParser {
    std::string_view in;
    std::size_t at = 0;

    [[nodiscard]] bool done() const noexcept { return at >= in.size(); }
    [[nodiscard]] char peek() const noexcept { return done() ? '\0' : in[at]; }

    bool parse_string(std::string& out) {  // §4.2.5
        if (peek() != '"') return false;
        ++at;
        while (!done()) {
            const char c = in[at++];
            if (c == '\\') {
                if (done()) return false;
                const char next = in[at++];
                if (next != '"' && next != '\\') return false;
                out.push_back(next);
            } else if (c == '"') {
                return true;
            } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) {
                return false;
            } else {
                out.push_back(c);
            }
        }
        return false;  // no closing DQUOTE
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
    const std::string_view value = lex::trim(field_value);
    if (value.empty()) return std::nullopt;
    if (value.front() == '"') {
        SfParser p{value};
        std::string key;
        if (!p.parse_bare_item(&key) || !p.parse_parameters() || !p.done()) return std::nullopt;
        return key;
    }
    if (form != KeyForm::sf_string_or_token || value.find(',') != std::string_view::npos) return std::nullopt;
    return std::string(value);
}

}  // namespace idem::http
