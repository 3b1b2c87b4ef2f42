// Strict JSON (RFC 8259) for idem::http: the canonical form of a body, for fingerprints
// (canonical_json in include/idem/http.hpp), and the member a JSON Pointer names, for a key read
// from the body (json_member in json.hpp). One parser does both, so the two never disagree on what
// is JSON.
#include "json.hpp"

#include <cstdint>
#include <map>
#include <string>

#include "../utf8.hpp"
#include "chars.hpp"

namespace idem::http {
namespace {

/// A strict RFC 8259 parser writing the canonical form as it goes; false on anything else. Given a
/// target path (a JSON Pointer's tokens), it also tells what value is there, if any.
class JsonCanon {
public:
    explicit JsonCanon(std::string_view in, const std::vector<std::string>* target = nullptr,
                       JsonMember* found = nullptr)
        : in_(in), target_(target), found_(found) {}

    bool run(std::string& out) {
        skip_ws();
        if (!value(out, 0)) return false;
        skip_ws();
        return at_ == in_.size();
    }

private:
    static constexpr int kMaxDepth = 64;

    std::string_view in_;
    std::size_t at_ = 0;
    const std::vector<std::string>* target_;  // null: no lookup
    JsonMember* found_;
    std::vector<std::string> path_;  // the tokens leading to the value being parsed (with a target)

    [[nodiscard]] bool at_target() const { return target_ != nullptr && path_ == *target_; }

    [[nodiscard]] char peek() const noexcept { return at_ < in_.size() ? in_[at_] : '\0'; }
    void skip_ws() noexcept {
        while (at_ < in_.size() && (in_[at_] == ' ' || in_[at_] == '\t' || in_[at_] == '\n' || in_[at_] == '\r')) ++at_;
    }
    bool literal(std::string_view word, std::string& out) {
        if (in_.substr(at_, word.size()) != word) return false;
        at_ += word.size();
        out += word;
        return true;
    }

    bool value(std::string& out, int depth) {
        if (at_target()) found_->kind = kind_of(peek());
        switch (peek()) {
            case '{': return object(out, depth + 1);
            case '[': return array(out, depth + 1);
            case '"': {
                std::string s;
                if (!string(s)) return false;
                write_string(s, out);
                if (at_target()) found_->string = std::move(s);
                return true;
            }
            case 't': return literal("true", out);
            case 'f': return literal("false", out);
            case 'n': return literal("null", out);
            default: return number(out);
        }
    }

    bool object(std::string& out, int depth) {
        if (depth > kMaxDepth) return false;
        ++at_;
        std::map<std::string, std::string> members;  // sorted by the decoded name's bytes
        skip_ws();
        if (peek() == '}') {
            ++at_;
            out += "{}";
            return true;
        }
        for (;;) {
            skip_ws();
            std::string name;
            if (peek() != '"' || !string(name)) return false;
            skip_ws();
            if (peek() != ':') return false;
            ++at_;
            skip_ws();
            std::string member;
            if (target_ != nullptr) path_.push_back(name);
            if (!value(member, depth)) return false;
            if (target_ != nullptr) path_.pop_back();
            if (!members.emplace(std::move(name), std::move(member)).second) return false;  // duplicate name
            skip_ws();
            if (peek() == ',') {
                ++at_;
                continue;
            }
            if (peek() != '}') return false;
            ++at_;
            break;
        }
        out += '{';
        bool first = true;
        for (const auto& [name, member] : members) {
            if (!first) out += ',';
            first = false;
            write_string(name, out);
            out += ':';
            out += member;
        }
        out += '}';
        return true;
    }

    bool array(std::string& out, int depth) {
        if (depth > kMaxDepth) return false;
        ++at_;
        out += '[';
        skip_ws();
        if (peek() == ']') {
            ++at_;
            out += ']';
            return true;
        }
        for (std::size_t index = 0;; ++index) {
            if (index != 0) out += ',';
            skip_ws();
            if (target_ != nullptr) path_.push_back(std::to_string(index));
            if (!value(out, depth)) return false;
            if (target_ != nullptr) path_.pop_back();
            skip_ws();
            if (peek() == ',') {
                ++at_;
                continue;
            }
            if (peek() != ']') return false;
            ++at_;
            out += ']';
            return true;
        }
    }

    // Kept as written: "1.0" and "1" stay different (a false mismatch at worst, never a false match).
    bool number(std::string& out) {
        const std::size_t start = at_;
        if (peek() == '-') ++at_;
        if (peek() == '0') {
            ++at_;
        } else if (lex::is_digit(peek())) {
            while (lex::is_digit(peek())) ++at_;
        } else {
            return false;
        }
        if (peek() == '.') {
            ++at_;
            if (!lex::is_digit(peek())) return false;
            while (lex::is_digit(peek())) ++at_;
        }
        if (peek() == 'e' || peek() == 'E') {
            ++at_;
            if (peek() == '+' || peek() == '-') ++at_;
            if (!lex::is_digit(peek())) return false;
            while (lex::is_digit(peek())) ++at_;
        }
        out += in_.substr(start, at_ - start);
        return true;
    }

