// idem/grpc/serve.hpp — idempotent unary RPCs on gRPC's synchronous and callback server APIs
// (component idem::grpc).
//
//   idem::grpc::Method charge_method("payments.Payments.Charge");      // once, checked
//
//   grpc::Status Charge(grpc::ServerContext* ctx, const ChargeRequest* req, ChargeReply* reply) override {
//       return idem::grpc::serve(store, *ctx, *req, *reply, charge_method, [&](idem::grpc::Call& call) {
//           reply->set_charge_id(gateway.charge(req->amount_cents(), call.key().value()));
//           return grpc::Status::OK;
//       });
//   }
//
// serve() puts idem::execute_once around the handler: the key comes from the `idempotency-key`
// metadata entry (or a request field), the scope is "<tenant>:<method path>", the fingerprint is
// the SHA-256 of the request's deterministic serialization. The handler runs at most once per key;
// its status, reply and the trailing metadata it adds through Call are stored (under the method's
// storage policy) and every repeat is answered with them plus `idempotent-replayed: true`. A
// repeat while the first call runs: ABORTED with a google.rpc.RetryInfo; another request under
// the same key: FAILED_PRECONDITION; a missing or malformed key: INVALID_ARGUMENT, nothing stored.
// docs/grpc.md has every outcome.
//
// The handler returns grpc::Status and fills the reply; it takes no argument or a Call&. It
// throws idem::grpc::not_performed(status) (or idem::not_performed) when it certainly did nothing:
// the key is released. Anything else it throws is an unknown outcome: the key stays in progress
// for a Reconciler and the call is answered UNAVAILABLE.
//
// Names: inside namespace idem, `grpc::` means idem::grpc; gRPC's own names are `::grpc::`.
//
// Thread-safety: any number of calls at once (as thread-safe as the store); the handler runs on
// the calling thread.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/execute_once.hpp"
#include "idem/grpc/detail.hpp"
#include "idem/grpc/method.hpp"
#include "idem/store.hpp"

namespace idem::grpc {

/// The trailing metadata a handler adds, and gRPC's context of its call: what Call (serve) and
/// AsyncCall (async_serve, idem/grpc/asio.hpp) share.
class CallBase {
public:
    /// gRPC's context of the call (deadline, auth context, client metadata).
    [[nodiscard]] ::grpc::ServerContextBase& server_context() noexcept { return server_; }

    /// Adds a trailing metadata entry that is sent now and stored and replayed with the status (an
    /// entry added straight to the ServerContext is sent once, never replayed). `name`: lowercase
    /// [0-9a-z_.-], not "grpc-…" nor "idempotent-replayed"; `value`: printable ASCII unless the
    /// name ends in "-bin". Throws std::invalid_argument otherwise.
    void add_trailing_metadata(std::string name, std::string value) {
        detail::check_trailer(name, value);
        trailers_.emplace_back(std::move(name), std::move(value));
    }
    /// The entries added so far.
    [[nodiscard]] const Metadata& trailing_metadata() const noexcept { return trailers_; }
    /// Moves the entries out (serve() does, once the handler returned).
    [[nodiscard]] Metadata take_trailing_metadata() noexcept { return std::move(trailers_); }

protected:
    /// Made by Call and AsyncCall for the call whose context is `server`.
    explicit CallBase(::grpc::ServerContextBase& server) noexcept : server_(server) {}

private:
    ::grpc::ServerContextBase& server_;
    Metadata trailers_{};
};

/// What a handler of serve() may know about, and do with, the call it runs for.
class Call : public CallBase {
public:
    /// Made by serve() for the handler.
    Call(::grpc::ServerContextBase& server, idem::Context& context) noexcept : CallBase(server), context_(context) {}

    /// The key this call claimed.
    [[nodiscard]] const Key& key() const noexcept { return context_.key(); }
    /// The claim: fence, recovery points, lease extension (idem::Context).
    [[nodiscard]] idem::Context& context() noexcept { return context_; }

private:
    idem::Context& context_;
};

namespace detail {

/// serve() with the handler behind a std::function: the one non-template body (src/grpc/serve.cpp).
[[nodiscard]] ::grpc::Status serve_unary(IdempotencyStore& store, ::grpc::ServerContextBase& context,
                                         const google::protobuf::Message& request, google::protobuf::Message& reply,
                                         const Method& method, const std::function<::grpc::Status(Call&)>& handler);

}  // namespace detail

/// Runs `handler` at most once for the call's key and returns the status to send (the reply and
/// trailing metadata are set on `reply` and `context`). See the top of this header.
template <class Handler>
[[nodiscard]] ::grpc::Status serve(IdempotencyStore& store, ::grpc::ServerContextBase& context,
                                   const google::protobuf::Message& request, google::protobuf::Message& reply,
                                   const Method& method, Handler&& handler) {
    static_assert(
        std::is_invocable_r_v<::grpc::Status, Handler&, Call&> || std::is_invocable_r_v<::grpc::Status, Handler&>,
        "idem::grpc::serve: the handler returns grpc::Status and takes no argument or a Call&");
    return detail::serve_unary(store, context, request, reply, method, [&](Call& call) -> ::grpc::Status {
        if constexpr (std::is_invocable_v<Handler&, Call&>) {
            return std::invoke(handler, call);
        } else {
            return std::invoke(handler);
        }
    });
}

/// The callback API with any IdempotencyStore: serve() runs as a task given to `post` (a worker
/// pool: `post(std::function<void()>)`), never on gRPC's callback thread, and the call's default
/// reactor is finished with its status. Return the result from the CallbackService method:
///
///   grpc::ServerUnaryReactor* Charge(grpc::CallbackServerContext* ctx, const ChargeRequest* req,
///                                    ChargeReply* reply) override {
///       return idem::grpc::serve_on(pool_post, store, ctx, req, reply, charge_method, handler);
///   }
///
/// The handler is moved into the task, a std::function (so it must be copyable); `store` and
/// `method` must outlive it, gRPC keeps `context`, `request` and `reply` until the reactor is
/// finished. If `post` throws, the call is finished UNAVAILABLE (nothing claimed).
template <class Post, class Request, class Reply, class Handler>
::grpc::ServerUnaryReactor* serve_on(Post&& post, IdempotencyStore& store, ::grpc::CallbackServerContext* context,
                                     const Request* request, Reply* reply, const Method& method, Handler handler) {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    try {
        std::forward<Post>(post)(std::function<void()>(
            [&store, context, request, reply, &method, reactor, handler = std::move(handler)]() mutable {
                reactor->Finish(serve(store, *context, *request, *reply, method, handler));
            }));
    } catch (const std::exception& e) {
        reactor->Finish(::grpc::Status(::grpc::StatusCode::UNAVAILABLE,
                                       std::string("idem: the call could not be queued: ") + e.what()));
    }
    return reactor;
}

}  // namespace idem::grpc
