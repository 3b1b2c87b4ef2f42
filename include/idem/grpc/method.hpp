// idem/grpc/method.hpp — what one idempotent unary gRPC method decides (component idem::grpc).
//
//   idem::grpc::Method charge("payments.Payments.Charge", {
//       .tenant = [](const grpc::ServerContextBase& ctx) { return account_of(ctx.auth_context()); },
//       .storage = idem::grpc::StoragePolicy::server_errors_unknown(),
//   });
//
// A Method is made once, where the service is built, and read by every call (serve.hpp). Its
// constructor checks the configuration and throws idem::config_error naming what is wrong: a
// method that the linked generated code does not define, a streaming method (only unary calls can
// be answered from a stored reply), a key metadata name that is not a lowercase gRPC ASCII header
// name, a key field that is not a singular string field of the request message.
//
// docs/grpc.md has every outcome and the status it is answered with.
//
// Thread-safety: a Method is immutable once made; any number of calls read it at once.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "idem/errors.hpp"
#include "idem/store.hpp"

namespace google::protobuf {
class Message;
class MethodDescriptor;
}  // namespace google::protobuf

namespace idem::grpc {

/// What the handler's status means for the key (idem::http's storage policy, for gRPC statuses).
enum class Disposition {
    store,    ///< performed: store the reply, status and trailers, and replay them to every repeat
    release,  ///< not performed: release the key (the same key may run again); nothing stored
    unknown,  ///< outcome unknown: keep the key in progress for a Reconciler; the status is sent as is
};

/// Per-method storage policy: what the handler's status means. Factories for the usual rules.
struct StoragePolicy {
    /// What a status means for the key; empty: Disposition::store for every status.
    std::function<Disposition(const ::grpc::Status&)> classify{};

    /// Every status is stored and replayed, errors included (a declined card answered
    /// FAILED_PRECONDITION stays declined on every retry). The default.
    [[nodiscard]] static StoragePolicy store_all();
    /// Every status stored except UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED and DATA_LOSS,
    /// which keep the key in progress as outcome unknown (the status is sent; a Reconciler decides).
    [[nodiscard]] static StoragePolicy server_errors_unknown();
    /// OK stored; every other status releases the key. Only for handlers whose errors certainly
    /// performed nothing.
    [[nodiscard]] static StoragePolicy success_only();

    /// The disposition of `status` under this policy.
    [[nodiscard]] Disposition operator()(const ::grpc::Status& status) const {
        return classify ? classify(status) : Disposition::store;
    }
};

/// Everything one method decides. Designated initialisers read well: {.key_field = "request_id"}.
struct MethodOptions {
    /// The metadata entry the key is read from: a lowercase gRPC ASCII header name (not "-bin").
    std::string key_metadata = "idempotency-key";
    /// The name of a singular `string` field of the request message (AIP-155's `request_id`): on a
    /// call without the key_metadata entry, the key is this field's value (empty: no key). Empty:
    /// the metadata only.
    std::string key_field{};
    /// The tenant of a call (an account from the auth context, a header set by your gateway): the
    /// key's scope is "<tenant>:<method path>". Empty function or empty string: the path alone. It
    /// must not block; an exception it throws is answered INTERNAL (logged), nothing claimed.
    std::function<std::string(const ::grpc::ServerContextBase&)> tenant{};
    StoragePolicy storage{};  ///< what each status the handler returns means for the key
    ClaimOptions claim{};     ///< lease, retention, waiting: passed to execute_once
    /// RetryInfo.retry_delay of the UNAVAILABLE answers for an unreachable store and for a handler
    /// that threw idem::not_performed.
    std::chrono::milliseconds unavailable_retry_after{1000};
    /// RetryInfo.retry_delay of the UNAVAILABLE answer for an unknown outcome.
    std::chrono::milliseconds unknown_retry_after{1000};
    /// Told one line (with the key) for every INTERNAL and every unknown outcome.
    std::function<void(std::string_view)> log{};
};

/// One unary method and its options, checked once (see the top of this header).
class Method {
public:
    /// `full_name` is the method's protobuf full name ("payments.Payments.Charge") or its gRPC path
    /// ("/payments.Payments/Charge"). Throws config_error (see the top of this header).
    explicit Method(std::string_view full_name, MethodOptions options = {});

    /// The gRPC path, "/payments.Payments/Charge": part of every key's scope.
    [[nodiscard]] const std::string& path() const noexcept { return path_; }
    /// The method's descriptor (from the generated pool).
    [[nodiscard]] const google::protobuf::MethodDescriptor& descriptor() const noexcept { return *descriptor_; }
    /// The options it was made with.
    [[nodiscard]] const MethodOptions& options() const noexcept { return options_; }

private:
    std::string path_;
    const google::protobuf::MethodDescriptor* descriptor_;
    MethodOptions options_;
};

/// Thrown by a handler: the effect certainly did not happen. The key is released and `status` (a
/// RESOURCE_EXHAUSTED rate limit, an INVALID_ARGUMENT validation error) is sent, not stored.
class not_performed : public idem::not_performed {
public:
    /// `status` is sent as is; `why` is the exception's message.
    explicit not_performed(::grpc::Status status, const std::string& why = "not performed")
        : idem::not_performed(why), status_(std::move(status)) {}
    /// The status to send.
    [[nodiscard]] const ::grpc::Status& status() const noexcept { return status_; }

private:
    ::grpc::Status status_;
};

}  // namespace idem::grpc
