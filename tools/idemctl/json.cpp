// tools/idemctl/json.cpp — serialising Json (see json.hpp).
#include "json.hpp"

#include <fmt/format.h>

namespace idemctl {
namespace {

// RFC 8259: quote and backslash escaped, every other control character as \u00XX.
void escape_to(std::string& out, std::string_view s) {
    out += '"';
    for (const char c : s) {
        const auto byte = static_cast<unsigned char>(c);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (byte < 0x20) {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(byte));
        } else {
            out += c;
        }
    }
    out += '"';
}

} // namespace

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
            if (k > 0)
                out += ',';
            (*a)[k].dump_to(out);
        }
        out += ']';
    } else {
        const Object& o = std::get<Object>(value_);
        out += '{';
        for (std::size_t k = 0; k < o.size(); ++k) {
            if (k > 0)
                out += ',';
            escape_to(out, o[k].first);
            out += ':';
            o[k].second.dump_to(out);
        }
        out += '}';
    }
}

} // namespace idemctl
