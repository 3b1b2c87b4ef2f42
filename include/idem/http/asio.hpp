// idem/http/asio.hpp — idem/http.hpp for event loops: async_respond over AsyncPostgresStore
// (component idem::asio; needs Boost 1.81).
//
//   idem::Response answer = co_await idem::http::async_respond(
//       store, request, "acct_42:POST /payments", route,
//       [&]() -> boost::asio::awaitable<idem::Response> {
//           co_return idem::Response{201, co_await charge(card)};   // awaits, never blocks
//       },
//       boost::asio::use_awaitable);
//
// The asynchronous counterpart of respond() (http.hpp), rule for rule: the same admission (400s),
// the same storage policy, the same mapping of outcomes and errors to responses — the same code
// (idem::http::detail), around idem::asio::async_execute_once instead of execute_once. docs/http.md
// lists the rules. The handler:
//   * returns idem::Response, or boost::asio::awaitable<idem::Response> that the call co_awaits;
//   * takes no argument or an idem::asio::AsyncContext& (record_phase / extend_lease as awaitables);
//   * throws idem::http::not_performed to say "certainly not performed": the key is released and
//     that response is sent, not stored; anything else it throws leaves the outcome unknown (503,
//     key kept for a Reconciler).
// It runs on the store's executor (a strand), as async_execute_once's effect does, also on a
// keyless request (Route::key_required = false); whatever it waits for, it must await — a handler
// that blocks stalls the store.
//
// Completion: void(std::exception_ptr, idem::Response), on the token's associated executor. The
// exception is set only where respond() would throw: std::bad_alloc and exceptions from Route's own
// callbacks (fingerprint.custom except not_performed, render_problem, log, on_replay).
//
// Lifetimes: `request` (and the framework's request it views) and `route` must outlive the
// operation; `scope` is copied; the handler is moved (or copied) into the operation.
//
// Cancellation (the token's cancellation slot, e.g. a request deadline): before the handler started,
// the claim is released and the answer is 503 + Retry-After, code request_cancelled (nothing
// happened; the client may retry with the same key); once it has started, the cancellation reaches
// the handler's own asynchronous operations and what the handler then throws is an unknown outcome
// (503 outcome_unknown, key kept) — async_execute_once's rules.
//
// Thread-safety: may be started from any thread, any number at once; a Route is read-only in use.
#pragma once

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/asio/execute_once.hpp"
#include "idem/asio/store.hpp"
#include "idem/http.hpp"

namespace idem::http {
namespace detail {

/// The handler's response, awaited when it returns an awaitable; idem errors it throws become
/// handler_error exactly as run_handler does (the same function maps them).
template <class Handler>
boost::asio::awaitable<Response> run_async_handler(Handler& handler, idem::asio::AsyncContext& context) {
    using Effect = idem::asio::detail::async_effect<Handler>;
    static_assert(std::is_same_v<typename Effect::type, Response>,
                  "idem::http::async_respond: the handler returns idem::Response or awaitable<idem::Response>");
    std::exception_ptr failure;
    try {
        if constexpr (Effect::awaitable) {
            Response produced = co_await idem::asio::detail::invoke_async_effect(handler, context);
            co_return produced;
        } else {
            co_return idem::asio::detail::invoke_async_effect(handler, context);
        }
    } catch (...) {
        failure = std::current_exception();
    }
    co_return run_handler([&]() -> Response { std::rethrow_exception(failure); });
}

/// answer_error for an asynchronous call: what it would read after a lease_lost is read first
/// (idem::asio::detail::read_after_lease_lost).
inline boost::asio::awaitable<Response> answer_async_error(idem::asio::AsyncPostgresStore& store, const Key& key,
                                                           const Route& route, const Request& request,
                                                           std::exception_ptr failure) {
    const RecordReader read = co_await idem::asio::detail::read_after_lease_lost(store, key, failure);
    std::optional<Response> out;
    try {
        std::rethrow_exception(failure);
    } catch (...) {
        out.emplace(answer_error_with(read, &key, route, request));
    }
    co_return std::move(*out);
}

/// respond()'s steps as a coroutine on the store's executor.
template <class Handler>
boost::asio::awaitable<Response> async_respond_steps(idem::asio::AsyncPostgresStore& store, const Request& request,
                                                     std::string scope, const Route& route, Handler handler) {
    Admission admission = admit(request, scope, route);
    if (admission.answer) co_return std::move(*admission.answer);
    std::exception_ptr failure;
    if (!admission.key) {
        // No key and none required: a plain request. The context has no claim behind it: its
        // store calls answer lease_lost (500, see answer_error).
        const Key none{scope, "-"};
        idem::asio::AsyncContext context(store, none, 0, nullptr);
        std::optional<Response> plain;
        try {
            Response produced = co_await run_async_handler(handler, context);
            plain.emplace(checked(std::move(produced)));
        } catch (...) {
            failure = std::current_exception();
        }
        if (!failure) co_return std::move(*plain);
        try {
            std::rethrow_exception(failure);
        } catch (...) {
            plain.emplace(answer_error(store, nullptr, route, request));  // no key: answer_error reads nothing
        }
        co_return std::move(*plain);
    }
    std::optional<Result<Response>> result;
    try {
        result.emplace(co_await idem::asio::async_execute_once(
            store, *admission.key, *admission.fp,
            [&](idem::asio::AsyncContext& context) -> boost::asio::awaitable<Response> {
                Response produced = co_await run_async_handler(handler, context);
                co_return apply_policy(route, std::move(produced));
            },
            idem::asio::AsyncOptions{.claim = route.claim}, boost::asio::use_awaitable));
    } catch (...) {
        failure = std::current_exception();
    }
    if (failure) {
        Response refused = co_await answer_async_error(store, *admission.key, route, request, std::move(failure));
        co_return refused;
    }
    co_return answer(std::move(*result), *admission.key, route, request);
}

}  // namespace detail

/// Runs `handler` at most once for the request's key under `scope` and completes with what to send:
/// void(std::exception_ptr, idem::Response). See the header comment.
template <class Handler, class Token>
auto async_respond(idem::asio::AsyncPostgresStore& store, const Request& request, std::string_view scope,
                   const Route& route, Handler&& handler, Token&& token) {
    return boost::asio::co_spawn(store.get_executor(),
                                 detail::async_respond_steps(store, request, std::string(scope), route,
                                                             std::decay_t<Handler>(std::forward<Handler>(handler))),
                                 std::forward<Token>(token));
}

}  // namespace idem::http
