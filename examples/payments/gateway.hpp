// gateway.hpp — the example's own PostgreSQL access: a small libpq connection pool, the fake card
// gateway (its ledger lives in the same database as idem's table) and the per-account rate limiter.
//
// None of this is part of idem. The fake gateway stands in for a card processor:
//   * it does NOT deduplicate: every call inserts a ledger row, so a double call shows as two rows.
//     That makes the ledger a witness: tests count rows per idempotency key to prove "charged
//     once".
//   * "tok_ok" → captured; "tok_timeout" → captured, then the answer is lost (GatewayTimeout);
//     any other token ("tok_declined", ...) → declined (the attempt is recorded too).
//
// Thread-safety: every class here may be used from any number of threads.
#pragma once

#include "idem/errors.hpp"
#include "payment.hpp"

#include <libpq-fe.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace payments {

/// The database could not be used (connect failure, pool exhausted, broken connection, SQL error).
class DbError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// The gateway call was sent but no answer came back: the charge may or may not exist.
/// Deliberately NOT an idem::not_performed: execute_once keeps the key in progress.
class GatewayTimeout : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// The gateway certainly did not charge (unreachable, refused before the charge was sent, or the
/// claim is too old to start a charge). execute_once releases the key; the client may retry.
class GatewayNotCharged : public idem::not_performed {
public:
    using idem::not_performed::not_performed;
};

/// A fixed-size pool of libpq connections, opened lazily, each with the example's prepared
/// statements.
class PgPool {
public:
    PgPool(std::string conninfo, std::size_t size, std::chrono::milliseconds statement_timeout,
           std::chrono::milliseconds wait = std::chrono::seconds(5));
    ~PgPool();
    PgPool(const PgPool&) = delete;
    PgPool& operator=(const PgPool&) = delete;

    class Lease {
    public:
        Lease(PgPool* pool, PGconn* conn) noexcept : pool_(pool), conn_(conn) {}
        Lease(Lease&& other) noexcept;
        Lease& operator=(Lease&&) = delete;
        Lease(const Lease&) = delete;
        Lease& operator=(const Lease&) = delete;
        ~Lease();
        [[nodiscard]] PGconn* get() const noexcept { return conn_; }

    private:
        PgPool* pool_;
        PGconn* conn_;
    };

    /// A connection, opening one if fewer than `size` exist; waits up to `wait` otherwise.
    /// An idle connection whose server side has gone away meanwhile (its backend terminated, the
    /// server restarted) is closed, never handed out.
    /// Throws DbError (could not connect / pool exhausted): nothing was sent.
    [[nodiscard]] Lease acquire();

    /// Runs a statement without parameters outside the pool's prepared set (schema setup).
    void exec_script(std::string_view sql);

private:
    PGconn* open();
    void give_back(PGconn* conn) noexcept;

    std::string conninfo_;
    std::chrono::milliseconds statement_timeout_;
    std::size_t size_;
    std::chrono::milliseconds wait_;
    std::mutex mutex_;
    std::condition_variable available_;
    std::vector<PGconn*> idle_;
    std::size_t open_ = 0;
};

/// Creates the gateway ledger and the rate-limit table if missing; safe when several instances
/// start at once (serialised by an advisory lock).
void ensure_app_schema(PgPool& pool);

/// Opens a connection for the gateway (application_name payments-gateway, the given
/// statement_timeout) with every statement the gateway and the rate limiter use prepared. Blocking.
/// Throws DbError.
[[nodiscard]] PGconn* open_gateway_connection(const std::string& conninfo, std::chrono::milliseconds statement_timeout);

/// False if an idle connection must not be used: its server side has gone away (a terminated
/// backend or a server shutting down says goodbye on an idle connection) or it is not connected.
[[nodiscard]] bool idle_connection_alive(PGconn* conn);

struct ChargeRequest;

/// The database's clock as seen from this machine's steady clock: charges state their deadline on
/// it (gateway_charge refuses a charge past it by its own clock). Anchored to the steady clock, so
/// a step of this machine's wall clock changes nothing; sampled again from time to time
/// (FakeGateway::sample_clock), so a drift or a step of either clock is followed. Thread-safe.
class DatabaseClock {
public:
    /// The database's time at `instant`, in microseconds since the Unix epoch.
    [[nodiscard]] std::int64_t at(std::chrono::steady_clock::time_point instant) const noexcept;
    /// A sample: the database read `database_us` between `sent` and `received` (steady clock).
    /// Taken if it is the first or its round trip is under 50 ms (the error is at most half of
    /// it); returns how far the estimate moved, or nullopt if the sample was not taken.
    std::optional<std::chrono::microseconds> update(std::int64_t database_us,
                                                    std::chrono::steady_clock::time_point sent,
                                                    std::chrono::steady_clock::time_point received) noexcept;

private:
    std::atomic<std::int64_t> base_us_{0};  // the database's time minus the steady clock's, in µs
    std::atomic<bool> known_{false};
};

