#include "gateway.hpp"

#include <poll.h>
#include <charconv>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>

namespace payments {
namespace {

using PgResult = std::unique_ptr<PGresult, decltype(&PQclear)>;

constexpr std::string_view kCreatedAt = R"(to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))";

const std::string kChargeColumns =
    "id, account, idempotency_key, order_id, amount_cents, currency, card, "
    "status, " +
    std::string(kCreatedAt);

// Prepared on every pooled connection when it is opened.
const std::pair<const char*, std::string> kStatements[] = {
    // gateway_charge and gateway_settled: kSchema. $8, the instant after which the charge is
    // refused, is in microseconds since the Unix epoch.
    {"gw_charge", "SELECT * FROM gateway_charge($1, $2, $3, $4, $5, $6, $7, to_timestamp($8::float8 / 1e6))"},
    {"gw_find", "SELECT " + kChargeColumns + " FROM gateway_charges WHERE idempotency_key = $1 ORDER BY id"},
    {"gw_find_account",
     "SELECT " + kChargeColumns + " FROM gateway_charges WHERE idempotency_key = $1 AND account = $2 ORDER BY id"},
    {"gw_settled", "SELECT * FROM gateway_settled($1, $2)"},
    // The database's clock, in microseconds since the Unix epoch.
    {"gw_clock_us", "SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint"},
    // How long ago an instant (microseconds since the Unix epoch) was, by the database's clock.
    {"gw_age_ms",
     "SELECT floor(extract(epoch FROM clock_timestamp() - to_timestamp($1::float8 / 1e6)) * 1000)::bigint"},
    {"rl_hit",
     "INSERT INTO payments_rate_limit AS r (account, window_start, hits) "
     "VALUES ($1, floor(extract(epoch FROM clock_timestamp()))::bigint, 1) "
     "ON CONFLICT (account, window_start) DO UPDATE SET hits = r.hits + 1 RETURNING hits"},
    {"rl_purge",
     "DELETE FROM payments_rate_limit WHERE window_start < floor(extract(epoch FROM "
     "clock_timestamp()))::bigint - 60"},
};

constexpr std::string_view kSchema = R"SQL(
BEGIN;
SELECT pg_advisory_xact_lock(4242003001);
CREATE TABLE IF NOT EXISTS gateway_charges (
    id              bigserial   PRIMARY KEY,
    account         text        NOT NULL,
    idempotency_key text        NOT NULL,
    order_id        bigint      NOT NULL,
    amount_cents    bigint      NOT NULL CHECK (amount_cents > 0),
    currency        text        NOT NULL,
    card            text        NOT NULL,
    status          text        NOT NULL CHECK (status IN ('captured', 'declined')),
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- (CREATE INDEX IF NOT EXISTS would take the table's lock, behind every charge in flight, first.)
DO $$ BEGIN
    IF to_regclass('gateway_charges_key') IS NULL THEN
        CREATE INDEX gateway_charges_key ON gateway_charges (idempotency_key, account);
    END IF;
END $$;
-- A charge holds the lock of its (account, key) until its commit has ended, and is refused once the
-- database's clock is past its not_after: a charge whose backend stalls (stopped, or slow to
-- commit) is either over before gateway_settled can look, or refused.
CREATE OR REPLACE FUNCTION gateway_charge(p_account text, p_key text, p_order_id bigint, p_amount_cents bigint,
                                          p_currency text, p_card text, p_status text, p_not_after timestamptz)
RETURNS TABLE (charge_id bigint, charge_created_at text) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(p_account), hashtext(p_key));
    IF clock_timestamp() > p_not_after THEN
        RETURN;  -- too late: no row, nothing charged
    END IF;
    RETURN QUERY
    INSERT INTO gateway_charges AS c (account, idempotency_key, order_id, amount_cents, currency, card, status)
    VALUES (p_account, p_key, p_order_id, p_amount_cents, p_currency, p_card, p_status)
    RETURNING c.id, to_char(c.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
END $$;
-- The charges for (account, key), read only when no charge for it is in flight (its lock is free):
-- SQLSTATE 55P03 otherwise. The query after the lock sees every charge committed before it — under
-- READ COMMITTED only (a snapshot from the statement's start would miss one that committed since).
CREATE OR REPLACE FUNCTION gateway_settled(p_key text, p_account text)
RETURNS TABLE (id bigint, account text, idempotency_key text, order_id bigint, amount_cents bigint,
               currency text, card text, status text, created_at text) LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'gateway_settled needs READ COMMITTED, not %', current_setting('transaction_isolation')
            USING ERRCODE = '0A000';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext(p_account), hashtext(p_key)) THEN
        RAISE EXCEPTION 'a charge for this key is in flight' USING ERRCODE = '55P03';
    END IF;
    RETURN QUERY
    SELECT c.id, c.account, c.idempotency_key, c.order_id, c.amount_cents, c.currency, c.card, c.status,
           to_char(c.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
    FROM gateway_charges c WHERE c.idempotency_key = p_key AND c.account = p_account ORDER BY c.id;
END $$;
CREATE UNLOGGED TABLE IF NOT EXISTS payments_rate_limit (
    account      text   NOT NULL,
    window_start bigint NOT NULL,
    hits         bigint NOT NULL,
    PRIMARY KEY (account, window_start)
);
COMMIT;
)SQL";

std::string pg_message(PGconn* conn) {
    std::string message = conn != nullptr ? PQerrorMessage(conn) : "out of memory";
    while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
    return message;
}

// The user's `options` — the conninfo's, else libpq's default (PGOPTIONS, the PGSERVICE entry's) —
// then `ours`: a connection made with the result keeps the user's settings (a search_path, say)
// and ours win where both set one. Passing `options` as a separate keyword replaces the user's,
// hence the merge (as idem's own connections do).
std::string with_conninfo_options(const std::string& conninfo, const std::string& ours) {
    std::string user;
    bool given = false, service = false;
    if (PQconninfoOption* opts = PQconninfoParse(conninfo.c_str(), nullptr)) {
        for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
            if (o->val == nullptr) continue;
            const std::string_view keyword(o->keyword);
            if (keyword == "options") {
                user = o->val;
                given = true;
            } else if (keyword == "service") {
                service = true;
            }
        }
        PQconninfoFree(opts);
    }
    if (!given && service) {
        // A service named in the conninfo is not read here; PGOPTIONS is what libpq uses when
        // that entry sets no options.
        if (const char* env = std::getenv("PGOPTIONS")) user = env;
    } else if (!given) {
        if (PQconninfoOption* defaults = PQconndefaults()) {
            for (PQconninfoOption* o = defaults; o->keyword != nullptr; ++o) {
                if (std::string_view(o->keyword) == "options" && o->val != nullptr) user = o->val;
            }
            PQconninfoFree(defaults);
        }
    }
    return user.empty() ? ours : user + " " + ours;
}

std::int64_t to_int64(const char* text) {
    std::int64_t value = 0;
    const std::string_view view(text);
    const auto [end, ec] = std::from_chars(view.data(), view.data() + view.size(), value);
    if (ec != std::errc() || end != view.data() + view.size()) {
        throw DbError("payments: unexpected integer from the database: " + std::string(view));
    }
    return value;
}

PgResult exec_prepared(PGconn* conn, const char* name, const std::vector<std::string>& params,
                       ExecStatusType expect = PGRES_TUPLES_OK) {
    std::vector<const char*> values;
    values.reserve(params.size());
    for (const auto& p : params) values.push_back(p.c_str());
    PgResult result(PQexecPrepared(conn, name, static_cast<int>(values.size()), values.data(), nullptr, nullptr, 0),
                    &PQclear);
    if (!result || PQresultStatus(result.get()) != expect) throw DbError(ledger::failure(conn, name, result.get()));
    return result;
}

Charge charge_from_row(const PGresult* result, int row) {
    Charge charge;
    charge.id = to_int64(PQgetvalue(result, row, 0));
    charge.account = PQgetvalue(result, row, 1);
    charge.idempotency_key = PQgetvalue(result, row, 2);
    charge.order_id = to_int64(PQgetvalue(result, row, 3));
    charge.amount_cents = to_int64(PQgetvalue(result, row, 4));
    charge.currency = PQgetvalue(result, row, 5);
    charge.card = PQgetvalue(result, row, 6);
    charge.status = PQgetvalue(result, row, 7);
    charge.created_at = PQgetvalue(result, row, 8);
    return charge;
}

}  // namespace

// The server speaks on an idle connection only to say goodbye: a backend that was terminated, or
// a server shutting down, sends its FATAL error and closes the socket. So anything to read on an
// idle pooled connection (or an error polling it) means it must not be used.
bool idle_connection_alive(PGconn* conn) {
    if (PQstatus(conn) != CONNECTION_OK) return false;
    pollfd p{PQsocket(conn), POLLIN, 0};
    return p.fd >= 0 && ::poll(&p, 1, 0) == 0;
}

// ----------------------------------------------------------------------------------------------
// ledger: the statements' parameters and results

namespace ledger {

ChargeStatement charge_statement(const ChargeRequest& request, const DatabaseClock& clock) {
    const PaymentRequest& payment = *request.payment;
    const bool captured = payment.card == "tok_ok" || payment.card == "tok_timeout";
    return ChargeStatement{
        {std::string(request.account), std::string(request.idempotency_key), std::to_string(payment.order_id),
         std::to_string(payment.amount_cents), payment.currency, payment.card, captured ? "captured" : "declined",
         std::to_string(clock.at(request.deadline))},
        captured};
}

bool charge_refused(const PGresult* result) { return PQntuples(result) == 0; }

Charge charge_made(const ChargeRequest& request, bool captured, const PGresult* result) {
    const PaymentRequest& payment = *request.payment;
    Charge charge;
    charge.id = to_int64(PQgetvalue(result, 0, 0));
    charge.created_at = PQgetvalue(result, 0, 1);
    charge.account = std::string(request.account);
    charge.idempotency_key = std::string(request.idempotency_key);
    charge.order_id = payment.order_id;
    charge.amount_cents = payment.amount_cents;
    charge.currency = payment.currency;
    charge.card = payment.card;
    charge.status = captured ? "captured" : "declined";
    return charge;
}

std::vector<Charge> charges_of(const PGresult* result) {
    std::vector<Charge> charges;
    const int rows = PQntuples(result);
    charges.reserve(static_cast<std::size_t>(rows));
    for (int row = 0; row < rows; ++row) charges.push_back(charge_from_row(result, row));
    return charges;
}

std::string age_param(std::chrono::system_clock::time_point instant) {
    return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(instant.time_since_epoch()).count());
}

std::chrono::milliseconds age_of(const PGresult* result) {
    return std::chrono::milliseconds(to_int64(PQgetvalue(result, 0, 0)));
}

std::int64_t hits_of(const PGresult* result) { return to_int64(PQgetvalue(result, 0, 0)); }

std::string failure(PGconn* conn, const char* name, const PGresult* result) {
    const char* state = result != nullptr ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
    std::string message = result != nullptr ? PQresultErrorMessage(result) : pg_message(conn);
    while (!message.empty() && message.back() == '\n') message.pop_back();
    if (message.empty()) message = pg_message(conn);
    return std::string("payments: ") + name + ": " + message +
           (state != nullptr ? std::string(" [") + state + "]" : std::string());
}

}  // namespace ledger

