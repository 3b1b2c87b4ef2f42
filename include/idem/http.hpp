// idem/http.hpp — the Idempotency-Key header's rules for any HTTP framework.
//
//   idem::http::Route orders;                                  // per route, made once
//   idem::Response answer = idem::http::respond(store, request, "acct_42:POST /orders", orders,
//                                               [&] { return idem::Response{201, create_order()}; });
//
// respond() implements draft-ietf-httpapi-idempotency-key-header-07 around execute_once: it reads
// the Idempotency-Key header (or the header Route::key_header names), fingerprints the request,
// runs the handler at most once per key and returns the response to send. docs/http.md lists every
// rule, the draft section it comes from and the test that covers it. In short:
//
//   missing key (route.key_required) → 400; malformed key, or several key header lines → 400;
//   first request → the handler's response (stored, see StoragePolicy); a repeat → the stored status
//   and body byte for byte, the same headers (in the framework's order), plus
//   `Idempotent-Replayed: true`; the key still in flight → 409 +
//   Retry-After; the key reused with another request → 422; store unreachable → 503 + Retry-After
//   (handler not called); the handler threw — an idem error included — or the storage policy threw
//   (outcome unknown, key kept for the reconciler) → 503 + Retry-After; a handler's response with
//   CR, LF or NUL in a header → 500, not stored nor sent, key kept; a misconfiguration or an
//   undecodable record → 500. Every error body is an RFC 9457
//   problem (application/problem+json) unless the route renders its own (Route::render_problem).
//
// The request is a view: Request holds string_views into the framework's request, which must
// outlive the call. An adapter fills it (idem/http/httplib.hpp for cpp-httplib; docs/http.md shows
// any other framework in ten lines).
//
// The handler returns idem::Response and may take an idem::Context& (as with execute_once). To say
// "certainly not performed" (validation failed, rate limited) it throws idem::http::not_performed
// carrying the response to send: the key is released and that response is sent, not stored.
// Anything else it throws leaves the outcome unknown: the key stays in progress until a Reconciler
// settles it, and the client gets 503.
//
// Keyless requests (route.key_required = false, no header): the handler runs plainly; a Context it
// uses has no claim behind it, so record_phase / extend_lease there answer 500.
//
// Errors: respond() throws nothing of idem's: every idem error becomes a response (Route::log hears
// of each one that is a 5xx). std::bad_alloc and exceptions from Route's own callbacks
// (fingerprint.custom — except not_performed —, render_problem, log, on_replay) propagate; a throwing storage
// policy is not one of them: the effect has run, so it is 503 outcome_unknown with the key kept.
//
// Thread-safety: respond() is as thread-safe as the store; a Route is read-only while in use.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

/// The Idempotency-Key header's rules (the IETF draft's 400 / 409 / 422, byte-identical replays)
/// for any HTTP framework; adapters in idem/http/.
namespace idem::http {

/// One header field line as received. Names compare case-insensitively.
struct Header {
    std::string_view name{};   ///< field name as sent
    std::string_view value{};  ///< field value as sent
};

/// A framework-neutral view of a request. Every field line is listed, in order, duplicates kept.
struct Request {
    std::string_view method{};      ///< e.g. "POST"
    std::string_view target{};      ///< request target as sent: path and query
    std::vector<Header> headers{};  ///< every field line, in order
    std::string_view body{};        ///< body bytes
    /// False when the adapter cannot see header values as sent (cpp-httplib 0.11 percent-decodes
    /// them): a key holding '%' is then refused with 400, since a decode may have changed it.
    bool exact_header_values = true;

