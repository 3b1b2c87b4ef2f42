// tools/idemctl/json.cpp — serialising Json (see json.hpp).
#include "json.hpp"

#include <fmt/format.h>

#include "utf8.hpp"

namespace idemctl {
namespace {

// RFC 8259: quote and backslash escaped, every other control character as \u00XX, and a byte
// that does not start a well-formed UTF-8 sequence as U+FFFD, so the document is always valid JSON
// (bytes that must be shown exactly go through set_bytes / *_base64).
void escape_to(std::string& out, std::string_view s) {
    out += '"';
    for (std::size_t i = 0; i < s.size();) {
        const char c = s[i];
        const auto byte = static_cast<unsigned char>(c);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
            ++i;
        } else if (byte < 0x20) {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(byte));
            ++i;
        } else if (byte < 0x80) {
            out += c;
            ++i;
        } else {
            char32_t cp = 0;
            const std::size_t n = idem::detail::decode_utf8(s, i, cp);
            if (n == 0) {
                out += "\\ufffd";
                ++i;
            } else {
                out.append(s.substr(i, n));
                i += n;
            }
        }
    }
    out += '"';
}

}  // namespace

Json& Json::set(std::string name, Json value) {
    std::get<Object>(value_).emplace_back(std::move(name), std::move(value));
    return *this;
}

Json& Json::push(Json value) {
    std::get<Array>(value_).push_back(std::move(value));
    return *this;
}

std::string Json::dump() const {
    std::string out;
    dump_to(out);
    return out;
}

void Json::dump_to(std::string& out) const {
    if (std::holds_alternative<std::nullptr_t>(value_)) {
        out += "null";
    } else if (const bool* b = std::get_if<bool>(&value_)) {
        out += *b ? "true" : "false";
    } else if (const std::int64_t* i = std::get_if<std::int64_t>(&value_)) {
        out += std::to_string(*i);
    } else if (const std::string* s = std::get_if<std::string>(&value_)) {
        escape_to(out, *s);
    } else if (const Array* a = std::get_if<Array>(&value_)) {
        out += '[';
        for (std::size_t k = 0; k < a->size(); ++k) {
            if (k > 0) out += ',';
            (*a)[k].dump_to(out);
        }
        out += ']';
    } else {
        const Object& o = std::get<Object>(value_);
        out += '{';
        for (std::size_t k = 0; k < o.size(); ++k) {
            if (k > 0) out += ',';
            escape_to(out, o[k].first);
            out += ':';
            o[k].second.dump_to(out);
        }
        out += '}';
    }
}

}  // namespace idemctl
