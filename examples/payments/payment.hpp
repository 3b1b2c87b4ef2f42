// payment.hpp — the payments example's request and response formats (no I/O here).
//
// A payment request is the JSON object {"order_id": int, "amount_cents": int > 0, "currency":
// "BRL", "card": "tok_ok"} and nothing else: no other field, no duplicate field, no float, no
// nested value. Parsing is strict so that what the fingerprint covers is exactly what the client
// sent.
//
// Response bodies are built by hand in a fixed field order: the bytes stored with the key are the
// bytes every replay returns, and the reconciler rebuilds the same bytes from the gateway's ledger.
#pragma once

#include "idem/fingerprint.hpp"
#include "idem/response.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace payments {

struct PaymentRequest {
    std::int64_t order_id = 0;
    std::int64_t amount_cents = 0;
    std::string currency;
    std::string card;
};

/// Parses and validates a request body. On failure returns nullopt and sets `error` to a short
/// human-readable reason (for the 400 body).
[[nodiscard]] std::optional<PaymentRequest> parse_payment_request(std::string_view body, std::string& error);

/// What the request says, in a fixed order, independent of JSON field order and whitespace.
[[nodiscard]] idem::Fingerprint payment_fingerprint(const PaymentRequest& request);

/// The account in "Authorization: Bearer <account>" (1..64 of [A-Za-z0-9._-]), or nullopt.
[[nodiscard]] std::optional<std::string> bearer_account(std::string_view authorization);

/// The key scope for an account's payments: "payments:acct:<account>". The fixed prefix comes first
/// so that a reconciler can select exactly this service's keys in a table shared with others.
[[nodiscard]] std::string payment_scope(std::string_view account);
/// "payments:acct:", the prefix every payment scope starts with.
[[nodiscard]] std::string_view payment_scope_prefix();
/// The account of a scope made by payment_scope(), or nullopt for any other scope.
[[nodiscard]] std::optional<std::string> account_of_scope(std::string_view scope);

/// One row of the fake gateway's ledger.
struct Charge {
    std::int64_t id = 0;
    std::string account;
    std::string idempotency_key;
    std::int64_t order_id = 0;
    std::int64_t amount_cents = 0;
    std::string currency;
    std::string card;
    std::string status;  // "captured" or "declined"
    std::string created_at;
};

/// The HTTP answer to a charge: 201 captured or 402 card_declined, with a byte-stable JSON body.
/// The request handler and the reconciler both use it, so both store the same bytes.
[[nodiscard]] idem::Response charge_response(const Charge& charge);

/// {"error": code} or {"error": code, "detail": detail}, JSON-escaped.
[[nodiscard]] std::string error_body(std::string_view code, std::string_view detail = {});

/// Whether `text` can be a PostgreSQL text value as it is: well-formed UTF-8 (no overlong forms,
/// surrogates or code points past U+10FFFF) without NUL, which libpq would cut the value at.
[[nodiscard]] bool storable_text(std::string_view text) noexcept;

/// Appends `text` to `out` as a JSON string literal (quotes included).
void append_json_string(std::string& out, std::string_view text);

}  // namespace payments
