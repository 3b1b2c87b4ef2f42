// The Idempotency-Key header's rules (include/idem/http.hpp): key parsing (RFC 8941), the JSON
// canonical form, fingerprints, problem bodies, and outcome/exception → response.
#include "idem/http.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "utf8.hpp"

namespace idem::http {
namespace {

constexpr std::string_view kReplayed = "Idempotent-Replayed";

bool iequals(std::string_view a, std::string_view b) noexcept {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
               const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
               return lower(x) == lower(y);
           });
}

bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }
bool is_alpha(char c) noexcept { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_lcalpha(char c) noexcept { return c >= 'a' && c <= 'z'; }

// RFC 9110 tchar.
bool is_tchar(char c) noexcept {
    return is_alpha(c) || is_digit(c) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// ---------------------------------------------------------------------------- RFC 8941 parsing

/// A cursor over one Structured Field value (RFC 8941 §4.2); every parse_* returns false on failure.
struct SfParser {
    std::string_view in;
    std::size_t at = 0;

    [[nodiscard]] bool done() const noexcept { return at >= in.size(); }
    [[nodiscard]] char peek() const noexcept { return done() ? '\0' : in[at]; }

    bool parse_string(std::string& out) {  // §4.2.5
        if (peek() != '"') return false;
        ++at;
        while (!done()) {
            const char c = in[at++];
            if (c == '\\') {
                if (done()) return false;
                const char next = in[at++];
                if (next != '"' && next != '\\') return false;
                out.push_back(next);
            } else if (c == '"') {
                return true;
            } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) {
                return false;
            } else {
                out.push_back(c);
            }
        }
        return false;  // no closing DQUOTE
    }
    bool parse_number() {  // §4.2.4 (integer or decimal), value unused
        if (peek() == '-') ++at;
        std::size_t digits = 0;
        if (!is_digit(peek())) return false;
        while (is_digit(peek())) ++at, ++digits;
        if (peek() != '.') return digits <= 15;
        if (digits > 12) return false;
        ++at;
        std::size_t fraction = 0;
        while (is_digit(peek())) ++at, ++fraction;
        return fraction >= 1 && fraction <= 3;
    }
    bool parse_token() {  // §4.2.6
        if (!(is_alpha(peek()) || peek() == '*')) return false;
        ++at;
        while (is_tchar(peek()) || peek() == ':' || peek() == '/') ++at;
        return true;
    }
    bool parse_bytes() {  // §4.2.7
        ++at;
        while (is_alpha(peek()) || is_digit(peek()) || peek() == '+' || peek() == '/' || peek() == '=') ++at;
        if (peek() != ':') return false;
        ++at;
        return true;
    }
    bool parse_bare_item(std::string* string_out) {  // §4.2.3.1
        const char c = peek();
        if (c == '"') {
            std::string ignored;
            return parse_string(string_out ? *string_out : ignored);
        }
        if (string_out) return false;  // the key must be a String
        if (c == '-' || is_digit(c)) return parse_number();
        if (c == '*' || is_alpha(c)) return parse_token();
        if (c == ':') return parse_bytes();
        if (c == '?') {
            ++at;
            if (peek() != '0' && peek() != '1') return false;
            ++at;
            return true;
        }
        return false;
    }
    bool parse_parameters() {  // §4.2.3.2: parsed to be valid, then ignored
        while (peek() == ';') {
            ++at;
            while (peek() == ' ') ++at;
            if (!(is_lcalpha(peek()) || peek() == '*')) return false;
            while (is_lcalpha(peek()) || is_digit(peek()) || peek() == '_' || peek() == '-' || peek() == '.' ||
                   peek() == '*') {
                ++at;
            }
            if (peek() == '=') {
                ++at;
                if (!parse_bare_item(nullptr)) return false;
            }
        }
        return true;
    }
};

std::string_view trim(std::string_view s) noexcept {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

// ------------------------------------------------------------------------ JSON canonical form

/// A strict RFC 8259 parser writing the canonical form as it goes; false on anything else.
class JsonCanon {
public:
    explicit JsonCanon(std::string_view in) : in_(in) {}

    bool run(std::string& out) {
        skip_ws();
        if (!value(out, 0)) return false;
        skip_ws();
        return at_ == in_.size();
    }

private:
    static constexpr int kMaxDepth = 64;

    std::string_view in_;
    std::size_t at_ = 0;

    [[nodiscard]] char peek() const noexcept { return at_ < in_.size() ? in_[at_] : '\0'; }
    void skip_ws() noexcept {
        while (at_ < in_.size() && (in_[at_] == ' ' || in_[at_] == '\t' || in_[at_] == '\n' || in_[at_] == '\r')) ++at_;
    }
    bool literal(std::string_view word, std::string& out) {
        if (in_.substr(at_, word.size()) != word) return false;
        at_ += word.size();
        out += word;
        return true;
    }

    bool value(std::string& out, int depth) {
        switch (peek()) {
            case '{': return object(out, depth + 1);
            case '[': return array(out, depth + 1);
            case '"': {
                std::string s;
                if (!string(s)) return false;
                write_string(s, out);
                return true;
            }
            case 't': return literal("true", out);
            case 'f': return literal("false", out);
            case 'n': return literal("null", out);
            default: return number(out);
        }
    }

    bool object(std::string& out, int depth) {
        if (depth > kMaxDepth) return false;
        ++at_;
        std::map<std::string, std::string> members;  // sorted by the decoded name's bytes
        skip_ws();
        if (peek() == '}') {
            ++at_;
            out += "{}";
            return true;
        }
        for (;;) {
            skip_ws();
            std::string name;
            if (peek() != '"' || !string(name)) return false;
            skip_ws();
            if (peek() != ':') return false;
            ++at_;
            skip_ws();
            std::string member;
            if (!value(member, depth)) return false;
            if (!members.emplace(std::move(name), std::move(member)).second) return false;  // duplicate name
            skip_ws();
            if (peek() == ',') {
                ++at_;
                continue;
            }
            if (peek() != '}') return false;
            ++at_;
            break;
        }
        out += '{';
        bool first = true;
        for (const auto& [name, member] : members) {
            if (!first) out += ',';
            first = false;
            write_string(name, out);
            out += ':';
            out += member;
        }
        out += '}';
        return true;
    }

    bool array(std::string& out, int depth) {
        if (depth > kMaxDepth) return false;
        ++at_;
        out += '[';
        skip_ws();
        if (peek() == ']') {
            ++at_;
            out += ']';
            return true;
        }
        for (bool first = true;; first = false) {
            if (!first) out += ',';
            skip_ws();
            if (!value(out, depth)) return false;
            skip_ws();
            if (peek() == ',') {
                ++at_;
                continue;
            }
            if (peek() != ']') return false;
            ++at_;
            out += ']';
            return true;
        }
    }

    // Kept as written: "1.0" and "1" stay different (a false mismatch at worst, never a false match).
    bool number(std::string& out) {
        const std::size_t start = at_;
        if (peek() == '-') ++at_;
        if (peek() == '0') {
            ++at_;
        } else if (is_digit(peek())) {
            while (is_digit(peek())) ++at_;
        } else {
            return false;
        }
        if (peek() == '.') {
            ++at_;
            if (!is_digit(peek())) return false;
            while (is_digit(peek())) ++at_;
        }
        if (peek() == 'e' || peek() == 'E') {
            ++at_;
            if (peek() == '+' || peek() == '-') ++at_;
            if (!is_digit(peek())) return false;
            while (is_digit(peek())) ++at_;
        }
        out += in_.substr(start, at_ - start);
        return true;
    }

    bool hex4(char32_t& cp) {
        if (at_ + 4 > in_.size()) return false;
        cp = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = in_[at_++];
            cp <<= 4;
            if (is_digit(c)) cp |= static_cast<char32_t>(c - '0');
            else if (c >= 'a' && c <= 'f') cp |= static_cast<char32_t>(c - 'a' + 10);
            else if (c >= 'A' && c <= 'F') cp |= static_cast<char32_t>(c - 'A' + 10);
            else return false;
        }
        return true;
    }

    static void put_utf8(char32_t cp, std::string& out) {
        if (cp < 0x80) {
            out += static_cast<char>(cp);
        } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }

    /// Decodes a string literal into UTF-8 bytes (escapes resolved); false on bad escapes, control
    /// bytes, unpaired surrogates or bytes that are not UTF-8.
    bool string(std::string& decoded) {
        ++at_;  // the opening quote
        while (at_ < in_.size()) {
            const auto c = static_cast<unsigned char>(in_[at_]);
            if (c == '"') {
                ++at_;
                return true;
            }
            if (c < 0x20) return false;
            if (c == '\\') {
                ++at_;
                const char e = peek();
                ++at_;
                switch (e) {
                    case '"': decoded += '"'; break;
                    case '\\': decoded += '\\'; break;
                    case '/': decoded += '/'; break;
                    case 'b': decoded += '\b'; break;
                    case 'f': decoded += '\f'; break;
                    case 'n': decoded += '\n'; break;
                    case 'r': decoded += '\r'; break;
                    case 't': decoded += '\t'; break;
                    case 'u': {
                        char32_t cp = 0;
                        if (!hex4(cp)) return false;
                        if (cp >= 0xDC00 && cp <= 0xDFFF) return false;  // a low surrogate first
                        if (cp >= 0xD800 && cp <= 0xDBFF) {
                            char32_t low = 0;
                            if (in_.substr(at_, 2) != "\\u") return false;
                            at_ += 2;
                            if (!hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
                            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                        }
                        put_utf8(cp, decoded);
                        break;
                    }
                    default: return false;
                }
                continue;
            }
            char32_t cp = 0;
            const std::size_t n = idem::detail::decode_utf8(in_, at_, cp);
            if (n == 0) return false;
            decoded.append(in_.substr(at_, n));
            at_ += n;
        }
        return false;
    }

    static void write_string(std::string_view s, std::string& out) {
        out += '"';
        for (const char ch : s) {
            const auto c = static_cast<unsigned char>(ch);
            switch (ch) {
                case '"': out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\b': out += "\\b"; break;
                case '\f': out += "\\f"; break;
                case '\n': out += "\\n"; break;
                case '\r': out += "\\r"; break;
                case '\t': out += "\\t"; break;
                default:
                    if (c < 0x20) {
                        constexpr char hex[] = "0123456789abcdef";
                        out += "\\u00";
                        out += hex[c >> 4];
                        out += hex[c & 0xF];
                    } else {
                        out += ch;
                    }
            }
        }
        out += '"';
    }
};

// ------------------------------------------------------------------------------ problems

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

Problem idempotency_problem(const Route& route, int status, std::string code, std::string title, std::string detail) {
    return Problem{status, route.problem_type, std::move(title), std::move(detail), std::move(code)};
}

Problem plain_problem(int status, std::string code, std::string title, std::string detail) {
    return Problem{status, "about:blank", std::move(title), std::move(detail), std::move(code)};
}

Response in_progress(const Route& route, std::chrono::milliseconds wait) {
    return problem_response(
        route,
        idempotency_problem(route, 409, "in_progress", "A request is outstanding for this Idempotency-Key",
                            "A request with the same Idempotency-Key for the same operation is "
                            "being processed or is outstanding."),
        retry_after_seconds(wait));
}

void tell(const Route& route, const std::string& what, const Key* key) {
    if (!route.log) return;
    route.log(key ? what + " (key '" + key->value() + "' in scope '" + key->scope() + "')" : what);
}

Response replay(Response stored, const Route& route) {
    stored.headers.emplace_back(std::string(kReplayed), "true");
    detail::advertise(stored, route);
    return stored;
}

}  // namespace

// ------------------------------------------------------------------------------------- API

std::size_t Request::count(std::string_view name) const noexcept {
    return static_cast<std::size_t>(
        std::count_if(headers.begin(), headers.end(), [&](const Header& h) { return iequals(h.name, name); }));
}

std::optional<std::string_view> Request::header(std::string_view name) const noexcept {
    for (const auto& h : headers) {
        if (iequals(h.name, name)) return h.value;
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

std::optional<std::string> parse_key(std::string_view field_value, KeyForm form) {
    const std::string_view value = trim(field_value);
    if (value.empty()) return std::nullopt;
    if (value.front() == '"') {
        SfParser p{value};
        std::string key;
        if (!p.parse_bare_item(&key) || !p.parse_parameters() || !p.done()) return std::nullopt;
        return key;
    }
    if (form != KeyForm::sf_string_or_token || value.find(',') != std::string_view::npos) return std::nullopt;
    return std::string(value);
}

std::optional<std::string> canonical_json(std::string_view json) {
    std::string out;
    out.reserve(json.size());
    if (!JsonCanon(json).run(out)) return std::nullopt;
    return out;
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
            if (iequals(h.name, name)) b.add_string(h.value);
        }
    }
    return b.finish();
}

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

namespace detail {

Admission admit(const Request& request, std::string_view scope, const Route& route) {
    Admission a;
    try {
        validate_key_part(scope, "scope");
    } catch (const invalid_key& e) {
        tell(route, std::string("idem::http: bad scope: ") + e.what(), nullptr);
        a.answer = problem_response(route, plain_problem(500, "internal_error", "Internal Server Error",
                                                         "The server's idempotency scope is misconfigured."));
        return a;
    }
    const auto invalid = [&](std::string detail) {
        a.answer = problem_response(route, idempotency_problem(route, 400, "invalid_idempotency_key",
                                                               "Idempotency-Key is malformed", std::move(detail)));
        return a;
    };
    const std::size_t lines = request.count("Idempotency-Key");
    if (lines == 0) {
        if (route.key_required) a.answer = missing_key(route);
        return a;
    }
    if (lines > 1) return invalid("Send exactly one Idempotency-Key header.");
    const std::string_view raw = *request.header("Idempotency-Key");
    if (!request.exact_header_values && raw.find('%') != std::string_view::npos) {
        return invalid("This server cannot read a key holding '%' exactly; send a key without it.");
    }
    auto value = parse_key(raw, route.key_form);
    if (!value) {
        return invalid(route.key_form == KeyForm::sf_string
                           ? "Send the key as a Structured Field String: Idempotency-Key: \"<key>\"."
                           : "Send the key as \"<key>\" or as a bare value without commas.");
    }
    try {
        a.key.emplace(std::string(scope), std::move(*value));
    } catch (const invalid_key&) {
        return invalid("The key must be 1 to 255 bytes of UTF-8 without control characters.");
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
        a.answer = problem_response(
            route, plain_problem(400, "invalid_json_body", "Bad Request", "The request body is not valid JSON."));
    }
    return a;
}

static bool sendable(const Response& response) noexcept {
    const auto clean = [](std::string_view s) { return s.find_first_of(std::string_view("\r\n\0", 3)) == s.npos; };
    return std::all_of(response.headers.begin(), response.headers.end(),
                       [&](const auto& h) { return clean(h.first) && clean(h.second); });
}

Response checked(Response produced) {
    if (!sendable(produced)) throw unsendable_response{};
    return produced;
}

Response classify(const Route& route, Response produced) {
    produced = checked(std::move(produced));
    switch (route.storage(produced)) {
        case Disposition::store: break;
        case Disposition::release: throw not_performed(std::move(produced), "released by the storage policy");
        case Disposition::unknown: throw unknown_response{std::move(produced)};
    }
    return produced;
}

Response missing_key(const Route& route) {
    return problem_response(route,
                            idempotency_problem(route, 400, "missing_idempotency_key", "Idempotency-Key is missing",
                                                "This operation is idempotent and it requires correct usage of "
                                                "Idempotency Key."));
}

void advertise(Response& response, const Route& route) {
    if (route.retention_header.empty()) return;
    const auto seconds = route.claim.retention.value_or(route.advertised_retention);
    response.headers.emplace_back(route.retention_header, std::to_string(seconds.count()));
}

Response answer(Result<Response>&& result, const Route& route) {
    switch (result.outcome()) {
        case Outcome::executed: {
            Response executed = std::move(result).response();
            advertise(executed, route);
            return executed;
        }
        case Outcome::replayed: return replay(std::move(result).response(), route);
        case Outcome::in_progress: return in_progress(route, result.retry_after());
        case Outcome::mismatch: break;
    }
    return problem_response(route,
                            idempotency_problem(route, 422, "idempotency_key_reused", "Idempotency-Key is already used",
                                                "This operation is idempotent and it requires correct usage of "
                                                "Idempotency Key. Idempotency Key MUST not be reused across "
                                                "different payloads of this operation."));
}

Response answer_error(IdempotencyStore& store, const Key* key, const Route& route, bool rolled_back) {
    return answer_error_with([&store](const Key& k) { return store.read(k); }, key, route, rolled_back);
}

Response answer_error_with(const RecordReader& read, const Key* key, const Route& route, bool rolled_back) {
    const auto unavailable_503 = [&](const std::string& line, const char* code, const char* detail,
                                     std::chrono::seconds retry_after) {
        tell(route, "idem::http: " + line, key);
        return problem_response(route, plain_problem(503, code, "Service Unavailable", detail), retry_after);
    };
    const auto unknown = [&](const std::string& why) {
        return unavailable_503("outcome unknown, the key stays in progress: " + why, "outcome_unknown",
                               "The outcome of this request is not known yet; retry with the same Idempotency-Key.",
                               route.unknown_retry_after);
    };
    const auto unavailable = [&](const std::string& why) {
        return unavailable_503(why, "store_unavailable",
                               "The idempotency store is unavailable; retry with the same Idempotency-Key.",
                               route.unavailable_retry_after);
    };
    const auto internal = [&](const std::string& why) {
        tell(route, "idem::http: " + why, key);
        return problem_response(route, plain_problem(500, "internal_error", "Internal Server Error", ""));
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
                               "The request was not performed; retry with the same Idempotency-Key.",
                               route.unavailable_retry_after);
    } catch (const lease_lost& e) {
        if (key == nullptr) {
            // No claim behind the Context (Route::key_required = false and no key was sent).
            return internal(std::string("context used without a key (record_phase / extend_lease on a "
                                        "request without Idempotency-Key): ") +
                            e.what());
        }
        // Another attempt (a reconciler) owns the key now: answer what it stored, if it has.
        if (key != nullptr) {
            try {
                if (auto record = read(*key); record && record->state == RecordState::completed && record->result) {
                    return replay(codec<Response>::decode(*record->result), route);
                }
            } catch (const error& read_error) {
                tell(route, std::string("idem::http: read after lease_lost: ") + read_error.what(), key);
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
        return unavailable_503(
            std::string("cancelled, handler not called (key free): ") + e.what(), "request_cancelled",
            "The request was cancelled before it was performed; retry with the same Idempotency-Key.",
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
