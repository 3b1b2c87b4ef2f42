#include "payment.hpp"

#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

namespace payments {
namespace {

constexpr std::string_view kScopePrefix = "payments:acct:";
constexpr std::size_t kMaxCardBytes = 64;

enum Field : unsigned { kOrderId = 1, kAmount = 2, kCurrency = 4, kCard = 8, kAll = 15 };

// A SAX handler that accepts exactly one flat object with the four fields. Building a DOM first
// would lose duplicate keys (the last one silently wins) and cost allocations for nothing.
class RequestSax {
public:
    using json = nlohmann::json;
    using number_integer_t = json::number_integer_t;
    using number_unsigned_t = json::number_unsigned_t;
    using number_float_t = json::number_float_t;
    using string_t = json::string_t;
    using binary_t = json::binary_t;

    PaymentRequest request;
    std::string error;
    unsigned seen = 0;

    bool start_object(std::size_t /*size*/) {
        if (depth_++ != 0) return fail("nested objects are not accepted");
        return true;
    }
    bool end_object() {
        --depth_;
        return true;
    }
    bool start_array(std::size_t /*size*/) {
        return fail(depth_ == 0 ? "the body must be a JSON object" : "arrays are not accepted");
    }
    bool end_array() { return true; }
    bool key(string_t& name) {
        if (name == "order_id") {
            field_ = kOrderId;
        } else if (name == "amount_cents") {
            field_ = kAmount;
        } else if (name == "currency") {
            field_ = kCurrency;
        } else if (name == "card") {
            field_ = kCard;
        } else {
            if (name.size() > 64) return fail("unknown field");
            return fail("unknown field \"" + name + "\"");
        }
        if ((seen & field_) != 0) return fail("duplicate field \"" + name + "\"");
        seen |= field_;
        return true;
    }
    bool number_integer(number_integer_t value) { return integer(value); }
    bool number_unsigned(number_unsigned_t value) {
        if (value > static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max())) {
            return wrong_type();
        }
        return integer(static_cast<std::int64_t>(value));
    }
    bool number_float(number_float_t /*value*/, const string_t& /*text*/) {
        if (depth_ == 0) return fail("the body must be a JSON object");
        return fail(std::string(name_of(field_)) + " must be an integer (money is integer cents)");
    }
    bool string(string_t& value) {
        if (depth_ == 0) return fail("the body must be a JSON object");
        if (field_ == kCurrency) {
            if (value.size() != 3 || !upper(value[0]) || !upper(value[1]) || !upper(value[2])) {
                return fail("currency must be 3 uppercase letters (ISO 4217)");
            }
            request.currency = std::move(value);
            return true;
        }
        if (field_ == kCard) {
            if (value.empty() || value.size() > kMaxCardBytes) return fail("card must be 1..64 bytes");
            for (const char c : value) {
                if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
                    return fail("card must not contain control characters");
                }
            }
            request.card = std::move(value);
            return true;
        }
        return wrong_type();
    }
    bool null() { return wrong_type(); }
    bool boolean(bool /*value*/) { return wrong_type(); }
    bool binary(binary_t& /*value*/) { return wrong_type(); }
    bool parse_error(std::size_t position, const std::string& /*token*/, const nlohmann::detail::exception& /*e*/) {
        if (error.empty()) error = "malformed JSON at byte " + std::to_string(position);
        return false;
    }

private:
    static bool upper(char c) { return c >= 'A' && c <= 'Z'; }
    static std::string_view name_of(unsigned field) {
        switch (field) {
            case kOrderId: return "order_id";
            case kAmount: return "amount_cents";
            case kCurrency: return "currency";
            case kCard: return "card";
            default: return "value";
        }
    }
    bool fail(std::string message) {
        if (error.empty()) error = std::move(message);
        return false;
    }
    bool wrong_type() {
        if (depth_ == 0) return fail("the body must be a JSON object");
        switch (field_) {
            case kOrderId: return fail("order_id must be an integer");
            case kAmount: return fail("amount_cents must be a positive integer");
            case kCurrency: return fail("currency must be a string of 3 uppercase letters");
            case kCard: return fail("card must be a string");
            default: return fail("unexpected value");
        }
    }
    bool integer(std::int64_t value) {
        if (depth_ == 0) return fail("the body must be a JSON object");
        if (field_ == kOrderId) {
            request.order_id = value;
            return true;
        }
        if (field_ == kAmount) {
            if (value <= 0) return fail("amount_cents must be a positive integer");
            request.amount_cents = value;
            return true;
        }
        return wrong_type();
    }

    int depth_ = 0;
    unsigned field_ = 0;
};

bool token_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
}

