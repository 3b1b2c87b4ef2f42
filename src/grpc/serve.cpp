// idem::grpc::serve's body: execute_once around the handler, the storage policy, and the mapping of
// every outcome and error to the status sent (docs/grpc.md, "Outcome → status").
#include <google/protobuf/message.h>

#include <string>

#include "idem/grpc/serve.hpp"

namespace idem::grpc {
namespace detail {
namespace {

// The application's log function never changes an answer: whatever it throws is dropped.
void log(const Method& method, const std::string& line) noexcept {
    try {
        if (method.options().log) method.options().log(line);
    } catch (...) {
    }
}

std::string with_key(const std::string& what, const Key& key) {
    return what + " (scope '" + key.scope() + "', key '" + key.value() + "')";
}

::grpc::Status unknown(const Method& method, const Key& key, const std::string& why) {
    log(method, with_key("idem::grpc: outcome unknown, key kept in progress for the reconciler: " + why, key));
    return retry_status(::grpc::StatusCode::UNAVAILABLE,
                        "idem: the outcome of the call is not known yet; retry later with the same idempotency key",
                        method.options().unknown_retry_after);
}

::grpc::Status in_progress(std::chrono::milliseconds retry_after) {
    return retry_status(::grpc::StatusCode::ABORTED,
                        "idem: a call with this idempotency key is in progress; retry after the delay", retry_after);
}

}  // namespace

::grpc::Status internal(const Method& method, const std::string& what) {
    log(method, what);
    return {::grpc::StatusCode::INTERNAL, "idem: internal error"};
}

StoredCall settle(const Method& method, const ::grpc::Status& status, const google::protobuf::Message& reply,
                  Metadata trailers) {
    int code = static_cast<int>(status.error_code());
    if (code < 0 || code > kLastStatusCode) {
        // gRPC defines 0..16 (a client maps anything else to UNKNOWN): answered, and replayed, as
        // UNKNOWN with the handler's message, rather than stored as a record no replay can send.
        log(method, "idem::grpc: " + method.path() + " returned status code " + std::to_string(code) +
                        ", outside gRPC's 0..16: answered and stored as UNKNOWN");
        code = static_cast<int>(::grpc::StatusCode::UNKNOWN);
    }
    StoredCall call{code, status.error_message(), status.error_details(),
                    status.ok() ? reply.SerializeAsString() : std::string(), std::move(trailers)};
    Disposition disposition = Disposition::store;
    try {
        disposition = method.options().storage(
            ::grpc::Status(static_cast<::grpc::StatusCode>(code), status.error_message(), status.error_details()));
    } catch (const std::exception& e) {
        throw handler_failed(std::string("the storage policy threw: ") + e.what());
    } catch (...) {
        throw handler_failed("the storage policy threw something not derived from std::exception");
    }
    if (disposition == Disposition::release && code == 0) {
        // OK says the call was done: releasing it would let the retry run the handler again.
        log(method, "idem::grpc: the storage policy of " + method.path() + " said release for OK; stored instead");
        disposition = Disposition::store;
    }
    switch (disposition) {
        case Disposition::release: throw released_call(std::move(call));
        case Disposition::unknown: throw unknown_call{std::move(call)};
        case Disposition::store: break;
    }
    return call;
}

::grpc::Status send(::grpc::ServerContextBase& context, google::protobuf::Message& reply, const StoredCall& call,
                    bool replayed, bool parse_reply) {
    if (parse_reply) {
        reply.Clear();
        if (call.code == 0 && !reply.ParseFromString(call.reply)) {
            return {::grpc::StatusCode::INTERNAL, "idem: internal error"};
        }
    }
    for (const auto& [name, value] : call.trailers) context.AddTrailingMetadata(name, value);
    if (replayed) context.AddTrailingMetadata("idempotent-replayed", "true");
    return {static_cast<::grpc::StatusCode>(call.code), call.message, call.details};
}

::grpc::Status answer(::grpc::ServerContextBase& context, google::protobuf::Message& reply, const Method& method,
                      Result<StoredCall>&& result) {
    switch (result.outcome()) {
        case Outcome::executed: return send(context, reply, result.response(), false, false);
        case Outcome::replayed: {
            ::grpc::Status status = send(context, reply, result.response(), true, true);
            if (status.error_code() == ::grpc::StatusCode::INTERNAL && result.response().code == 0) {
                log(method, "idem::grpc: a stored reply of " + method.path() + " does not parse");
            }
            return status;
        }
        case Outcome::in_progress: return in_progress(result.retry_after());
        case Outcome::mismatch:
            return {::grpc::StatusCode::FAILED_PRECONDITION,
                    "idem: this idempotency key was already used with a different request"};
    }
    return internal(method, "idem::grpc: unknown outcome");
}

::grpc::Status answer_error(::grpc::ServerContextBase& context, google::protobuf::Message& reply, const Method& method,
                            const Key& key, std::exception_ptr failure, const RecordReader& read) {
    const MethodOptions& options = method.options();
    try {
        std::rethrow_exception(failure);
    } catch (const released_call& e) {
        return send(context, reply, e.call, false, false);  // the policy released the key
    } catch (const grpc::not_performed& e) {
        // The handler released the key with its own status. OK would tell the client the call was
        // done while a retry runs it: answered as idem::not_performed is instead.
        if (e.status().ok()) {
            log(method,
                with_key("idem::grpc: " + method.path() + " threw not_performed with OK; answered UNAVAILABLE", key));
            return retry_status(::grpc::StatusCode::UNAVAILABLE,
                                std::string("idem: the call was not performed: ") + e.what(),
                                options.unavailable_retry_after);
        }
        return e.status();
    } catch (const idem::not_performed& e) {
        return retry_status(::grpc::StatusCode::UNAVAILABLE,
                            std::string("idem: the call was not performed: ") + e.what(),
                            options.unavailable_retry_after);
    } catch (const unknown_call& e) {
        log(method, with_key("idem::grpc: the storage policy kept the key as outcome unknown (status " +
                                 std::to_string(e.call.code) + ")",
                             key));
        return send(context, reply, e.call, false, false);
    } catch (const handler_failed& e) {
        return unknown(method, key, std::string("the handler threw: ") + e.what());
    } catch (const response_not_saved& e) {
        // The effect ran: answer what it produced, unstored; the key stays in progress.
        log(method, with_key(std::string("idem::grpc: the result was not stored: ") + e.what(), key));
        if (e.encoded_result().empty()) return unknown(method, key, e.what());
        try {
            return send(context, reply, codec<StoredCall>::decode(e.encoded_result()), false, false);
        } catch (const std::exception& decode) {
            return unknown(method, key, decode.what());
        }
    } catch (const outcome_unknown& e) {
        return unknown(method, key, e.what());
    } catch (const lease_lost&) {
        // Another attempt (a reconciler) owns the key now: its stored answer, else in progress.
        const std::optional<std::string> stored = idem::detail::stored_after_lease_lost(
            read, key, [&](const std::string& line) { log(method, with_key("idem::grpc: " + line, key)); });
        if (stored) {
            try {
                return send(context, reply, codec<StoredCall>::decode(*stored), true, true);
            } catch (const corrupt_record& e) {
                return internal(method, with_key(std::string("idem::grpc: ") + e.what(), key));
            }
        }
        return in_progress(options.unavailable_retry_after);
    } catch (const store_unavailable& e) {
        log(method, with_key(std::string("idem::grpc: store unavailable, handler not run: ") + e.what(), key));
        return retry_status(::grpc::StatusCode::UNAVAILABLE,
                            "idem: the idempotency store is unavailable; the call was not run",
                            options.unavailable_retry_after);
    } catch (const call_cancelled&) {
        return {::grpc::StatusCode::CANCELLED, "idem: the call was cancelled before it ran"};
    } catch (const std::exception& e) {
        // config_error, corrupt_record (a stored record that does not decode), database_error.
        return internal(method, with_key(std::string("idem::grpc: ") + e.what(), key));
    }
}

::grpc::Status serve_unary(IdempotencyStore& store, ::grpc::ServerContextBase& context,
                           const google::protobuf::Message& request, google::protobuf::Message& reply,
                           const Method& method, const std::function<::grpc::Status(Call&)>& handler) {
    Admission admission = admit(context, request, reply, method);
    if (admission.answer) return std::move(*admission.answer);
    const Key& key = *admission.key;
    std::optional<Result<StoredCall>> result;
    try {
        result.emplace(execute_once(
            store, key, *admission.fp,
            [&](idem::Context& claim) -> StoredCall {
                Call call(context, claim);
                const ::grpc::Status status = run_handler([&] { return handler(call); });
                return settle(method, status, reply, call.take_trailing_metadata());
            },
            method.options().claim));
    } catch (...) {
        return answer_error(context, reply, method, key, std::current_exception(),
                            [&store](const Key& k) { return store.read(k); });
    }
    return answer(context, reply, method, std::move(*result));
}

}  // namespace detail
}  // namespace idem::grpc
