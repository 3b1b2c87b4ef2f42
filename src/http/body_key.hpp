// The key a route reads from the request body (internal to idem::http; Route::body_key).
#pragma once

#include <optional>
#include <string>

#include "idem/http.hpp"

namespace idem::http {

/// What the body says about the key: a key, a refusal to send (400), or neither (no such member).
struct BodyKey {
    std::optional<std::string> key;   ///< the member's string, escapes resolved (not yet checked as a Key)
    std::optional<Response> refusal;  ///< invalid_json_body, or invalid_idempotency_key for a non-string
};

/// The string at route.body_key in request.body (strict JSON, json.hpp). Throws std::bad_alloc only.
[[nodiscard]] BodyKey read_body_key(const Request& request, const Route& route);

}  // namespace idem::http