    /// How many field lines carry `name`.
    [[nodiscard]] std::size_t count(std::string_view name) const noexcept;
    /// The first field line's value for `name`.
    [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const noexcept;
};

/// What the request fingerprint covers (a reused key with another fingerprint gets 422).
/// Default: method, target and body bytes.
struct FingerprintPolicy {
    /// How the body enters the fingerprint.
    enum class Body {
        bytes,           ///< the body as sent
        canonical_json,  ///< RFC 8259 JSON, object members sorted, insignificant whitespace dropped;
                         ///< an empty body stays empty; anything not strict JSON (or duplicate
                         ///< member names, nesting over 64) → 400 before the key is claimed
    };
    Body body = Body::bytes;  ///< how the body is covered
    /// Header fields covered too (every line of each, in order; a missing header differs from an
    /// empty one).
    std::vector<std::string> headers{};
    /// When set, replaces all of the above. It may validate the request: throwing
    /// idem::http::not_performed sends its response (a 400) and claims nothing; any other
    /// exception propagates out of respond().
    std::function<Fingerprint(const Request&)> custom{};
};

/// Which forms of the key header's value a route accepts (docs/http.md, "Key forms", says why the
/// default accepts both).
enum class KeyForm {
    sf_string,           ///< only the draft's form: a Structured Field String, `"abc"` (RFC 8941 §3.3.3)
    sf_string_or_token,  ///< (default) also the bare value Stripe-style clients send: `abc` (no DQUOTE
                         ///< first, no ',' — a comma means two lines were folded into one); `"abc"`
                         ///< and `abc` are one key
};

/// How a route reads the bytes of the header values (docs/http.md, "Adapters, and which preserve
/// key bytes exactly").
enum class KeyDecoding {
    none,     ///< as the adapter gives them: Beast as sent, cpp-httplib 0.11 percent-decoded by it
    percent,  ///< percent-decoded as cpp-httplib 0.11 decodes them (percent_decode_header_value), on
              ///< every adapter: the same bytes are the same key whichever adapter reads them; a key
              ///< still holding '%' after the decode is refused (400), as on cpp-httplib
};

/// What the handler's response means for the key.
enum class Disposition {
    store,    ///< performed: store it and replay it to every repeat
    release,  ///< not performed: release the key (the same key may run again); response not stored
    unknown,  ///< outcome unknown: keep the key in progress for the reconciler; response sent as is
};

/// Per-route storage policy: what a response's status means. Factories for the usual rules.
struct StoragePolicy {
    /// What a response means for the key; empty: Disposition::store for every response.
    std::function<Disposition(const Response&)> classify{};

    /// Stripe's rule (the default): every response is stored and replayed, 402 and 5xx included.
    [[nodiscard]] static StoragePolicy store_all();
    /// Every response stored except 5xx, kept as outcome unknown for the reconciler.
    [[nodiscard]] static StoragePolicy server_errors_unknown();
    /// Checkout.com's rule: 2xx stored, every other response releases the key. Only for handlers
    /// whose non-2xx answers certainly performed nothing.
    [[nodiscard]] static StoragePolicy success_only();

    /// The disposition of `response` under this policy.
    [[nodiscard]] Disposition operator()(const Response& response) const {
        return classify ? classify(response) : Disposition::store;
    }
};

/// An error answer before rendering (RFC 9457 members plus a short machine code).
struct Problem {
    int status = 500;      ///< HTTP status of the answer
    std::string type{};    ///< a URI; "about:blank" when only the status matters
    std::string title{};   ///< a short, human-readable summary
    std::string detail{};  ///< what happened in this case, for the client
    std::string code{};    ///< e.g. "idempotency_key_missing", stable (docs/http.md lists them)
};

/// Everything one route decides. Designated initialisers read well: Route{.key_required = false}.
/// validate() checks a route once, at configuration; respond() checks it again on every request
/// and answers a misconfigured route with 500 (logged), never reading another header.
struct Route {
    FingerprintPolicy fingerprint{};  ///< what the request fingerprint covers
    /// The header the key is read from, e.g. "X-Idempotency-Key": an RFC 9110 field name (a token),
    /// compared case-insensitively. The problems the route answers name it.
    std::string key_header = "Idempotency-Key";
    /// Which forms of the key header's value are accepted: quoted and bare by default.
    KeyForm key_form = KeyForm::sf_string_or_token;
    /// How header values are read: as the adapter gives them (default), or percent-decoded as
    /// cpp-httplib 0.11 does, so that Beast and cpp-httplib read the same key (and fingerprint the
    /// same header values) from the same bytes.
    KeyDecoding key_decoding = KeyDecoding::none;
    /// A JSON Pointer (RFC 6901) into the request body, e.g. "/order_id": on a request without the
    /// key header, the key is the string this member of the (strict, RFC 8259) JSON body holds; a
    /// header, when sent, is the key and the body is not read for one. A body that is not JSON → 400
    /// invalid_json_body; a member that is not a string → 400 invalid_idempotency_key; no such
    /// member: no key (see key_required). Empty: the header only.
    std::string body_key{};
    /// No key (no header, nor body_key's member): 400 when true; when false the handler just runs,
    /// without idempotency.
    bool key_required = true;
    StoragePolicy storage{};  ///< what each response status means for the key
    /// Lease, retention (per route) and waiting instead of 409 — passed to execute_once.
    ClaimOptions claim{};
    /// When not empty, executed and replayed responses carry this header with the retention in
    /// seconds (claim.retention, else `advertised_retention`).
    std::string retention_header{};
    /// The retention retention_header states when claim.retention is not set.
    std::chrono::seconds advertised_retention{std::chrono::hours(24)};
    /// Called on every replay — a repeat answered with a stored response; never on the first
    /// execution, a 409 or a 422 — with the response about to be sent (the stored one plus
    /// Idempotent-Replayed and the retention header) and the request. It may change that response
    /// (add a header, 201 → 200): it is a copy, the stored record is never touched. It runs where
    /// the answer is made (async_respond: on the store's executor, so it must not block). A header
    /// it leaves with CR, LF or NUL → 500, not sent; an exception it throws propagates.
    std::function<void(Response& replayed, const Request& request)> on_replay{};
    /// Retry-After of a 503 for an unreachable store, and of a 503 for an unknown outcome (sent as
    /// at least 1).
    std::chrono::seconds unavailable_retry_after{1};
    std::chrono::seconds unknown_retry_after{1};  ///< Retry-After of the 503 for an unknown outcome
    /// The "type" of every problem the client can act on (each 400, 409, 422 and 503 idem::http
    /// answers; a 500 is about:blank): a link to the documentation of the API's idempotency rules.
    std::string problem_type = "https://datatracker.ietf.org/doc/html/draft-ietf-httpapi-idempotency-key-header-07";
    /// Renders a problem; empty: application/problem+json. Retry-After is added afterwards.
    std::function<Response(const Problem&)> render_problem{};
    /// Told one line for each 5xx answer made from an error (what happened, with the key).
    std::function<void(std::string_view)> log{};

