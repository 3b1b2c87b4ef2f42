// Problem bodies (RFC 9457, application/problem+json): problem_response in include/idem/http.hpp.
#include <algorithm>
#include <cstdint>
#include <string>

#include "../utf8.hpp"
#include "idem/http.hpp"

namespace idem::http {
namespace {

/// Appends `text` as a JSON string literal; bytes that are not UTF-8 become U+FFFD.
void json_string(std::string& out, std::string_view text) {
    out += '"';
    for (std::size_t i = 0; i < text.size();) {
        const auto c = static_cast<unsigned char>(text[i]);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += text[i++];
        } else if (c < 0x20 || c == 0x7F) {
            constexpr char hex[] = "0123456789abcdef";
            out += "\\u00";
            out += hex[c >> 4];
            out += hex[c & 0xF];
            ++i;
        } else {
            char32_t cp = 0;
            const std::size_t n = idem::detail::decode_utf8(text, i, cp);
            if (n == 0) {
                out += "\xEF\xBF\xBD";
                ++i;
            } else {
                out.append(text.substr(i, n));
                i += n;
            }
        }
    }
    out += '"';
}

}  // namespace

Response problem_response(const Route& route, Problem problem, std::optional<std::chrono::seconds> retry_after) {
    Response out;
    if (route.render_problem) {
        out = route.render_problem(problem);
    } else {
        out.status = problem.status;
        std::string& body = out.body;
        body += "{\"type\":";
        json_string(body, problem.type);
        body += ",\"title\":";
        json_string(body, problem.title);
        body += ",\"status\":" + std::to_string(problem.status);
        body += ",\"detail\":";
        json_string(body, problem.detail);
        body += ",\"code\":";
        json_string(body, problem.code);
        body += '}';
        out.headers.emplace_back("Content-Type", "application/problem+json");
    }
    if (retry_after) {
        out.headers.emplace_back("Retry-After", std::to_string(std::max<std::int64_t>(1, retry_after->count())));
    }
    return out;
}

}  // namespace idem::http
