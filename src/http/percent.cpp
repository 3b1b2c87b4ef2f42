// Header values percent-decoded exactly as cpp-httplib 0.11 decodes them while parsing a request
// (its detail::decode_url(value, false)): percent_decode_header_value in include/idem/http.hpp, and
// the decoded view of a request that Route::key_decoding = KeyDecoding::percent reads on an adapter
// that keeps header values as sent. One function, so that every adapter reads the same key.
#include "percent.hpp"

#include <cstdint>

namespace idem::http {
namespace {

/// `count` hex digits of `in` at `at` as a number; false if any is missing or not a hex digit.
bool hex_at(std::string_view in, std::size_t at, std::size_t count, std::uint32_t& value) {
    if (at + count > in.size()) return false;
    value = 0;
    for (std::size_t i = at; i < at + count; ++i) {
        const char c = in[i];
        std::uint32_t digit = 0;
        if (c >= '0' && c <= '9') digit = static_cast<std::uint32_t>(c - '0');
        else if (c >= 'a' && c <= 'f') digit = static_cast<std::uint32_t>(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') digit = static_cast<std::uint32_t>(c - 'A' + 10);
        else return false;
        value = value * 16 + digit;
    }
    return true;
}

/// `code` (below 0x10000) as UTF-8; a surrogate (D800-DFFF) appends nothing, as cpp-httplib's
/// to_utf8 does.
void append_utf8(std::uint32_t code, std::string& out) {
    if (code < 0x80) {
        out += static_cast<char>(code);
    } else if (code < 0x800) {
        out += static_cast<char>(0xC0 | (code >> 6));
        out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0xD800 || code >= 0xE000) {
        out += static_cast<char>(0xE0 | (code >> 12));
        out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code & 0x3F));
    }
}

}  // namespace

std::string percent_decode_header_value(std::string_view value) {
    std::string out;
    out.reserve(value.size());
    for (std::size_t i = 0; i < value.size(); ++i) {
        std::uint32_t code = 0;
        if (value[i] != '%' || i + 1 >= value.size()) {
            out += value[i];  // '+' included: a header value is not a form
        } else if (value[i + 1] == 'u' && hex_at(value, i + 2, 4, code)) {
            append_utf8(code, out);  // %uXXXX
            i += 5;
        } else if (value[i + 1] != 'u' && hex_at(value, i + 1, 2, code)) {
            out += static_cast<char>(code);  // %XX, any byte
            i += 2;
        } else {
            out += '%';  // not a sequence: kept, the rest read on
        }
    }
    return out;
}

const Request& DecodedRequest::of(const Request& request) {
    values_.clear();
    values_.reserve(request.headers.size());
    for (const Header& h : request.headers) values_.push_back(percent_decode_header_value(h.value));
    view_ = request;
    for (std::size_t i = 0; i < view_.headers.size(); ++i) view_.headers[i].value = values_[i];
    view_.exact_header_values = false;  // decoded: a key holding '%' now may have been changed
    return view_;
}

}  // namespace idem::http
