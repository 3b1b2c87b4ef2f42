// PostgresStore::run_in_transaction: the claim, the effect's own statements and the save in one
// PostgreSQL transaction (include/idem/postgres_transaction.hpp).
#include "idem/postgres_store.hpp"
#include "idem/postgres_transaction.hpp"

#include "store_impl.hpp"

namespace idem {

PostgresStore::TransactionOutcome PostgresStore::run_in_transaction(
    const Key& key, const Fingerprint& fp, const ClaimOptions& options,
    const std::function<std::string(Transaction&)>& effect) {
    return run_in_transaction(key, fp, options, TransactionOptions{}, effect);
}

PostgresStore::TransactionOutcome PostgresStore::run_in_transaction(
    const Key& key, const Fingerprint& request, const ClaimOptions& options, const TransactionOptions& transaction,
    const std::function<std::string(Transaction&)>& effect) {
    Impl& m = *impl_;
    const Fingerprint fp = key_fingerprint(request);  // PostgresOptions::fingerprint_secret
    // TransactionOptions::lock_wait, else the deprecated ClaimOptions::transaction_lock_wait.
    const std::optional<std::chrono::milliseconds> lock_wait =
        transaction.lock_wait ? transaction.lock_wait : options.transaction_lock_wait;
    // A lock wait the statement timeout cuts short would cancel the claim (57014) instead of
    // answering in_progress: refused before any I/O.
    if (lock_wait && *lock_wait >= m.options.statement_timeout) {
        throw config_error("idem: TransactionOptions::lock_wait must be shorter than the store's statement_timeout");
    }
    m.counters().claims.fetch_add(1, std::memory_order_relaxed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    const Fence fence = detail::new_fence();

    std::optional<pg::Lease> conn;
    const auto rollback = [&] {
        try {
            Params none;
            auto r = m.run_one(**conn, pg::kRollback, none);
            if (!r[0].ok()) (*conn)->mark_broken();
        } catch (const error&) {
            (*conn)->mark_broken();
        }
    };
    // The claim: BEGIN; claim; read. Nothing commits before the effect has run, so a pooled
    // connection found dead (a restart or failover since its last use) is simply replaced, as the
    // other entry points do (claim_attempts in all).
    // lock_wait: the claim's INSERT alone runs under that lock_timeout (set_config,
    // local to the transaction), which is back to the session's before fn runs.
    static const pg::StatementDef set_lock_wait{"", "SELECT set_config('lock_timeout', $1, true)", {pg::oid::text}};
    static const pg::StatementDef reset_lock_wait{"", "SET LOCAL lock_timeout TO DEFAULT", {}};
    const std::size_t shift = lock_wait ? 1 : 0;  // the claim's results move one step down
    for (int failures = 0, broken = 0;;) {
        if (!conn) conn.emplace(m.acquire());
        try {
            Params none, ins, sel, wait_ms;
            add_claim_params(ins, key, fp, fence, lease, retention);
            sel.text(key.scope()).text(key.value());
            const std::string wait_text =
                lock_wait ? std::to_string(std::max<std::int64_t>(1, lock_wait->count())) + "ms" : "";
            wait_ms.text(wait_text);
            // One round trip, one open transaction (READ COMMITTED: the SELECT still takes its own
            // snapshot). SET LOCAL enable_seqscan = on: fn's own statements are planned as the user
            // expects; idem's lookups need the session's off only (see connection.cpp).
            const Step plain[] = {{&m.defs[pg::kBegin], &none, false},
                                  {&m.defs[pg::kClaimInsert], &ins, false},
                                  {&m.defs[pg::kSelect], &sel, false},
                                  {&m.defs[pg::kSeqscanLocalOn], &none, true}};
            const Step waiting[] = {
                {&m.defs[pg::kBegin], &none, false},      {&set_lock_wait, &wait_ms, false},
                {&m.defs[pg::kClaimInsert], &ins, false}, {&m.defs[pg::kSelect], &sel, false},
                {&reset_lock_wait, &none, false},         {&m.defs[pg::kSeqscanLocalOn], &none, true}};
            auto res = lock_wait ? m.run(**conn, waiting) : m.run(**conn, plain);
            // Any failure aborted the transaction: the INSERT's row is not ours, whatever it said.
            const StepResult* failure = res.first_failure();
            bool won = failure == nullptr && res[1 + shift].rows() == 1;
            if (failure == nullptr && !won && res[2 + shift].rows() == 1) {
                Record record = parse_record(res[2 + shift].result.get(), 0);
                if (record.expired) {
                    const Step reclaim[] = {{&m.defs[pg::kSeqscanLocalDefault], &none, false},
                                            {&m.defs[pg::kReclaimExpired], &ins, false},
                                            {&m.defs[pg::kSeqscanLocalOn], &none, true}};
                    auto r = m.run(**conn, reclaim);
                    if (const StepResult* f = r.first_failure()) {
                        rollback();
                        // 40001: a concurrent re-claimer moved the row to another generation, or
                        // the row's generation is closed (this transaction began before it ended):
                        // read again in a new transaction, whose now() is in the current one.
                        const bool conflict = f->sqlstate() == "40001" || f->sqlstate() == "40P01";
                        if (!conflict || ++failures >= m.options.claim_attempts) {
                            throw_statement_error(*f, "claim (expired)");
                        }
                        m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                        continue;
                    }
                    won = r[1].rows() == 1;
                }
                if (!won) {
                    rollback();
                    if (record.expired) continue;  // someone else re-claimed it first: read again
                    const ClaimStatus status = classify(record, fp);
                    TransactionOutcome out{status, {}, {}};
                    if (status == ClaimStatus::completed) {
                        detail::open_result(m.options.sealing, m.options.table, key, record.fence, record.result);
                        out.result = std::move(*record.result);
                    }
                    if (status == ClaimStatus::in_progress) {
                        out.retry_after = detail::retry_after_hint(record.lease_until, std::chrono::system_clock::now(),
                                                                   m.options.max_retry_after);
                    }
                    return out;
                }
            }
            if (won) break;
            rollback();
            if (failure != nullptr && !claim_retryable(failure->sqlstate())) {
                throw_statement_error(*failure, failure == &res[0] ? "begin" : "claim");
            }
            if (lock_wait && failure != nullptr && failure->sqlstate() == "55P03") {
                // Another open transaction holds the key: answer at once instead of waiting.
                return TransactionOutcome{ClaimStatus::in_progress, {}, m.options.max_retry_after};
            }
            // Lock timeout on a concurrent open transaction, or the row vanished: bounded retry.
            if (++failures >= m.options.claim_attempts) {
                return TransactionOutcome{ClaimStatus::in_progress, {}, m.options.max_retry_after};
            }
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
        } catch (const pg::connection_broken& e) {
            conn.reset();  // broken: closed as its lease ends
            m.pool->suspect_idle();
            if (++broken >= m.options.claim_attempts) {
                throw store_unavailable(
                    std::string("idem: in-transaction claim: ") + std::string(detail::without_prefix(e.what())),
                    e.sqlstate());
            }
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
        }
    }
    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);

    try {
        Transaction tx(&**conn, key, m.options.statement_timeout + m.options.lock_timeout + std::chrono::seconds(1));
        std::string bytes;
        try {
            // Marked as inside this store's effect: a call to the store from fn needs a second
            // connection (Impl::acquire says so clearly instead of waiting for the pool).
            struct InEffect {
                const void* previous = in_effect_of;
                explicit InEffect(const void* store) noexcept { in_effect_of = store; }
                ~InEffect() { in_effect_of = previous; }
            } inside(&m);
            bytes = effect(tx);
        } catch (...) {
            rollback();  // claim and effect go together
            throw;
        }
        if (bytes.size() > m.options.max_result_bytes) {
            rollback();
            detail::check_result_size(bytes, m.options.max_result_bytes, "(rolled back)");
        }
        Params none, save;
        std::string sealed;
        save.text(key.scope())
            .text(key.value())
            .int8(fence)
            .bytes(detail::seal_result(m.options.sealing, m.options.table, key, fence, bytes, sealed));
        const Step steps[] = {{&m.defs[pg::kSeqscanLocalDefault], &none, false},
                              {&m.defs[pg::kSave], &save, false},
                              {&m.defs[pg::kCommit], &none, true}};
        pg::StepResults res;
        try {
            res = m.run(**conn, steps);
        } catch (const pg::connection_broken& e) {
            throw outcome_unknown(std::string("idem: the transaction's COMMIT was sent but its answer was lost: ") +
                                      std::string(detail::without_prefix(e.what())) +
                                      " — retry with the same key to learn the outcome",
                                  e.sqlstate());
        }
        if (const StepResult* failure = res.first_failure()) {
            rollback();
            // (an effect that swallowed its own statement's error left the transaction aborted:
            // the first statement here reports it)
            throw_statement_error(*failure, failure == &res[2] ? "commit" : "save (in transaction)");
        }
        if (res[1].rows() != 1) {
            rollback();
            // Only fn itself can have changed idem's row in its own transaction; the COMMIT was
            // already sent with the save, so the effect committed without its result.
            throw database_error(
                "idem: in-transaction save matched no row (did the effect change idem's own row?): "
                "the transaction committed without a stored result");
        }
        m.counters().saves.fetch_add(1, std::memory_order_relaxed);
        return TransactionOutcome{ClaimStatus::claimed, {}, {}};
    } catch (const pg::connection_broken& e) {
        // The connection broke while fn ran: its transaction, claim included, rolled back.
        throw store_unavailable(
            std::string("idem: in-transaction mode: ") + std::string(detail::without_prefix(e.what())), e.sqlstate());
    }
}

Transaction::Rows Transaction::exec(std::string_view sql, const std::vector<std::optional<std::string>>& params) {
    auto& conn = *static_cast<pg::Connection*>(connection_);
    const pg::StatementDef def{"", std::string(sql), {}};
    Params p;
    for (const auto& v : params) p.text_format(v ? std::optional<std::string_view>(*v) : std::nullopt);
    const Step step{&def, &p, true, 0};
    auto res = conn.run(std::span(&step, 1), Clock::now() + timeout_);
    if (!res[0].ok())
        throw database_error("idem: transaction statement failed: " + res[0].message(), std::string(res[0].sqlstate()));
    Rows out;
    const PGresult* r = res[0].result.get();
    const char* tuples = PQcmdTuples(const_cast<PGresult*>(r));
    out.affected = tuples && *tuples ? std::strtoull(tuples, nullptr, 10) : static_cast<std::size_t>(PQntuples(r));
    for (int row = 0; row < PQntuples(r); ++row) {
        Row cells;
        for (int col = 0; col < PQnfields(r); ++col) {
            if (PQgetisnull(r, row, col)) {
                cells.emplace_back(std::nullopt);
            } else {
                cells.emplace_back(
                    std::string(PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))));
            }
        }
        out.rows.push_back(std::move(cells));
    }
    return out;
}

pg_conn* Transaction::native_handle() const noexcept { return static_cast<pg::Connection*>(connection_)->native(); }

}  // namespace idem