/// The prepared statements and row formats shared by FakeGateway and AsyncGateway
/// (async_gateway.hpp): both write and read the same ledger the same way.
namespace ledger {
/// The gw_charge parameters for a request, and whether the card is captured.
struct ChargeStatement {
    std::vector<std::string> params;
    bool captured = false;
};
/// `clock`: where the database's clock is, to state the request's deadline on it.
[[nodiscard]] ChargeStatement charge_statement(const ChargeRequest& request, const DatabaseClock& clock);
/// Whether gw_charge refused the charge (it came after the request's deadline by the database's
/// clock): no row, nothing charged.
[[nodiscard]] bool charge_refused(const PGresult* result);
/// The charge gw_charge made (its result: id, created_at).
[[nodiscard]] Charge charge_made(const ChargeRequest& request, bool captured, const PGresult* result);
/// Every row of a gw_find / gw_find_account result.
[[nodiscard]] std::vector<Charge> charges_of(const PGresult* result);
/// The gw_age_ms parameter for an instant, and the answer as milliseconds.
[[nodiscard]] std::string age_param(std::chrono::system_clock::time_point instant);
[[nodiscard]] std::chrono::milliseconds age_of(const PGresult* result);
/// The rl_hit answer: the hits counted in this window.
[[nodiscard]] std::int64_t hits_of(const PGresult* result);
/// "payments: NAME: MESSAGE [SQLSTATE]" for a failed result (null: the connection's message).
[[nodiscard]] std::string failure(PGconn* conn, const char* name, const PGresult* result);
}  // namespace ledger

struct ChargeRequest {
    std::string_view account;
    std::string_view idempotency_key;
    const PaymentRequest* payment = nullptr;
    /// The charge is not sent after this instant, nor made once the database's clock is past it
    /// (GatewayNotCharged instead).
    std::chrono::steady_clock::time_point deadline;
};

class FakeGateway {
public:
    /// `clock` must outlive the gateway.
    FakeGateway(PgPool& pool, std::chrono::milliseconds latency, const DatabaseClock& clock)
        : pool_(pool), latency_(latency), clock_(clock) {}

    /// Charges the card; the idempotency key is passed on (and recorded), as a real processor's
    /// API would take it. Returns the ledger row for "captured" and "declined".
    /// Throws GatewayTimeout (outcome unknown) or GatewayNotCharged (certainly nothing charged).
    [[nodiscard]] Charge charge(const ChargeRequest& request);

    /// Ledger rows for a key, oldest first; `account` narrows to one account. Throws DbError.
    [[nodiscard]] std::vector<Charge> find(std::string_view idempotency_key, std::optional<std::string_view> account);
    /// The ledger rows for (account, key) when no charge for them is in flight (a charge holds its
    /// key's lock until its commit has ended); nullopt while one is. What the reconciler decides on:
    /// "no row" is then final for every charge that started before the request's deadline.
    /// Throws DbError.
    [[nodiscard]] std::optional<std::vector<Charge>> settled(std::string_view idempotency_key,
                                                             std::string_view account);
    /// Reads the database's clock once and gives `clock` the sample (DatabaseClock::update's
    /// answer). Throws DbError.
    std::optional<std::chrono::microseconds> sample_clock(DatabaseClock& clock);
    /// How long ago `instant` (a time the database stamped, such as a record's created_at) was, by
    /// the database's own clock — never this machine's, which may run ahead. Throws DbError.
    [[nodiscard]] std::chrono::milliseconds age_by_database_clock(std::chrono::system_clock::time_point instant);

private:
    PgPool& pool_;
    std::chrono::milliseconds latency_;
    const DatabaseClock& clock_;
};

/// Fixed one-second windows per account, counted in the shared database (an UNLOGGED table), so the
/// limit holds across every instance behind the load balancer.
class RateLimiter {
public:
    RateLimiter(PgPool& pool, std::int64_t per_second) : pool_(pool), per_second_(per_second) {}
    /// True if the request is within the limit. Throws DbError.
    [[nodiscard]] bool allow(std::string_view account);
    /// Deletes windows older than a minute.
    void purge();

private:
    PgPool& pool_;
    std::int64_t per_second_;
};

}  // namespace payments
