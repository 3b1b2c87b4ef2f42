// idem/grpc/asio.hpp — idempotent unary RPCs on gRPC's callback API over AsyncPostgresStore
// (components idem::grpc and idem::asio: link both).
//
//   grpc::ServerUnaryReactor* Charge(grpc::CallbackServerContext* ctx, const ChargeRequest* req,
//                                    ChargeReply* reply) override {
//       return idem::grpc::async_serve(store, ctx, req, reply, charge_method,
//           [req, reply](idem::grpc::AsyncCall& call) -> boost::asio::awaitable<grpc::Status> {
//               reply->set_charge_id(co_await gateway.async_charge(req->amount_cents(), call.key().value()));
//               co_return grpc::Status::OK;
//           });
//   }
//
// serve() (serve.hpp) rule for rule — the same admission, storage policy and mapping of outcomes to
// statuses (idem::grpc::detail) — around idem::asio::async_execute_once instead of execute_once:
// no thread waits on the database or on the handler. The call's default reactor is finished with
// the status on the store's executor.
//
// The handler returns grpc::Status, or boost::asio::awaitable<grpc::Status> that the call
// co_awaits; it takes no argument or an AsyncCall& (its claim is an idem::asio::AsyncContext:
// record_phase and extend_lease as awaitables). It runs on the store's executor (a strand):
// whatever it waits for, it must await — a handler that blocks stalls the store. It is moved into
// the operation; the context, request, reply, store and method must outlive the call (gRPC keeps
// the first three until the reactor is finished).
//
// A client that cancels the call, or whose deadline passes, does not stop it: the handler runs to
// its end and its result is stored, so the retry with the same key gets the replay.
//
// Thread-safety: may be called from gRPC's callback threads, any number at once.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "idem/asio/execute_once.hpp"
#include "idem/asio/store.hpp"
#include "idem/grpc/detail.hpp"
#include "idem/grpc/serve.hpp"

namespace idem::grpc {

/// What a handler of async_serve() may know about, and do with, the call it runs for.
class AsyncCall : public CallBase {
public:
    /// Made by async_serve() for the handler.
    AsyncCall(::grpc::ServerContextBase& server, idem::asio::AsyncContext& context) noexcept
        : CallBase(server), context_(context) {}

    /// The key this call claimed.
    [[nodiscard]] const Key& key() const noexcept { return context_.key(); }
    /// The claim: fence, recovery points and lease extension as awaitables.
    [[nodiscard]] idem::asio::AsyncContext& context() noexcept { return context_; }

private:
    idem::asio::AsyncContext& context_;
};

namespace detail {

template <class Handler>
decltype(auto) invoke_grpc_handler(Handler& handler, AsyncCall& call) {
    if constexpr (std::is_invocable_v<Handler&, AsyncCall&>) {
        return std::invoke(handler, call);
    } else {
        return std::invoke(handler);
    }
}

/// The handler's status, awaited when it returns an awaitable; what it throws is mapped as
/// run_handler maps it (the same function).
template <class Handler>
boost::asio::awaitable<::grpc::Status> run_async_handler(Handler& handler, AsyncCall& call) {
    using Returned = std::remove_cvref_t<decltype(invoke_grpc_handler(handler, call))>;
    constexpr bool awaitable = idem::asio::detail::awaitable_value<Returned>::awaitable;
    static_assert(std::is_same_v<typename idem::asio::detail::awaitable_value<Returned>::type, ::grpc::Status>,
                  "idem::grpc::async_serve: the handler returns grpc::Status or awaitable<grpc::Status>");
    std::exception_ptr failure;
    try {
        if constexpr (awaitable) {
            ::grpc::Status status = co_await invoke_grpc_handler(handler, call);
            co_return status;
        } else {
            co_return invoke_grpc_handler(handler, call);
        }
    } catch (...) {
        failure = std::current_exception();
    }
    co_return run_handler([&]() -> ::grpc::Status { std::rethrow_exception(failure); });
}

/// async_serve()'s steps as a coroutine on the store's executor.
template <class Handler>
boost::asio::awaitable<::grpc::Status> async_serve_steps(idem::asio::AsyncPostgresStore& store,
                                                         ::grpc::ServerContextBase& context,
                                                         const google::protobuf::Message& request,
                                                         google::protobuf::Message& reply, const Method& method,
                                                         Handler handler) {
    Admission admission = admit(context, request, reply, method);
    if (admission.answer) co_return std::move(*admission.answer);
    const Key& key = *admission.key;
    std::optional<Result<StoredCall>> result;
    std::exception_ptr failure;
    try {
        result.emplace(co_await idem::asio::async_execute_once(
            store, key, *admission.fp,
            [&](idem::asio::AsyncContext& claim) -> boost::asio::awaitable<StoredCall> {
                AsyncCall call(context, claim);
                const ::grpc::Status status = co_await run_async_handler(handler, call);
                co_return settle(method, status, reply, call.take_trailing_metadata());
            },
            idem::asio::AsyncOptions{.claim = method.options().claim}, boost::asio::use_awaitable));
    } catch (...) {
        failure = std::current_exception();
    }
    if (!failure) co_return answer(context, reply, method, std::move(*result));

    // After a lease_lost the answer is the record another attempt saved: read first.
    const RecordReader read = co_await idem::asio::detail::read_after_lease_lost(store, key, failure);
    co_return answer_error(context, reply, method, key, failure, read);
}

}  // namespace detail

/// Runs `handler` at most once for the call's key on `store`'s executor and finishes the call's
/// default reactor with the status (see the top of this header). Return the result from the
/// CallbackService method.
template <class Request, class Reply, class Handler>
::grpc::ServerUnaryReactor* async_serve(idem::asio::AsyncPostgresStore& store, ::grpc::CallbackServerContext* context,
                                        const Request* request, Reply* reply, const Method& method, Handler handler) {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    boost::asio::co_spawn(
        store.get_executor(), detail::async_serve_steps(store, *context, *request, *reply, method, std::move(handler)),
        [reactor, &method](std::exception_ptr failure, ::grpc::Status status) {
            if (failure) {
                try {
                    std::rethrow_exception(failure);
                } catch (const std::exception& e) {
                    status = detail::internal(method, std::string("idem::grpc: async_serve: ") + e.what());
                } catch (...) {
                    status = detail::internal(method, "idem::grpc: async_serve: a non-standard exception");
                }
            }
            reactor->Finish(status);
        });
    return reactor;
}

}  // namespace idem::grpc
