// idem/http/httplib.hpp — idem/http.hpp for cpp-httplib (optional: include it only where you use
// cpp-httplib; idem itself never depends on it).
//
//   server.Post("/orders", [&](const httplib::Request& req, httplib::Response& res) {
//       idem::http::httplib::serve(store, req, res, "acct_42:POST /orders", route,
//                                  [&] { return idem::Response{201, create_order(req.body)}; });
//   });
//
// Key bytes (docs/http.md): cpp-httplib 0.11 percent-decodes every header value while parsing, so
// a key reaches idem decoded — "k%41" and "kA" are one key — and nothing in the parsed request says
// whether a decode happened. This adapter therefore marks its requests exact_header_values = false:
// respond() refuses (400) a key still holding '%' after the decode ("50%off", or "%2541" decoded to
// "%41"), but a client key with a percent-encoded triplet is silently read decoded. Keys without
// '%' (UUIDs, the draft's recommendation) are preserved exactly. NUL and other control bytes reach
// the parsed header intact (only get_header_value() stops at a NUL; this adapter never uses it), so
// "k\0x" is refused with 400, never read as "k". A route with key_decoding = KeyDecoding::percent
// reads the same keys on Beast (docs/http.md: moving a table between adapters).
//
// Thread-safety: as respond(); each call touches only its own request and response.
#pragma once

#include <httplib.h>

#include <string>
#include <string_view>
#include <utility>

#include "idem/http.hpp"

namespace idem::http::httplib {

/// A view of `req` (valid while `req` lives). Every header line is listed, duplicates kept.
[[nodiscard]] inline Request view(const ::httplib::Request& req) {
    Request out;
    out.method = req.method;
    out.target = req.target.empty() ? std::string_view(req.path) : std::string_view(req.target);
    out.headers.reserve(req.headers.size());
    for (const auto& [name, value] : req.headers) out.headers.push_back({name, value});
    out.body = req.body;
    out.exact_header_values = false;  // cpp-httplib 0.11 percent-decodes header values
    return out;
}

/// Writes `response` into `res`: status, every header, the body as is. cpp-httplib sends headers
/// sorted by name (their order is the framework's), and set_header drops one holding CR or LF;
/// respond() has already refused such a response (500), so only a hand-made one can lose a header.
inline void send(const Response& response, ::httplib::Response& res) {
    res.status = response.status;
    for (const auto& [name, value] : response.headers) res.set_header(name, value);
    res.body = response.body;
}

/// respond() for a cpp-httplib handler: view, respond, send.
template <class Handler>
void serve(IdempotencyStore& store, const ::httplib::Request& req, ::httplib::Response& res, std::string_view scope,
           const Route& route, Handler&& handler) {
    send(respond(store, view(req), scope, route, std::forward<Handler>(handler)), res);
}

}  // namespace idem::http::httplib
