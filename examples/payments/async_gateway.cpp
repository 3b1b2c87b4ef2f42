#include "async_gateway.hpp"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <utility>

namespace payments {

namespace asio = boost::asio;
using asio::use_awaitable;

// One open connection: libpq's socket, watched by the executor (released before PQfinish closes it).
struct AsyncPgPool::Conn {
    Conn(const asio::any_io_executor& executor, PGconn* connection) : pg(connection), socket(executor, PQsocket(pg)) {}
    ~Conn() {
        socket.release();
        PQfinish(pg);
    }
    Conn(const Conn&) = delete;
    Conn& operator=(const Conn&) = delete;

    PGconn* pg;
    asio::posix::stream_descriptor socket;
};

// A coroutine waiting for a connection: handed one (`given`), or the right to open one
// (`may_open`, when a broken one was closed), or its timer expires.
struct AsyncPgPool::Waiter {
    explicit Waiter(const asio::any_io_executor& executor) : timer(executor) {}
    asio::steady_timer timer;
    Conn* given = nullptr;
    bool may_open = false;
};

AsyncPgPool::AsyncPgPool(asio::any_io_executor executor, std::string conninfo, std::size_t size,
                         std::chrono::milliseconds statement_timeout, std::chrono::milliseconds wait)
    : executor_(std::move(executor)),
      conninfo_(std::move(conninfo)),
      size_(size == 0 ? 1 : size),
      statement_timeout_(statement_timeout),
      wait_(wait) {}

AsyncPgPool::~AsyncPgPool() {
    for (Conn* conn : idle_) delete conn;
    opener_.join();
}

asio::awaitable<PGconn*> AsyncPgPool::open_connection(std::string conninfo, std::chrono::milliseconds timeout) {
    co_return open_gateway_connection(conninfo, timeout);
}

asio::awaitable<AsyncPgPool::Conn*> AsyncPgPool::acquire() {
    const auto until = std::chrono::steady_clock::now() + wait_;
    for (;;) {
        while (!idle_.empty()) {
            Conn* conn = idle_.back();
            idle_.pop_back();
            if (idle_connection_alive(conn->pg)) co_return conn;
            // Its backend went away while it sat here: a statement sent on it would fail only
            // after it was sent (an unknown outcome). Close it and look again.
            delete conn;
            --open_;
        }
        if (open_ < size_) {
            ++open_;
            std::exception_ptr failure;
            try {
                // (No temporary with a destructor inside a co_await expression: GCC 12 may destroy
                // it twice.)
                auto opening = open_connection(conninfo_, statement_timeout_);
                PGconn* pg = co_await asio::co_spawn(opener_, std::move(opening), use_awaitable);
                if (PQsetnonblocking(pg, 1) != 0) {
                    PQfinish(pg);
                    throw DbError("payments: cannot make a gateway connection non-blocking");
                }
                co_return new Conn(executor_, pg);
            } catch (...) {
                failure = std::current_exception();
            }
            --open_;
            if (!waiters_.empty()) {  // the slot this call could not use
                waiters_.front()->may_open = true;
                waiters_.front()->timer.cancel();
                waiters_.pop_front();
            }
            std::rethrow_exception(failure);
        }
        const auto now = std::chrono::steady_clock::now();
        if (now >= until) throw DbError("payments: every gateway connection stayed busy");
        auto waiter = std::make_shared<Waiter>(executor_);
        waiter->timer.expires_at(until);
        waiters_.push_back(waiter);
        boost::system::error_code ignored;
        co_await waiter->timer.async_wait(asio::redirect_error(use_awaitable, ignored));
        if (waiter->given != nullptr) co_return waiter->given;
        std::erase(waiters_, waiter);  // timed out (or was given a slot to open: already removed)
    }
}

void AsyncPgPool::give_back(Conn* conn, bool healthy) {
    healthy = healthy && PQstatus(conn->pg) == CONNECTION_OK && PQtransactionStatus(conn->pg) == PQTRANS_IDLE;
    if (!healthy) {
        delete conn;
        --open_;
        if (!waiters_.empty()) {
            waiters_.front()->may_open = true;
            waiters_.front()->timer.cancel();
            waiters_.pop_front();
        }
        return;
    }
    if (!waiters_.empty()) {
        waiters_.front()->given = conn;
        waiters_.front()->timer.cancel();
        waiters_.pop_front();
        return;
    }
    idle_.push_back(conn);
}

asio::awaitable<void> AsyncPgPool::wait_for(Conn& conn, bool write) {
    co_await conn.socket.async_wait(
        write ? asio::posix::stream_descriptor::wait_write : asio::posix::stream_descriptor::wait_read, use_awaitable);
}

asio::awaitable<PgResultPtr> AsyncPgPool::exec(const char* name, std::vector<std::string> params, ExecStatusType expect,
                                               std::optional<std::chrono::steady_clock::time_point> not_after) {
    Conn* conn = co_await acquire();  // DbError: nothing sent
    if (not_after && std::chrono::steady_clock::now() > *not_after) {
        give_back(conn, true);
        throw DbError(std::string("payments: ") + name + " not sent: its deadline passed while it waited");
    }
    std::vector<const char*> values;
    values.reserve(params.size());
    for (const auto& p : params) values.push_back(p.c_str());

    // The statement's rows arrive before its implicit commit, which may still fail (an error
    // result after them: rolled back) or be cut off (the connection lost before the server said it
    // is ready again: committed or not). So, as PQexec does, the last result is the answer, and it
    // counts only once libpq says there is no more (the server's ReadyForQuery, after the commit).
    PgResultPtr result(nullptr, &PQclear);
    bool finished = false;
    bool broken = false;
    try {
        if (PQsendQueryPrepared(conn->pg, name, static_cast<int>(values.size()), values.data(), nullptr, nullptr, 0) ==
            1) {
            for (int flushed = PQflush(conn->pg); flushed != 0; flushed = PQflush(conn->pg)) {
                if (flushed < 0) throw DbError(ledger::failure(conn->pg, name, nullptr));
                co_await wait_for(*conn, true);
            }
            for (;;) {
                if (PQconsumeInput(conn->pg) == 0) throw DbError(ledger::failure(conn->pg, name, nullptr));
                while (!finished && PQisBusy(conn->pg) == 0) {
                    PGresult* next = PQgetResult(conn->pg);
                    if (next == nullptr) {
                        finished = true;
                    } else {
                        result.reset(next);
                    }
                }
                if (finished) break;
                co_await wait_for(*conn, false);
            }
        }
    } catch (const std::exception&) {
        broken = true;  // the socket failed, or libpq lost the connection
    }

    const bool answered = finished && result && PQresultStatus(result.get()) == expect;
    if (answered) {
        give_back(conn, true);
        co_return result;
    }
    const bool connected = !broken && PQstatus(conn->pg) == CONNECTION_OK;
    const std::string message = ledger::failure(conn->pg, name, result.get());
    give_back(conn, connected);
    // Connected: an error answer rolled the statement back, or it was never sent. Otherwise the
    // connection broke after (part of) it may have left: it may have run.
    if (connected) throw DbError(message);
    throw DbOutcomeUnknown(message);
}

// -------------------------------------------------------------------------------------------
// AsyncGateway

asio::awaitable<Charge> AsyncGateway::charge(ChargeRequest request) {
    if (latency_.count() > 0) {  // the network, both ways
        asio::steady_timer network(co_await asio::this_coro::executor, latency_);
        co_await network.async_wait(use_awaitable);
    }
    // Never start a charge once the claim may be considered stale by a reconciler (which would
    // release a key whose charge is still on its way): exec checks the deadline once it holds a
    // connection, right before sending, and the database refuses the charge past it by its own
    // clock (gateway_charge).
    const ledger::ChargeStatement statement = ledger::charge_statement(request, clock_);
    std::optional<PgResultPtr> result;
    try {
        auto sending = pool_.exec("gw_charge", statement.params, PGRES_TUPLES_OK, request.deadline);
        result.emplace(co_await std::move(sending));
    } catch (const DbOutcomeUnknown& e) {
        throw GatewayTimeout(std::string("gateway connection lost during the charge: ") + e.what());
    } catch (const DbError& e) {
        // Unreachable, or the gateway answered with an error (rolled back): nothing charged.
        throw GatewayNotCharged(std::string("gateway did not charge: ") + e.what());
    }
    if (ledger::charge_refused(result->get())) throw GatewayNotCharged("gateway refused a charge that came too late");
    if (request.payment->card == "tok_timeout") {
        // The charge is recorded, but its answer never reaches us.
        throw GatewayTimeout("gateway timed out (tok_timeout): the charge may have been made");
    }
    co_return ledger::charge_made(request, statement.captured, result->get());
}

asio::awaitable<std::vector<Charge>> AsyncGateway::find(std::string idempotency_key,
                                                        std::optional<std::string> account) {
    const char* statement = account ? "gw_find_account" : "gw_find";
    std::vector<std::string> params{std::move(idempotency_key)};
    if (account) params.push_back(std::move(*account));
    auto finding = pool_.exec(statement, std::move(params));
    PgResultPtr result = co_await std::move(finding);
    co_return ledger::charges_of(result.get());
}

asio::awaitable<bool> AsyncRateLimiter::allow(std::string account) {
    const char* statement = "rl_hit";
    std::vector<std::string> params{std::move(account)};
    auto hitting = pool_.exec(statement, std::move(params));
    PgResultPtr result = co_await std::move(hitting);
    co_return ledger::hits_of(result.get()) <= per_second_;
}

}  // namespace payments