// ----------------------------------------------------------------------------------------------
// DatabaseClock

namespace {
std::int64_t steady_us(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}
}  // namespace

std::int64_t DatabaseClock::at(std::chrono::steady_clock::time_point instant) const noexcept {
    return base_us_.load(std::memory_order_acquire) + steady_us(instant);
}

std::optional<std::chrono::microseconds> DatabaseClock::update(
    std::int64_t database_us, std::chrono::steady_clock::time_point sent,
    std::chrono::steady_clock::time_point received) noexcept {
    const bool first = !known_.load(std::memory_order_acquire);
    if (!first && received - sent > std::chrono::milliseconds(50)) return std::nullopt;
    const std::int64_t base = database_us - steady_us(sent + (received - sent) / 2);
    const std::int64_t before = base_us_.exchange(base, std::memory_order_acq_rel);
    known_.store(true, std::memory_order_release);
    return std::chrono::microseconds(first ? 0 : base - before);
}

// ----------------------------------------------------------------------------------------------
// PgPool

PgPool::PgPool(std::string conninfo, std::size_t size, std::chrono::milliseconds statement_timeout,
               std::chrono::milliseconds wait)
    : conninfo_(std::move(conninfo)), statement_timeout_(statement_timeout), size_(size == 0 ? 1 : size), wait_(wait) {}