void append_int(std::string& out, std::int64_t value) { out += std::to_string(value); }

}  // namespace

std::optional<PaymentRequest> parse_payment_request(std::string_view body, std::string& error) {
    RequestSax sax;
    const bool ok =
        nlohmann::json::sax_parse(body.begin(), body.end(), &sax, nlohmann::json::input_format_t::json, true, false);
    if (!ok || !sax.error.empty()) {
        error = sax.error.empty() ? "malformed JSON" : sax.error;
        return std::nullopt;
    }
    if (sax.seen != kAll) {
        std::string missing;
        for (const auto& [bit, name] : {std::pair{kOrderId, "order_id"}, std::pair{kAmount, "amount_cents"},
                                        std::pair{kCurrency, "currency"}, std::pair{kCard, "card"}}) {
            if ((sax.seen & bit) == 0) missing += missing.empty() ? name : std::string(", ") + name;
        }
        error = "missing field(s): " + missing;
        return std::nullopt;
    }
    return std::move(sax.request);
}

idem::Fingerprint payment_fingerprint(const PaymentRequest& request) {
    return idem::fingerprint(std::string_view("payments.v1"), request.order_id, request.amount_cents, request.currency,
                             request.card);
}

std::optional<std::string> bearer_account(std::string_view authorization) {
    constexpr std::string_view scheme = "bearer ";
    if (authorization.size() <= scheme.size()) return std::nullopt;
    for (std::size_t i = 0; i < scheme.size(); ++i) {
        char c = authorization[i];
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
        if (c != scheme[i]) return std::nullopt;
    }
    std::string_view token = authorization.substr(scheme.size());
    while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
    while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
    if (token.empty() || token.size() > 64) return std::nullopt;
    for (const char c : token) {
        if (!token_char(c)) return std::nullopt;
    }
    return std::string(token);
}

std::string payment_scope(std::string_view account) {
    std::string scope;
    scope.reserve(kScopePrefix.size() + account.size());
    scope.append(kScopePrefix).append(account);
    return scope;
}

std::string_view payment_scope_prefix() { return kScopePrefix; }

std::optional<std::string> account_of_scope(std::string_view scope) {
    if (scope.size() <= kScopePrefix.size() || !scope.starts_with(kScopePrefix)) return std::nullopt;
    return std::string(scope.substr(kScopePrefix.size()));
}

idem::Response charge_response(const Charge& charge) {
    // Every field comes from the ledger row, so the reconciler rebuilds these bytes exactly.
    const bool captured = charge.status == "captured";
    std::string body;
    body.reserve(160);
    if (!captured) body += "{\"error\":\"card_declined\",";
    else body += '{';
    body += "\"payment_id\":\"pay_";
    append_int(body, charge.id);
    body += "\",\"status\":";
    append_json_string(body, charge.status);
    body += ",\"order_id\":";
    append_int(body, charge.order_id);
    body += ",\"amount_cents\":";
    append_int(body, charge.amount_cents);
    body += ",\"currency\":";
    append_json_string(body, charge.currency);
    body += '}';
    return idem::Response{captured ? 201 : 402, std::move(body), {{"Content-Type", "application/json"}}};
}

bool storable_text(std::string_view text) noexcept {
    for (std::size_t i = 0; i < text.size();) {
        const auto c = static_cast<unsigned char>(text[i]);
        if (c == 0) return false;
        if (c < 0x80) {
            ++i;
            continue;
        }
        // The length of the sequence and the range of its second byte (RFC 3629's table).
        std::size_t n = 0;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            return false;
        }
        if (text.size() - i < n) return false;
        const auto second = static_cast<unsigned char>(text[i + 1]);
        if (second < lo || second > hi) return false;
        for (std::size_t k = 2; k < n; ++k) {
            const auto next = static_cast<unsigned char>(text[i + k]);
            if (next < 0x80 || next > 0xBF) return false;
        }
        i += n;
    }
    return true;
}

void append_json_string(std::string& out, std::string_view text) {
    static constexpr char hex[] = "0123456789abcdef";
    out += '"';
    for (const char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (c < 0x20 || c == 0x7f) {
                    out += "\\u00";
                    out += hex[c >> 4];
                    out += hex[c & 0xf];
                } else {
                    out += ch;  // UTF-8 passes through; invalid UTF-8 never gets this far
                }
        }
    }
    out += '"';
}

std::string error_body(std::string_view code, std::string_view detail) {
    std::string body = "{\"error\":";
    append_json_string(body, code);
    if (!detail.empty()) {
        body += ",\"detail\":";
        append_json_string(body, detail);
    }
    body += '}';
    return body;
}

}  // namespace payments
