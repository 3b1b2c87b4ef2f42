// A route's configuration checked: Route::validate and detail::route_error in
// include/idem/http.hpp. respond() asks route_error on every request, so a route nobody validated
// is refused (500) rather than served with a header name no client can send.
#include <algorithm>
#include <string>

#include "chars.hpp"
#include "idem/errors.hpp"
#include "idem/http.hpp"
#include "json.hpp"

namespace idem::http {

void Route::validate() const {
    if (auto what = detail::route_error(*this)) throw config_error(*what);
}

namespace detail {

std::optional<std::string> route_error(const Route& route) {
    const std::string_view name = route.key_header;
    if (name.empty() || !std::all_of(name.begin(), name.end(), lex::is_tchar)) {
        std::string shown;
        for (const char c : name.substr(0, 64)) {
            shown += (c >= 0x20 && c < 0x7F) ? c : '?';
        }
        return "idem::http: Route::key_header '" + shown +
               "' is not a header field name (RFC 9110 token: letters, digits and !#$%&'*+-.^_`|~, at "
               "least one)";
    }
    if (!route.body_key.empty() && !parse_json_pointer(route.body_key)) {
        return "idem::http: Route::body_key '" + route.body_key.substr(0, 64) +
               "' is not a JSON Pointer (RFC 6901: '/' before each member name or array index, '~' only as ~0 or "
               "~1)";
    }
    return std::nullopt;
}

}  // namespace detail
}  // namespace idem::http
