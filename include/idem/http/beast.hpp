// idem/http/beast.hpp — idem/http.hpp for Boost.Beast (optional: include it only where you use
// Beast; part of the idem::asio component's headers, Boost 1.81).
//
//   http::request<http::string_body> req;                       // read by http::async_read
//   idem::Response answer = co_await idem::http::async_respond(
//       store, idem::http::beast::view(req), scope, route, handler, boost::asio::use_awaitable);
//   co_await http::async_write(socket, idem::http::beast::to_beast(answer, req), use_awaitable);
//
// (view() returns the Request by value; keep it in a variable while async_respond runs — see below.)
//
// Key bytes: Beast does not decode header values — a value is the bytes received, without the
// leading and trailing whitespace HTTP strips (an obs-fold becomes one space, as RFC 9112 allows)
// — so requests are marked exact_header_values = true:
// "k%41" and "kA" are two keys, unless the route sets key_decoding = KeyDecoding::percent, which
// reads them as the cpp-httplib adapter does (one key, "kA"). Every field line is listed in order, so two
// Idempotency-Key lines are two headers (respond() answers 400). Beast's parser itself refuses a value holding NUL or
// other control bytes, a header over its header_limit (8 KB by default) and a body over its
// body_limit (1 MB): what the server answers then is the server's (the example answers 400 / 413).
//
// Errors: view() throws only std::bad_alloc. to_beast() throws std::invalid_argument (Beast's) for
// a status over 999 or a body on a 1xx, 204 or 304 response.
//
// Thread-safety: both are pure functions of their arguments.
#pragma once

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include <string_view>

#include "idem/http.hpp"
#include "idem/response.hpp"

namespace idem::http::beast {

using request_type = boost::beast::http::request<boost::beast::http::string_body>;
using response_type = boost::beast::http::response<boost::beast::http::string_body>;

namespace detail {
inline std::string_view sv(boost::beast::string_view s) noexcept { return {s.data(), s.size()}; }
}  // namespace detail

/// A view of `req`: string_views into it, valid while `req` lives and is not modified.
[[nodiscard]] inline Request view(const request_type& req) {
    Request out;
    out.method = detail::sv(req.method_string());
    out.target = detail::sv(req.target());
    for (const auto& field : req) out.headers.push_back({detail::sv(field.name_string()), detail::sv(field.value())});
    out.body = req.body();
    out.exact_header_values = true;  // Beast keeps header values as received
    return out;
}

/// The Beast response for `response`: status, every header in order (names as given, duplicates
/// kept), the body as is. Framing is Beast's: Content-Length and Transfer-Encoding in `response`
/// are dropped and Content-Length is set from the body; `version` and `keep_alive` are the
/// request's (HTTP/1.1 keep-alive unless the client said Connection: close).
[[nodiscard]] inline response_type to_beast(const Response& response, unsigned version = 11, bool keep_alive = true) {
    response_type out;
    out.version(version);
    out.result(static_cast<unsigned>(response.status));
    for (const auto& [name, value] : response.headers) {
        const auto field = boost::beast::http::string_to_field(name);
        if (field == boost::beast::http::field::content_length ||
            field == boost::beast::http::field::transfer_encoding) {
            continue;
        }
        out.insert(name, value);
    }
    out.body() = response.body;
    out.keep_alive(keep_alive);
    out.prepare_payload();
    return out;
}

/// to_beast() answering `req`: its HTTP version and keep-alive.
[[nodiscard]] inline response_type to_beast(const Response& response, const request_type& req) {
    return to_beast(response, req.version(), req.keep_alive());
}

}  // namespace idem::http::beast