PgPool::~PgPool() {
    std::lock_guard lock(mutex_);
    for (PGconn* conn : idle_) PQfinish(conn);
    idle_.clear();
}

PgPool::Lease::Lease(Lease&& other) noexcept : pool_(other.pool_), conn_(std::exchange(other.conn_, nullptr)) {}

PgPool::Lease::~Lease() {
    if (conn_ != nullptr) pool_->give_back(conn_);
}

PGconn* open_gateway_connection(const std::string& conninfo, std::chrono::milliseconds statement_timeout) {
    // READ COMMITTED whatever the database's default: gateway_settled relies on it.
    const std::string options =
        with_conninfo_options(conninfo, "-c statement_timeout=" + std::to_string(statement_timeout.count()) +
                                            " -c default_transaction_isolation=read\\ committed");
    const char* keys[] = {"dbname", "options", "application_name", "connect_timeout", nullptr};
    const char* values[] = {conninfo.c_str(), options.c_str(), "payments-gateway", "5", nullptr};
    PGconn* conn = PQconnectdbParams(keys, values, 1);
    if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) {
        std::string message = pg_message(conn);
        PQfinish(conn);
        throw DbError("payments: cannot connect to the database: " + message);
    }
    for (const auto& [name, sql] : kStatements) {
        PgResult result(PQprepare(conn, name, sql.c_str(), 0, nullptr), &PQclear);
        if (!result || PQresultStatus(result.get()) != PGRES_COMMAND_OK) {
            std::string message = result ? PQresultErrorMessage(result.get()) : pg_message(conn);
            PQfinish(conn);
            throw DbError(std::string("payments: cannot prepare ") + name + ": " + message);
        }
    }
    return conn;
}

