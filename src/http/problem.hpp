// Problem details (RFC 9457) of idem::http's own answers (internal; problem_response in
// include/idem/http.hpp renders them).
#pragma once

#include <string>
#include <utility>

#include "idem/http.hpp"

namespace idem::http {

/// A problem about the Idempotency-Key protocol: typed with the route's problem_type.
inline Problem idempotency_problem(const Route& route, int status, std::string code, std::string title,
                                   std::string detail) {
    return Problem{status, route.problem_type, std::move(title), std::move(detail), std::move(code)};
}

/// Any other problem (a bad body, a misconfiguration, an outage): about:blank.
inline Problem plain_problem(int status, std::string code, std::string title, std::string detail) {
    return Problem{status, "about:blank", std::move(title), std::move(detail), std::move(code)};
}

}  // namespace idem::http
