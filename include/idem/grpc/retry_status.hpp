// idem/grpc/retry_status.hpp — a retryable gRPC status carrying its delay (component idem::grpc).
//
// The statuses idem answers with when a caller should come back later (ABORTED: the key is in
// progress; UNAVAILABLE: the store is away) carry a google.rpc.RetryInfo in their details, so a
// client can wait as long as the server asks. retry_status() makes the same status for a service's
// own answers. docs/grpc.md has the details' wire form.
#pragma once

#include <grpcpp/support/status.h>

#include <chrono>
#include <string>

namespace idem::grpc {

/// An ABORTED or UNAVAILABLE status whose details are a google.rpc.Status carrying a
/// google.rpc.RetryInfo with `retry_delay` (what grpc-status-details-bin holds; docs/grpc.md).
[[nodiscard]] ::grpc::Status retry_status(::grpc::StatusCode code, const std::string& message,
                                          std::chrono::milliseconds retry_delay);

}  // namespace idem::grpc