PGconn* PgPool::open() { return open_gateway_connection(conninfo_, statement_timeout_); }

PgPool::Lease PgPool::acquire() {
    std::unique_lock lock(mutex_);
    const auto until = std::chrono::steady_clock::now() + wait_;
    for (;;) {
        if (!idle_.empty()) {
            PGconn* conn = idle_.back();
            idle_.pop_back();
            if (idle_connection_alive(conn)) return Lease(this, conn);
            // Its backend went away while it sat here. Sending a charge on it would fail only
            // after the charge was sent, as far as FakeGateway::charge can tell: an unknown
            // outcome that keeps the key in progress until the reconciler releases it. Close it
            // and look again.
            --open_;
            lock.unlock();
            PQfinish(conn);
            lock.lock();
            continue;
        }
        if (open_ < size_) {
            ++open_;
            lock.unlock();
            try {
                return Lease(this, open());
            } catch (...) {
                lock.lock();
                --open_;
                available_.notify_one();
                throw;
            }
        }
        if (available_.wait_until(lock, until) == std::cv_status::timeout && idle_.empty() && open_ >= size_) {
            throw DbError("payments: every database connection stayed busy");
        }
    }
}

void PgPool::give_back(PGconn* conn) noexcept {
    const bool healthy = PQstatus(conn) == CONNECTION_OK && PQtransactionStatus(conn) == PQTRANS_IDLE;
    {
        std::lock_guard lock(mutex_);
        if (healthy) {
            idle_.push_back(conn);
        } else {
            --open_;
        }
    }
    if (!healthy) PQfinish(conn);
    available_.notify_one();
}

void PgPool::exec_script(std::string_view sql) {
    // Its own connection: the pooled ones prepare statements on tables this script creates.
    const std::string options = with_conninfo_options(conninfo_, "-c client_min_messages=warning");
    const char* keys[] = {"dbname", "application_name", "connect_timeout", "options", nullptr};
    const char* values[] = {conninfo_.c_str(), "payments-setup", "5", options.c_str(), nullptr};
    std::unique_ptr<PGconn, decltype(&PQfinish)> conn(PQconnectdbParams(keys, values, 1), &PQfinish);
    if (!conn || PQstatus(conn.get()) != CONNECTION_OK) {
        throw DbError("payments: cannot connect to the database: " + pg_message(conn.get()));
    }
    PgResult result(PQexec(conn.get(), std::string(sql).c_str()), &PQclear);
    if (!result || PQresultStatus(result.get()) != PGRES_COMMAND_OK) {
        throw DbError("payments: schema setup failed: " + pg_message(conn.get()));
    }
}

void ensure_app_schema(PgPool& pool) { pool.exec_script(kSchema); }

