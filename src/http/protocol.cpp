// The Idempotency-Key protocol of idem::http (include/idem/http.hpp): admitting a request, the
// fingerprint of a request, and an outcome or an exception as a response.
#include <algorithm>
#include <string>

#include "body_key.hpp"
#include "chars.hpp"
#include "idem/http.hpp"
#include "percent.hpp"
#include "problem.hpp"
#include "structured_field.hpp"

namespace idem::http {
namespace {

constexpr std::string_view kReplayed = "Idempotent-Replayed";

Response in_progress(const Route& route, std::chrono::milliseconds wait) {
    return problem_response(
        route,
        route_problem(route, 409, "in_progress", "A request is outstanding for this " + route.key_header,
                      "A request with the same " + route.key_header +
                          " for the same operation is being processed or is outstanding."),
        retry_after_seconds(wait));
}

void tell(const Route& route, const std::string& what, const Key* key) {
    if (!route.log) return;
    route.log(key ? what + " (key '" + key->value() + "' in scope '" + key->scope() + "')" : what);
}

bool sendable(const Response& response) noexcept {
    const auto clean = [](std::string_view s) { return s.find_first_of(std::string_view("\r\n\0", 3)) == s.npos; };
    return std::all_of(response.headers.begin(), response.headers.end(),
                       [&](const auto& h) { return clean(h.first) && clean(h.second); });
}

/// A stored response as sent to a repeat: marked replayed, the retention advertised, then what the
/// route's on_replay makes of it (a copy: the stored record is never touched).
Response replay(Response stored, const Route& route, const Request& request, const Key* key) {
    stored.headers.emplace_back(std::string(kReplayed), "true");
    detail::advertise(stored, route);
    if (route.on_replay) {
        route.on_replay(stored, request);
        if (!sendable(stored)) {
            tell(route, "idem::http: Route::on_replay left a header name or value with CR, LF or NUL: not sent", key);
            return problem_response(route, internal_problem(""));
        }
    }
    return stored;
}

}  // namespace

// ------------------------------------------------------------------------------------- API

std::size_t Request::count(std::string_view name) const noexcept {
    return static_cast<std::size_t>(
        std::count_if(headers.begin(), headers.end(), [&](const Header& h) { return lex::iequals(h.name, name); }));
}

std::optional<std::string_view> Request::header(std::string_view name) const noexcept {
    for (const auto& h : headers) {
        if (lex::iequals(h.name, name)) return h.value;
    }
    return std::nullopt;
}

StoragePolicy StoragePolicy::store_all() {
    return StoragePolicy{[](const Response&) { return Disposition::store; }};
}

StoragePolicy StoragePolicy::server_errors_unknown() {
    return StoragePolicy{[](const Response& r) { return r.status >= 500 ? Disposition::unknown : Disposition::store; }};
}

StoragePolicy StoragePolicy::success_only() {
    return StoragePolicy{[](const Response& r) {
        return r.status >= 200 && r.status < 300 ? Disposition::store : Disposition::release;
    }};
}

std::chrono::seconds retry_after_seconds(std::chrono::milliseconds wait) noexcept {
    // Rounded up without (ms + 999), which overflows for milliseconds::max().
    const auto ms = std::max<std::int64_t>(0, wait.count());
    return std::chrono::seconds(std::max<std::int64_t>(1, ms / 1000 + (ms % 1000 != 0 ? 1 : 0)));
}

std::optional<Fingerprint> fingerprint(const Request& request, const FingerprintPolicy& policy) {
    if (policy.custom) return policy.custom(request);
    FingerprintBuilder b;
    b.add_string("idem-http-1").add_string(request.method).add_string(request.target);
    if (policy.body == FingerprintPolicy::Body::canonical_json && !request.body.empty()) {
        auto canonical = canonical_json(request.body);
        if (!canonical) return std::nullopt;
        b.add_string("json").add_string(*canonical);
    } else {
        b.add_string("bytes").add_string(request.body);
    }
    for (const auto& name : policy.headers) {
        b.add_unsigned(request.count(name));
        for (const auto& h : request.headers) {
            if (lex::iequals(h.name, name)) b.add_string(h.value);
        }
    }
    return b.finish();
}

namespace detail {

Admission admit(const Request& received, std::string_view scope, const Route& route) {
    Admission a;
    // An adapter that keeps header values as sent, on a route that reads them decoded: from here
    // on, the request is what cpp-httplib's adapter gives for the same bytes.
    DecodedRequest decoded;
    const Request& request =
        route.key_decoding == KeyDecoding::percent && received.exact_header_values ? decoded.of(received) : received;
    try {
        validate_key_part(scope, "scope");
    } catch (const invalid_key& e) {
        tell(route, std::string("idem::http: bad scope: ") + e.what(), nullptr);
        a.answer = problem_response(route, internal_problem("The server's idempotency scope is misconfigured."));
        return a;
    }
    if (auto misconfigured = route_error(route)) {
        tell(route, *misconfigured, nullptr);
        a.answer = problem_response(route, internal_problem("The server's idempotency route is misconfigured."));
        return a;
    }
    const std::string& header = route.key_header;
    const auto invalid = [&](std::string detail) {
        a.answer = problem_response(
            route, route_problem(route, 400, "invalid_idempotency_key", header + " is malformed", std::move(detail)));
        return a;
    };
    const std::size_t lines = request.count(header);
    std::optional<std::string> value;
    if (lines == 0 && !route.body_key.empty()) {
        BodyKey from_body = read_body_key(request, route);
        if (from_body.refusal) {
            a.answer = std::move(from_body.refusal);
            return a;
        }
        value = std::move(from_body.key);
    }
    if (lines == 0 && !value) {
        if (route.key_required) a.answer = missing_key(route);
        return a;
    }
    if (lines > 1) return invalid("Send exactly one " + header + " header.");
    if (lines == 1) {
        const std::string_view raw = *request.header(header);
        if (!request.exact_header_values && raw.find('%') != std::string_view::npos) {
            return invalid("This server cannot read a key holding '%' exactly; send a key without it.");
        }
        KeyReading reading = read_key(raw, route.key_form);
        if (!reading.key) return invalid(key_advice(raw, reading.fault, route.key_form, header));
        value = std::move(reading.key);
    }
    try {
        a.key.emplace(std::string(scope), std::move(*value));
    } catch (const invalid_key&) {
        return invalid(lines == 1 ? "The key must be 1 to 255 bytes of UTF-8 without control characters."
                                  : "With no " + header + " header the key is the member " + route.body_key +
                                        " of the JSON body: it must be 1 to 255 bytes of UTF-8 without control "
                                        "characters.");
    }
    try {
        a.fp = fingerprint(request, route.fingerprint);
    } catch (const not_performed& rejected) {  // a custom fingerprint refusing the request
        a.key.reset();
        a.answer = rejected.response();
        return a;
    }
    if (!a.fp) {
        a.key.reset();
        a.answer =
            problem_response(route, route_problem(route, 400, "invalid_json_body", "The request body is not valid JSON",
                                                  "The request body is not valid JSON."));
    }
    return a;
}

Response checked(Response produced) {
    if (!sendable(produced)) throw unsendable_response{};
    return produced;
}

Response apply_policy(const Route& route, Response produced) {
    produced = checked(std::move(produced));
    switch (route.storage(produced)) {
        case Disposition::store: break;
        case Disposition::release: throw not_performed(std::move(produced), "released by the storage policy");
        case Disposition::unknown: throw unknown_response{std::move(produced)};
    }
    return produced;
}

Response missing_key(const Route& route) {
    std::string detail = "This operation is idempotent and it requires correct usage of Idempotency Key: send the " +
                         route.key_header + " header";
    detail +=
        route.body_key.empty() ? "." : ", or the key as the string member " + route.body_key + " of the JSON body.";
    return problem_response(route, route_problem(route, 400, "missing_idempotency_key",
                                                 route.key_header + " is missing", std::move(detail)));
}

void advertise(Response& response, const Route& route) {
    if (route.retention_header.empty()) return;
    const auto seconds = route.claim.retention.value_or(route.advertised_retention);
    response.headers.emplace_back(route.retention_header, std::to_string(seconds.count()));
}

Response answer(Result<Response>&& result, const Key& key, const Route& route, const Request& request) {
    switch (result.outcome()) {
        case Outcome::executed: {
            Response executed = std::move(result).response();
            advertise(executed, route);
            return executed;
        }
        case Outcome::replayed: return replay(std::move(result).response(), route, request, &key);
        case Outcome::in_progress: return in_progress(route, result.retry_after());
        case Outcome::mismatch: break;
    }
    return problem_response(route,
                            route_problem(route, 422, "idempotency_key_reused", route.key_header + " is already used",
                                          "This operation is idempotent and it requires correct usage of "
                                          "Idempotency Key. Idempotency Key MUST not be reused across "
                                          "different payloads of this operation."));
}

Response answer_error(IdempotencyStore& store, const Key* key, const Route& route, const Request& request,
                      bool rolled_back) {
    return answer_error_with([&store](const Key& k) { return store.read(k); }, key, route, request, rolled_back);
}

Response answer_error_with(const RecordReader& read, const Key* key, const Route& route, const Request& request,
                           bool rolled_back) {
    // `detail` ends with "retry with the same ": the route's header name completes it.
    const auto unavailable_503 = [&](const std::string& line, const char* code, const char* title, const char* detail,
                                     std::chrono::seconds retry_after) {
        tell(route, "idem::http: " + line, key);
        return problem_response(route, route_problem(route, 503, code, title, detail + route.key_header + "."),
                                retry_after);
    };
    const auto unknown = [&](const std::string& why) {
        return unavailable_503("outcome unknown, the key stays in progress: " + why, "outcome_unknown",
                               "The outcome of the request is not known yet",
                               "The outcome of this request is not known yet; retry with the same ",
                               route.unknown_retry_after);
    };
    const auto unavailable = [&](const std::string& why) {
        return unavailable_503(why, "store_unavailable", "The idempotency store is unavailable",
                               "The idempotency store is unavailable; retry with the same ",
                               route.unavailable_retry_after);
    };
    const auto internal = [&](const std::string& why) {
        tell(route, "idem::http: " + why, key);
        return problem_response(route, internal_problem(""));
    };
    try {
        throw;
    } catch (const not_performed& e) {
        // released (key) or plain (no key): sent, not stored
        if (!sendable(e.response())) return internal("not_performed carries a header with CR, LF or NUL");
        return e.response();
    } catch (const unknown_response& u) {
        tell(route,
             "idem::http: the storage policy kept a " + std::to_string(u.response.status) +
                 (rolled_back ? " as outcome unknown: rolled back, key free" : " as outcome unknown"),
             key);
        return u.response;
    } catch (const unsendable_response&) {
        const std::string why = "the handler's response has a header name or value with CR, LF or NUL: not sent";
        if (key == nullptr) return internal(why);
        if (rolled_back) return internal(why + ", rolled back, key free");
        // The effect ran: the key stays in progress for the reconciler.
        return internal(why + ", not stored, the key stays in progress (outcome unknown)");
    } catch (const handler_error& e) {
        // An idem error thrown while the handler ran (Context::record_phase, extend_lease, its own
        // idem calls): the effect may have happened, so it is not the claim's store error.
        const std::string why =
            std::string("handler threw: ") + e.what() + (e.sqlstate.empty() ? std::string() : " [" + e.sqlstate + "]");
        if (key == nullptr) return internal(why + " (no key, nothing kept)");
        if (rolled_back && e.unavailable) return unavailable(why + " (rolled back, key free)");
        if (rolled_back) return internal(why + " (rolled back, key free)");
        return unknown(why);
    } catch (const idem::not_performed& e) {
        return unavailable_503(std::string("not performed (key released): ") + e.what(), "not_performed",
                               "The request was not performed", "The request was not performed; retry with the same ",
                               route.unavailable_retry_after);
    } catch (const lease_lost& e) {
        if (key == nullptr) {
            // No claim behind the Context (Route::key_required = false and no key was sent).
            return internal("context used without a key (record_phase / extend_lease on a request without " +
                            route.key_header + "): " + e.what());
        }
        // Another attempt (a reconciler) owns the key now: answer what it stored, if it has. A
        // stored response that does not decode is reported like a failed read.
        const auto report = [&](const std::string& line) { tell(route, "idem::http: " + line, key); };
        if (const auto stored = idem::detail::stored_after_lease_lost(read, *key, report)) {
            try {
                return replay(codec<Response>::decode(*stored), route, request, key);
            } catch (const error& decode_error) {
                report(std::string("read after lease_lost: ") + decode_error.what());
            }
        }
        tell(route, std::string("idem::http: ") + e.what(), key);
        return in_progress(route, std::chrono::seconds(1));
    } catch (const response_not_saved& e) {
        if (rolled_back) return internal(std::string("rolled back, key free: ") + e.what());
        // The effect ran and returned: its response is the truth, even though it is not stored.
        tell(route, std::string("idem::http: response sent but not stored: ") + e.what(), key);
        try {
            return codec<Response>::decode(e.encoded_result());
        } catch (const error&) {
            return unknown(e.what());
        }
    } catch (const outcome_unknown& e) {
        return unknown(e.what());
    } catch (const store_unavailable& e) {
        return unavailable(std::string("store unavailable, handler not called: ") + e.what());
    } catch (const call_cancelled& e) {
        // An asynchronous call cancelled before the handler ran (idem/http/asio.hpp): nothing
        // happened and the key is free.
        return unavailable_503(std::string("cancelled, handler not called (key free): ") + e.what(),
                               "request_cancelled", "The request was cancelled",
                               "The request was cancelled before it was performed; retry with the same ",
                               route.unavailable_retry_after);
    } catch (const error& e) {
        // config_error, corrupt_record, database_error, invalid_key: no retry heals these.
        return internal(e.what() + (e.sqlstate().empty() ? std::string() : " [" + e.sqlstate() + "]"));
    } catch (const std::bad_alloc&) {
        throw;
    } catch (const std::exception& e) {
        if (key == nullptr || rolled_back) return internal(std::string("handler threw (nothing kept): ") + e.what());
        return unknown(std::string("handler threw: ") + e.what());
    } catch (...) {
        if (key == nullptr || rolled_back) return internal("handler threw a non-standard exception (nothing kept)");
        return unknown("handler threw a non-standard exception");
    }
}

}  // namespace detail
}  // namespace idem::http
