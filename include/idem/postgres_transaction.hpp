// idem/postgres_transaction.hpp — PostgresStore's in-transaction mode: claim, effect and saved
// result commit together.
//
// For effects that only write to the same PostgreSQL database as the store. The claim, every
// statement the effect runs through the Transaction, and the saved result are ONE transaction on
// one connection: either all of it commits or none of it does, so there is no in-progress window
// and no outcome to reconcile.
//
//   auto r = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction& tx) {
//       tx.exec("INSERT INTO orders (id, cents) VALUES ($1, $2)", {order_id, cents});
//       return idem::Response{201, body};
//   });
//
// * A duplicate arriving while the first transaction is open waits on its row lock at most
//   PostgresOptions::lock_timeout (then retries up to claim_attempts, then answers in_progress);
//   with TransactionOptions::lock_wait set (e.g. 1 ms) it answers in_progress at once, so an
//   HTTP service can send 409 without holding a thread and a pooled connection (idem/http/transaction.hpp).
//   One arriving after the commit is replayed; after a rollback it runs itself.
// * fn throws (anything) → everything is rolled back — claim and effect together — and the
//   exception is rethrown; the key is free again.
// * The COMMIT's answer lost with the connection → outcome_unknown (it may or may not have
//   committed; a retry with the same key finds out: replayed, or executed once).
// * Keep fn short and on the database: the transaction holds its connection and row lock, and
//   statement_timeout applies to each statement (idle_in_transaction_session_timeout is twice it).
// * Transaction::exec sends text parameters and returns text columns (NULL as std::nullopt);
//   native_handle() gives the libpq PGconn* for more (include <libpq-fe.h> yourself; the
//   connection is in pipeline mode, so use PQsendQueryParams + PQpipelineSync, or exec()).
//
// Thread-safety: a Transaction belongs to the thread running fn.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "idem/execute_once.hpp"
#include "idem/postgres_store.hpp"

struct pg_conn;  // libpq's PGconn, for native_handle(); no libpq header needed here

namespace idem {

/// In-transaction mode's own settings, beside the ClaimOptions of its claim.
struct TransactionOptions {
    /// How long a duplicate waits on the row lock of a transaction still open for its key. Unset:
    /// up to PostgresOptions::lock_timeout per attempt, claim_attempts attempts, then in_progress.
    /// Set (e.g. 1 ms): one attempt under this lock_timeout, then in_progress at once (HTTP's 409).
    /// Must be shorter than PostgresOptions::statement_timeout, else the call throws config_error
    /// before any I/O (the statement timeout would cancel the wait: an error, not in_progress).
    std::optional<std::chrono::milliseconds> lock_wait{};
};

/// The effect's handle on the in-transaction mode's transaction (see the top of this header).
class Transaction {
public:
    /// One row: text columns, NULL as std::nullopt.
    using Row = std::vector<std::optional<std::string>>;

    /// The answer to exec().
    struct Rows {
        std::vector<Row> rows{};   ///< the rows returned, in order
        std::size_t affected = 0;  ///< rows inserted/updated/deleted (or returned)
    };

    /// Runs one parameterised statement ($1, $2, …) inside the transaction. Throws database_error
    /// (the transaction is then rolled back when fn exits by the exception).
    Rows exec(std::string_view sql, const std::vector<std::optional<std::string>>& params = {});
    /// exec() with the parameters written inline: tx.exec("… $1, $2", {a, b}).
    Rows exec(std::string_view sql, std::initializer_list<std::optional<std::string>> params) {
        return exec(sql, std::vector<std::optional<std::string>>(params));
    }

    /// The key being executed.
    [[nodiscard]] const Key& key() const noexcept { return key_; }
    /// libpq's PGconn of the transaction (pipeline mode; see the top of this header).
    [[nodiscard]] pg_conn* native_handle() const noexcept;

    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;

private:
    friend class PostgresStore;
    Transaction(void* connection, const Key& key, std::chrono::milliseconds timeout) noexcept
        : connection_(connection), key_(key), timeout_(timeout) {}
    void* connection_;  // pg::Connection
    const Key& key_;
    std::chrono::milliseconds timeout_;  // bound on each statement's answer
};

/// In-transaction execute_once; see the top of this header.
template <class F>
[[nodiscard]] auto execute_once_in_transaction(PostgresStore& store, const Key& key, const Fingerprint& fp, F&& fn,
                                               const ClaimOptions& options = {},
                                               const TransactionOptions& transaction = {})
    -> Result<std::remove_cvref_t<std::invoke_result_t<F&, Transaction&>>> {
    using R = std::remove_cvref_t<std::invoke_result_t<F&, Transaction&>>;
    std::optional<R> value;
    auto outcome = store.run_in_transaction(key, fp, options, transaction, [&](Transaction& tx) {
        value.emplace(std::invoke(fn, tx));
        return codec<R>::encode(*value);
    });
    switch (outcome.status) {
        case ClaimStatus::claimed: return Result<R>::executed(std::move(*value));
        case ClaimStatus::completed: return Result<R>::replayed(codec<R>::decode(outcome.result));
        case ClaimStatus::mismatch: return Result<R>::mismatch();
        case ClaimStatus::in_progress: break;
    }
    return Result<R>::in_progress(outcome.retry_after);
}

}  // namespace idem
