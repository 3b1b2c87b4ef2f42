// idem/grpc/detail.hpp — the steps serve() and async_serve() share (component idem::grpc;
// internal: names in idem::grpc::detail may change without notice).
//
// One copy of the rules for both: admit() reads the key and fingerprints the request before
// anything is claimed; the handler's status goes through settle() (the storage policy); answer()
// turns execute_once's result into what is sent, answer_error() every exception. docs/grpc.md
// lists the outcomes.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/fingerprint.hpp"
#include "idem/grpc/method.hpp"
#include "idem/grpc/retry_status.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem::grpc {

/// Trailing metadata: (name, value) pairs in the order the handler added them.
using Metadata = std::vector<std::pair<std::string, std::string>>;

namespace detail {

/// What is stored for a key: the handler's status, its reply's bytes (OK only) and the trailing
/// metadata it added through its Call. Encoded by codec<StoredCall> (docs/grpc.md, "Record format").
struct StoredCall {
    int code = 0;         ///< grpc::StatusCode
    std::string message;  ///< the status message
    std::string details;  ///< the status details (grpc-status-details-bin), bytes
    std::string reply;    ///< the reply message's serialization; empty unless code is OK
    Metadata trailers{};  ///< what the handler added with Call::add_trailing_metadata
};

/// The admission of a call before anything is claimed.
struct Admission {
    std::optional<::grpc::Status> answer;  ///< set: send this (INVALID_ARGUMENT, INTERNAL) and stop
    std::optional<Key> key;
    std::optional<Fingerprint> fp;
};

/// Reads the key (metadata, else the method's key field), checks it, fingerprints the request.
[[nodiscard]] Admission admit(const ::grpc::ServerContextBase& context, const google::protobuf::Message& request,
                              const google::protobuf::Message& reply, const Method& method);

/// What is wrong with `value` as the key metadata entry `name` (1 to 255 bytes of printable ASCII:
/// gRPC's ASCII-Value), or nullopt. gRPC's C++ client refuses to send a value outside printable
/// ASCII; other clients may not.
[[nodiscard]] std::optional<std::string> metadata_key_fault(std::string_view name, std::string_view value);

/// The request's deterministic serialization (the bytes its fingerprint covers).
[[nodiscard]] std::string deterministic_bytes(const google::protobuf::Message& message);

/// Checks a trailing metadata entry the handler adds; throws std::invalid_argument.
void check_trailer(std::string_view name, std::string_view value);

/// gRPC's status codes are 0 (OK) to 16 (UNAUTHENTICATED).
inline constexpr int kLastStatusCode = 16;

/// Carries the handler's status out of execute_once when the storage policy says release (the
/// key is released: it derives from idem::not_performed).
class released_call : public idem::not_performed {
public:
    explicit released_call(StoredCall released)
        : idem::not_performed("released by the storage policy"), call(std::move(released)) {}
    StoredCall call;
};

/// Carries the handler's status out of execute_once when the storage policy says unknown (the key
/// stays in progress).
struct unknown_call {
    StoredCall call;
};

/// Anything the handler (or the storage policy) threw but not_performed and lease_lost: the outcome
/// is unknown, whatever the exception (an idem error from the handler's own calls included).
class handler_failed : public std::runtime_error {
public:
    explicit handler_failed(const std::string& what) : std::runtime_error(what) {}
};

/// The handler's status, reply and trailers after the storage policy: returned (store) or thrown
/// (released_call, unknown_call). Throws handler_failed if the policy throws.
[[nodiscard]] StoredCall settle(const Method& method, const ::grpc::Status& status,
                                const google::protobuf::Message& reply, Metadata trailers);

/// Runs the handler `f` (returning grpc::Status): not_performed and lease_lost pass, anything else
/// becomes handler_failed.
template <class F>
::grpc::Status run_handler(F&& f) {
    try {
        return std::forward<F>(f)();
    } catch (const idem::not_performed&) {
        throw;
    } catch (const lease_lost&) {
        throw;
    } catch (const std::exception& e) {
        throw handler_failed(e.what());
    } catch (...) {
        throw handler_failed("a non-standard exception");
    }
}

/// Sends `call`: trailers added to `context`, the reply parsed into `reply` (replays), the status
/// returned. `replayed` adds idempotent-replayed: true. A reply that does not parse → INTERNAL.
[[nodiscard]] ::grpc::Status send(::grpc::ServerContextBase& context, google::protobuf::Message& reply,
                                  const StoredCall& call, bool replayed, bool parse_reply);

/// What is sent for execute_once's result (the executed call's reply is already in `reply`).
[[nodiscard]] ::grpc::Status answer(::grpc::ServerContextBase& context, google::protobuf::Message& reply,
                                    const Method& method, Result<StoredCall>&& result);

/// Reads a key's record after a lease_lost (IdempotencyStore::read, or what an asynchronous
/// caller read already).
using RecordReader = idem::detail::RecordReader;

/// Maps `failure` (thrown by execute_once or the handler) to what is sent; `read` is called only
/// after a lease_lost.
[[nodiscard]] ::grpc::Status answer_error(::grpc::ServerContextBase& context, google::protobuf::Message& reply,
                                          const Method& method, const Key& key, std::exception_ptr failure,
                                          const RecordReader& read);

/// INTERNAL, logged through the method's log.
[[nodiscard]] ::grpc::Status internal(const Method& method, const std::string& what);

}  // namespace detail

}  // namespace idem::grpc

namespace idem {
template <>
/// How a gRPC call's outcome is stored: a version byte and length-prefixed fields (docs/grpc.md).
struct codec<grpc::detail::StoredCall> {
    /// The record's bytes.
    static std::string encode(const grpc::detail::StoredCall& call);
    /// Throws corrupt_record on anything but a complete version-1 record.
    static grpc::detail::StoredCall decode(std::string_view bytes);
};
}  // namespace idem
