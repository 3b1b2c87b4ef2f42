// async_gateway.hpp — the fake card gateway and the rate limiter for an event loop: the ledger,
// statements and outcomes of gateway.hpp, on non-blocking libpq connections an Asio executor
// watches, so no thread waits for the database.
//
// Not part of idem. Thread-safety: none. Every member must be called from coroutines on the one
// executor given to the pool (a strand, or an io_context one thread runs); the pool's state is
// touched only there. Connections are opened (a blocking libpq connect and the statements'
// PREPAREs) on a thread of the pool's own, so the event loop never waits for a connect either.
#pragma once

#include "gateway.hpp"

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/thread_pool.hpp>

#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace payments {

/// A statement was sent and the connection broke before its answer came: it may have run.
class DbOutcomeUnknown : public DbError {
public:
    using DbError::DbError;
};

using PgResultPtr = std::unique_ptr<PGresult, decltype(&PQclear)>;

/// Up to `size` gateway connections (open_gateway_connection), opened on first need, one
/// statement at a time each.
class AsyncPgPool {
public:
    AsyncPgPool(boost::asio::any_io_executor executor, std::string conninfo, std::size_t size,
                std::chrono::milliseconds statement_timeout, std::chrono::milliseconds wait = std::chrono::seconds(5));
    ~AsyncPgPool();
    AsyncPgPool(const AsyncPgPool&) = delete;
    AsyncPgPool& operator=(const AsyncPgPool&) = delete;

    /// Runs prepared statement `name` and returns its result (status `expect`); not sent at all
    /// once `not_after` has passed when a connection is in hand.
    /// Throws DbError when the statement certainly did not run (no connection within `wait`, the
    /// connect failed, `not_after` passed, or the server answered with an error, which rolled it
    /// back — also one after its rows: a failed commit), and DbOutcomeUnknown when the connection
    /// broke after it may have been sent (also after its rows, before the commit was confirmed).
    boost::asio::awaitable<PgResultPtr> exec(const char* name, std::vector<std::string> params,
                                             ExecStatusType expect = PGRES_TUPLES_OK,
                                             std::optional<std::chrono::steady_clock::time_point> not_after = {});

private:
    struct Conn;
    struct Waiter;
    static boost::asio::awaitable<PGconn*> open_connection(std::string conninfo, std::chrono::milliseconds timeout);
    boost::asio::awaitable<Conn*> acquire();
    void give_back(Conn* conn, bool healthy);
    boost::asio::awaitable<void> wait_for(Conn& conn, bool write);

    boost::asio::any_io_executor executor_;
    std::string conninfo_;
    std::size_t size_;
    std::chrono::milliseconds statement_timeout_;
    std::chrono::milliseconds wait_;
    boost::asio::thread_pool opener_{1};
    std::vector<Conn*> idle_;
    std::deque<std::shared_ptr<Waiter>> waiters_;
    std::size_t open_ = 0;
};

/// FakeGateway (gateway.hpp) on an AsyncPgPool: the same charges, the same outcomes.
class AsyncGateway {
public:
    /// `clock` must outlive the gateway.
    AsyncGateway(AsyncPgPool& pool, std::chrono::milliseconds latency, const DatabaseClock& clock)
        : pool_(pool), latency_(latency), clock_(clock) {}

    /// As FakeGateway::charge: the ledger row, or GatewayTimeout (outcome unknown) or
    /// GatewayNotCharged (certainly nothing charged). `request` must outlive the call.
    boost::asio::awaitable<Charge> charge(ChargeRequest request);
    /// As FakeGateway::find. Throws DbError.
    boost::asio::awaitable<std::vector<Charge>> find(std::string idempotency_key, std::optional<std::string> account);

private:
    AsyncPgPool& pool_;
    std::chrono::milliseconds latency_;
    const DatabaseClock& clock_;
};

/// RateLimiter::allow (gateway.hpp) on an AsyncPgPool; the same windows in the same table.
class AsyncRateLimiter {
public:
    AsyncRateLimiter(AsyncPgPool& pool, std::int64_t per_second) : pool_(pool), per_second_(per_second) {}
    /// True if the request is within the limit. Throws DbError.
    boost::asio::awaitable<bool> allow(std::string account);

private:
    AsyncPgPool& pool_;
    std::int64_t per_second_;
};

}  // namespace payments
