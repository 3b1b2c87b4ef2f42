// idem/asio.hpp — the idem::asio component: idempotency for Boost.Asio event loops.
//
// find_package(idem COMPONENTS asio) and link idem::asio. AsyncPostgresStore (asio/store.hpp) keeps
// non-blocking, pipelined PostgreSQL connections on the event loop; async_execute_once
// (asio/execute_once.hpp) is execute_once with completion tokens (callbacks, use_future,
// use_awaitable) and cancellation. docs/design.md describes how a request travels.
#pragma once

#include "idem/asio/execute_once.hpp"
#include "idem/asio/store.hpp"

/// \namespace idem::asio
/// The idem::asio component: AsyncPostgresStore and async_execute_once for Boost.Asio event loops.
