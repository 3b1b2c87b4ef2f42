// idem/http/transaction.hpp — idem/http.hpp over in-transaction mode (idem/postgres_transaction.hpp).
//
//   auto route = idem::http::Route{};
//   idem::TransactionOptions tx_options{.lock_wait = std::chrono::milliseconds(1)};  // 409 at once
//   idem::Response answer = idem::http::respond_in_transaction(store, request, scope, route,
//       [&](idem::Transaction& tx) {
//           tx.exec("INSERT INTO orders (id, cents) VALUES ($1, $2)", {id, cents});
//           return idem::Response{201, body};
//       }, tx_options);
//
// The same rules as respond() (docs/http.md) for effects that only write to the store's database:
// claim, the handler's statements and the stored response commit together. Differences:
// * the key is always required (a missing one is 400 whatever route.key_required says): there is
//   no transaction without a claim;
// * a duplicate arriving while the first transaction is open waits on its row lock
//   (PostgresOptions::lock_timeout, claim_attempts times) — unless TransactionOptions::lock_wait
//   is set, when it answers 409 + Retry-After at once: no server thread or pooled connection is
//   held by a burst of duplicates;
// * anything the handler throws rolls everything back and frees the key: http::not_performed sends
//   its response, store_unavailable (the connection lost) is 503, any other exception is 500; a response over
//   max_result_bytes is rolled back, 500; "unknown" from the storage policy rolls back too (in-transaction mode has no
//   unknown outcome) and the handler's response is sent;
// * the COMMIT's answer lost → 503 outcome_unknown: a retry with the same key learns the outcome.
//
// Thread-safety: as respond().
#pragma once

#include <functional>
#include <optional>
#include <string_view>
#include <utility>

#include "idem/http.hpp"
#include "idem/postgres_transaction.hpp"

namespace idem::http {

template <class Handler>
/// respond() in in-transaction mode: the handler's statements (through its Transaction&) and the
/// stored response commit together with the claim (see the top of this header).
[[nodiscard]] Response respond_in_transaction(PostgresStore& store, const Request& request, std::string_view scope,
                                              const Route& route, Handler&& handler,
                                              const TransactionOptions& transaction = {}) {
    detail::Admission admission = detail::admit(request, scope, route);
    if (admission.answer) return std::move(*admission.answer);
    if (!admission.key) return detail::missing_key(route);
    std::optional<Result<Response>> result;
    try {
        result.emplace(execute_once_in_transaction(
            store, *admission.key, *admission.fp,
            [&](Transaction& tx) -> Response {
                return detail::apply_policy(route, detail::run_handler([&] { return std::invoke(handler, tx); }));
            },
            route.claim, transaction));
    } catch (...) {
        return detail::answer_error(store, &*admission.key, route, request, true);
    }
    return detail::answer(std::move(*result), *admission.key, route, request);
}

}  // namespace idem::http
