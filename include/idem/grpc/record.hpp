// idem/grpc/record.hpp — a gRPC key's stored answer, for a Reconciler that settles one
// (component idem::grpc).
//
//   // in a resolver: the provider says the charge happened; store what the RPC would have answered
//   ChargeReply reply;
//   reply.set_charge_id(provider_id);
//   r.save(idem::grpc::stored_call(grpc::Status::OK, reply));
//
// A key of a gRPC method must be settled with a record in this form (a plain idem::Response, as
// an HTTP route stores, would be answered INTERNAL on every replay). docs/grpc.md, "Settling a key
// from a Reconciler".
#pragma once

#include <grpcpp/support/status.h>

#include "idem/grpc/detail.hpp"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace idem::grpc {

/// What a key of a gRPC method stores: status (code, message, details), the reply's bytes (OK
/// only) and trailing metadata. Saved with Reconciler resolutions' save() like any codec type.
using StoredCall = detail::StoredCall;

/// The record of an answer: `status`, `reply` serialized when the status is OK, and `trailers`.
/// Throws std::invalid_argument for a status code outside 0..16 or a trailer the handler could not
/// add (Call::add_trailing_metadata's rules): a record a replay could not send.
[[nodiscard]] StoredCall stored_call(const ::grpc::Status& status, const google::protobuf::Message& reply,
                                     Metadata trailers = {});

}  // namespace idem::grpc