// -----------------------------------------------------------------------------------------
// FakeGateway

Charge FakeGateway::charge(const ChargeRequest& request) {
    if (latency_.count() > 0) std::this_thread::sleep_for(latency_);  // the network, both ways

    std::optional<PgPool::Lease> conn;
    try {
        conn.emplace(pool_.acquire());
    } catch (const DbError& e) {
        throw GatewayNotCharged(std::string("gateway unreachable: ") + e.what());
    }
    // Past this point a charge may be made. Never start one once the claim may be considered stale
    // by a reconciler (which would release a key whose charge is still on its way).
    if (std::chrono::steady_clock::now() > request.deadline) {
        throw GatewayNotCharged("gateway call not started: the claim is too old");
    }

    const ledger::ChargeStatement statement = ledger::charge_statement(request, clock_);
    PgResult result(nullptr, &PQclear);
    try {
        result = exec_prepared(conn->get(), "gw_charge", statement.params);
    } catch (const DbError& e) {
        if (PQstatus(conn->get()) == CONNECTION_OK) {
            // The gateway answered with an error: the statement was rolled back, nothing charged.
            throw GatewayNotCharged(std::string("gateway refused the charge: ") + e.what());
        }
        throw GatewayTimeout(std::string("gateway connection lost during the charge: ") + e.what());
    }
    if (ledger::charge_refused(result.get())) throw GatewayNotCharged("gateway refused a charge that came too late");
    if (request.payment->card == "tok_timeout") {
        // The charge is recorded, but its answer never reaches us.
        throw GatewayTimeout("gateway timed out (tok_timeout): the charge may have been made");
    }
    return ledger::charge_made(request, statement.captured, result.get());
}

std::vector<Charge> FakeGateway::find(std::string_view idempotency_key, std::optional<std::string_view> account) {
    PgPool::Lease conn = pool_.acquire();
    PgResult result =
        account ? exec_prepared(conn.get(), "gw_find_account", {std::string(idempotency_key), std::string(*account)})
                : exec_prepared(conn.get(), "gw_find", {std::string(idempotency_key)});
    return ledger::charges_of(result.get());
}

std::optional<std::vector<Charge>> FakeGateway::settled(std::string_view idempotency_key, std::string_view account) {
    PgPool::Lease conn = pool_.acquire();
    const std::string key(idempotency_key);
    const std::string acct(account);
    const char* values[] = {key.c_str(), acct.c_str()};
    PgResult result(PQexecPrepared(conn.get(), "gw_settled", 2, values, nullptr, nullptr, 0), &PQclear);
    if (result && PQresultStatus(result.get()) == PGRES_TUPLES_OK) return ledger::charges_of(result.get());
    const char* state = result ? PQresultErrorField(result.get(), PG_DIAG_SQLSTATE) : nullptr;
    if (state != nullptr && std::string_view(state) == "55P03") return std::nullopt;  // a charge in flight
    throw DbError(ledger::failure(conn.get(), "gw_settled", result.get()));
}

std::optional<std::chrono::microseconds> FakeGateway::sample_clock(DatabaseClock& clock) {
    PgPool::Lease conn = pool_.acquire();
    const auto sent = std::chrono::steady_clock::now();
    PgResult result = exec_prepared(conn.get(), "gw_clock_us", {});
    const auto received = std::chrono::steady_clock::now();
    return clock.update(to_int64(PQgetvalue(result.get(), 0, 0)), sent, received);
}

std::chrono::milliseconds FakeGateway::age_by_database_clock(std::chrono::system_clock::time_point instant) {
    PgPool::Lease conn = pool_.acquire();
    PgResult result = exec_prepared(conn.get(), "gw_age_ms", {ledger::age_param(instant)});
    return ledger::age_of(result.get());
}

// -----------------------------------------------------------------------------------------
// RateLimiter

bool RateLimiter::allow(std::string_view account) {
    PgPool::Lease conn = pool_.acquire();
    PgResult result = exec_prepared(conn.get(), "rl_hit", {std::string(account)});
    return ledger::hits_of(result.get()) <= per_second_;
}

void RateLimiter::purge() {
    PgPool::Lease conn = pool_.acquire();
    (void)exec_prepared(conn.get(), "rl_purge", {}, PGRES_COMMAND_OK);
}

}  // namespace payments
