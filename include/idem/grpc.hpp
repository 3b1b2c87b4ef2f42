// idem/grpc.hpp — the idem::grpc component: idempotent unary RPCs for gRPC C++ servers.
//
// find_package(idem COMPONENTS grpc) and link idem::grpc. A Method (grpc/method.hpp) names a unary
// method and what it decides (key metadata or request field, tenant, storage policy); serve()
// (grpc/serve.hpp) runs a synchronous handler at most once per key, serve_on() does the same for
// the callback API on a worker; async_serve() (grpc/asio.hpp, included on its own: it needs the
// idem::asio component too) for the callback API over AsyncPostgresStore. docs/grpc.md has the
// outcomes and the statuses they are answered with.
#pragma once

#include "idem/grpc/method.hpp"
#include "idem/grpc/record.hpp"
#include "idem/grpc/retry_status.hpp"
#include "idem/grpc/serve.hpp"

/// \namespace idem::grpc
/// The idem::grpc component: idempotent unary RPCs for gRPC C++ servers (sync and callback APIs).
