// Problem details (RFC 9457) of idem::http's own answers (internal; problem_response in
// include/idem/http.hpp renders them).
#pragma once

#include <string>
#include <utility>

#include "idem/http.hpp"

namespace idem::http {

/// A problem the client can act on — fix the request, or retry with the same key: typed with the
/// route's problem_type (docs/http.md, "Problems", lists each code's status and title).
inline Problem route_problem(const Route& route, int status, std::string code, std::string title, std::string detail) {
    return Problem{status, route.problem_type, std::move(title), std::move(detail), std::move(code)};
}

/// The server's own fault (500 internal_error): nothing for the client to read, so about:blank
/// with the status's phrase as title (RFC 9457 §4.2.1).
inline Problem internal_problem(std::string detail) {
    return Problem{500, "about:blank", "Internal Server Error", std::move(detail), "internal_error"};
}

}  // namespace idem::http