    /// Throws idem::config_error saying what is wrong with this route (key_header not a token,
    /// body_key not a JSON Pointer).
    void validate() const;
};

/// Thrown by a handler: the effect certainly did not happen. The key is released and `response`
/// (a 429, a validation 400, ...) is sent without being stored.
class not_performed : public idem::not_performed {
public:
    /// `response` is sent as is (not stored); `why` is the exception's message.
    explicit not_performed(Response response, const std::string& why = "not performed")
        : idem::not_performed(why), response_(std::move(response)) {}
    /// The response to send.
    [[nodiscard]] const Response& response() const noexcept { return response_; }

private:
    Response response_;
};

/// Whole seconds for Retry-After: `wait` rounded up, at least 1.
[[nodiscard]] std::chrono::seconds retry_after_seconds(std::chrono::milliseconds wait) noexcept;

/// Parses an Idempotency-Key field value; nullopt if it is not of `form` (RFC 8941 String, with any
/// parameters ignored, or a bare value). Does not check idem::Key's rules.
[[nodiscard]] std::optional<std::string> parse_key(std::string_view field_value, KeyForm form);

/// `value` percent-decoded exactly as cpp-httplib 0.11 decodes every request header value: %XX (hex
/// digits in either case) is that byte, %uXXXX that code point in UTF-8 (a surrogate, D800-DFFF,
/// becomes nothing), and any other '%' and every other byte ('+' included) stays as is. The result
/// may hold any byte (NUL included); the key's own rules refuse what a key cannot hold.
[[nodiscard]] std::string percent_decode_header_value(std::string_view value);

/// The canonical form of a JSON text (see FingerprintPolicy::Body::canonical_json); nullopt if
/// `json` is not strict RFC 8259 JSON.
[[nodiscard]] std::optional<std::string> canonical_json(std::string_view json);

/// The fingerprint `policy` gives `request`; nullopt when the body is not the JSON it asks for.
[[nodiscard]] std::optional<Fingerprint> fingerprint(const Request& request, const FingerprintPolicy& policy);

/// The response for a problem, as `route` renders it (problem+json by default).
[[nodiscard]] Response problem_response(const Route& route, Problem problem,
                                        std::optional<std::chrono::seconds> retry_after = std::nullopt);

namespace detail {

/// The route's verdict on a request before anything is claimed.
struct Admission {
    std::optional<Response> answer;  ///< set: send this (400, 500) and stop
    std::optional<Key> key;          ///< empty with no answer: no key, run without idempotency
    std::optional<Fingerprint> fp;
};
[[nodiscard]] Admission admit(const Request& request, std::string_view scope, const Route& route);
/// The 400 for a request without the route's key header.
[[nodiscard]] Response missing_key(const Route& route);
/// What is wrong with `route`'s configuration (Route::validate's message), or nullopt.
[[nodiscard]] std::optional<std::string> route_error(const Route& route);

/// Carries a response the storage policy called "unknown" out of execute_once (key kept).
struct unknown_response {
    Response response;
};

/// A handler's response with CR, LF or NUL in a header name or value: never stored nor sent.
struct unsendable_response {};

/// An idem error (other than lease_lost) thrown while the handler ran — by Context::record_phase,
/// extend_lease or the handler's own idem calls. The effect may have happened: it is mapped like
/// an unknown outcome (rolled back in in-transaction mode), never like a failed claim.
class handler_error : public std::runtime_error {
public:
    explicit handler_error(const error& e)
        : std::runtime_error(e.what()),
          sqlstate(e.sqlstate()),
          unavailable(dynamic_cast<const store_unavailable*>(&e) != nullptr) {}
    std::string sqlstate;
    bool unavailable;
};

/// Runs the handler `f`, turning the idem errors it throws into handler_error.
template <class F>
decltype(auto) run_handler(F&& f) {
    try {
        return std::forward<F>(f)();
    } catch (const lease_lost&) {
        throw;
    } catch (const error& e) {
        throw handler_error(e);
    }
}

/// The response as is; throws unsendable_response when a header holds CR, LF or NUL.
[[nodiscard]] Response checked(Response produced);

/// The storage policy's verdict on a handler's response: returns it (store) or throws (release:
/// not_performed; unknown: unknown_response).
[[nodiscard]] Response apply_policy(const Route& route, Response produced);

/// The response for execute_once's result; a replay goes through route.on_replay with `request`.
[[nodiscard]] Response answer(Result<Response>&& result, const Key& key, const Route& route, const Request& request);
/// Maps the exception in flight (std::current_exception) to a response; `key` may be null.
/// `rolled_back`: in-transaction mode, where an exception means the effect was rolled back.
[[nodiscard]] Response answer_error(IdempotencyStore& store, const Key* key, const Route& route, const Request& request,
                                    bool rolled_back = false);
/// answer_error with `read` in place of store.read — the one look at the store it makes (after a
/// lease_lost, for the answer another attempt saved). An asynchronous caller reads first, then
/// answers with what it read (idem/http/asio.hpp).
using RecordReader = idem::detail::RecordReader;
[[nodiscard]] Response answer_error_with(const RecordReader& read, const Key* key, const Route& route,
                                         const Request& request, bool rolled_back = false);
/// Adds the retention header to an executed / replayed response when the route asks for it.
void advertise(Response& response, const Route& route);

}  // namespace detail

/// Runs `handler` at most once for the request's key under `scope` and returns what to send.
/// `scope` is the key's scope (tenant + route, e.g. "acct_42:POST /orders"); an invalid scope is
/// a programming error answered 500.
template <class Handler>
[[nodiscard]] Response respond(IdempotencyStore& store, const Request& request, std::string_view scope,
                               const Route& route, Handler&& handler) {
    detail::Admission admission = detail::admit(request, scope, route);
    if (admission.answer) return std::move(*admission.answer);
    if (!admission.key) {
        // No key and none required: a plain request.
        try {
            return detail::checked(detail::run_handler([&] {
                if constexpr (std::is_invocable_v<Handler&>) {
                    return std::invoke(handler);
                } else {
                    // No claim: the context's store calls answer lease_lost (500, see answer_error).
                    const Key none{std::string(scope), "-"};
                    Context context(store, none, 0, nullptr);
                    return std::invoke(handler, context);
                }
            }));
        } catch (...) {
            return detail::answer_error(store, nullptr, route, request);
        }
    }
    std::optional<Result<Response>> result;
    try {
        result.emplace(execute_once(
            store, *admission.key, *admission.fp,
            [&](Context& context) -> Response {
                return detail::apply_policy(
                    route, detail::run_handler([&] { return idem::detail::invoke_effect(handler, context); }));
            },
            route.claim));
    } catch (...) {
        return detail::answer_error(store, &*admission.key, route, request);
    }
    return detail::answer(std::move(*result), *admission.key, route, request);
}

}  // namespace idem::http