    bool hex4(char32_t& cp) {
        if (at_ + 4 > in_.size()) return false;
        cp = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = in_[at_++];
            cp <<= 4;
            if (lex::is_digit(c)) cp |= static_cast<char32_t>(c - '0');
            else if (c >= 'a' && c <= 'f') cp |= static_cast<char32_t>(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') cp |= static_cast<char32_t>(c - 'A' + 10);
            else return false;
        }
        return true;
    }

    static void put_utf8(char32_t cp, std::string& out) {
        if (cp < 0x80) {
            out += static_cast<char>(cp);
        } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }

    /// Decodes a string literal into UTF-8 bytes (escapes resolved); false on bad escapes, control
    /// bytes, unpaired surrogates or bytes that are not UTF-8.
    bool string(std::string& decoded) {
        ++at_;  // the opening quote
        while (at_ < in_.size()) {
            const auto c = static_cast<unsigned char>(in_[at_]);
            if (c == '"') {
                ++at_;
                return true;
            }
            if (c < 0x20) return false;
            if (c == '\\') {
                ++at_;
                const char e = peek();
                ++at_;
                switch (e) {
                    case '"': decoded += '"'; break;
                    case '\\': decoded += '\\'; break;
                    case '/': decoded += '/'; break;
                    case 'b': decoded += '\b'; break;
                    case 'f': decoded += '\f'; break;
                    case 'n': decoded += '\n'; break;
                    case 'r': decoded += '\r'; break;
                    case 't': decoded += '\t'; break;
                    case 'u': {
                        char32_t cp = 0;
                        if (!hex4(cp)) return false;
                        if (cp >= 0xDC00 && cp <= 0xDFFF) return false;  // a low surrogate first
                        if (cp >= 0xD800 && cp <= 0xDBFF) {
                            char32_t low = 0;
                            if (in_.substr(at_, 2) != "\\u") return false;
                            at_ += 2;
                            if (!hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
                            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                        }
                        put_utf8(cp, decoded);
                        break;
                    }
                    default: return false;
                }
                continue;
            }
            char32_t cp = 0;
            const std::size_t n = idem::detail::decode_utf8(in_, at_, cp);
            if (n == 0) return false;
            decoded.append(in_.substr(at_, n));
            at_ += n;
        }
        return false;
    }

    static JsonKind kind_of(char first) noexcept {
        switch (first) {
            case '{': return JsonKind::object;
            case '[': return JsonKind::array;
            case '"': return JsonKind::string;
            case 't':
            case 'f': return JsonKind::boolean;
            case 'n': return JsonKind::null;
            default: return JsonKind::number;
        }
    }

    static void write_string(std::string_view s, std::string& out) {
        out += '"';
        for (const char ch : s) {
            const auto c = static_cast<unsigned char>(ch);
            switch (ch) {
                case '"': out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\b': out += "\\b"; break;
                case '\f': out += "\\f"; break;
                case '\n': out += "\\n"; break;
                case '\r': out += "\\r"; break;
                case '\t': out += "\\t"; break;
                default:
                    if (c < 0x20) {
                        constexpr char hex[] = "0123456789abcdef";
                        out += "\\u00";
                        out += hex[c >> 4];
                        out += hex[c & 0xF];
                    } else {
                        out += ch;
                    }
            }
        }
        out += '"';
    }
};

}  // namespace

std::optional<std::string> canonical_json(std::string_view json) {
    std::string out;
    out.reserve(json.size());
    if (!JsonCanon(json).run(out)) return std::nullopt;
    return out;
}

std::optional<JsonMember> json_member(std::string_view json, const std::vector<std::string>& pointer) {
    JsonMember found;
    std::string canonical;
    if (!JsonCanon(json, &pointer, &found).run(canonical)) return std::nullopt;
    return found;
}

std::optional<std::vector<std::string>> parse_json_pointer(std::string_view pointer) {
    std::vector<std::string> tokens;
    if (pointer.empty()) return tokens;  // the whole document
    if (pointer.front() != '/') return std::nullopt;
    for (std::size_t at = 1;; ++at) {
        std::string token;
        for (; at < pointer.size() && pointer[at] != '/'; ++at) {
            if (pointer[at] != '~') {
                token += pointer[at];
                continue;
            }
            if (at + 1 >= pointer.size() || (pointer[at + 1] != '0' && pointer[at + 1] != '1')) return std::nullopt;
            token += pointer[++at] == '0' ? '~' : '/';
        }
        tokens.push_back(std::move(token));
        if (at >= pointer.size()) return tokens;
    }
}

}  // namespace idem::http
