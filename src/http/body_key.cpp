// The key read from the request body (Route::body_key, a JSON Pointer): what admit() uses when a
// request carries no key header.
#include "body_key.hpp"

#include "json.hpp"
#include "problem.hpp"

namespace idem::http {
namespace {

const char* kind_name(JsonKind kind) noexcept {
    switch (kind) {
        case JsonKind::absent: return "absent";
        case JsonKind::object: return "an object";
        case JsonKind::array: return "an array";
        case JsonKind::string: return "a string";
        case JsonKind::number: return "a number";
        case JsonKind::boolean: return "a boolean";
        case JsonKind::null: return "null";
    }
    return "not a string";
}

}  // namespace

BodyKey read_body_key(const Request& request, const Route& route) {
    BodyKey out;
    const auto pointer = parse_json_pointer(route.body_key);
    if (!pointer) return out;              // route_error refuses such a route before this is asked
    if (request.body.empty()) return out;  // no body, no member: a missing key (as canonical_json keeps it empty)
    const std::string where = "the member " + route.body_key + " of the JSON body";
    const auto member = json_member(request.body, *pointer);
    if (!member) {
        out.refusal =
            problem_response(route, route_problem(route, 400, "invalid_json_body", "The request body is not valid JSON",
                                                  "With no " + route.key_header + " header the key is " + where +
                                                      ", and the request body is not valid JSON (RFC 8259)."));
        return out;
    }
    if (member->kind == JsonKind::absent) return out;
    if (member->kind != JsonKind::string) {
        out.refusal = problem_response(
            route, route_problem(route, 400, "invalid_idempotency_key", route.key_header + " is malformed",
                                 "With no " + route.key_header + " header the key is " + where + ": it must be " +
                                     "a string, and it is " + kind_name(member->kind) + "."));
        return out;
    }
    out.key = member->string;
    return out;
}

}  // namespace idem::http
