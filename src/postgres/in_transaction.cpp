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
    const std::optional<std::chrono::milliseconds>& lock_wait = transaction.lock_wait;
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
    // The claim: BEGIN; claim; read, in one round trip, the transaction left open. Nothing commits
    // before the effect has run, so a pooled connection found dead (a restart or failover since its
    // last use) is simply replaced, as the other entry points do (claim_attempts in all).
    // lock_wait: the claim's INSERT alone runs under that lock_timeout (set_config, local to the
    // transaction), which is back to the session's before fn runs.
    const std::size_t shift = lock_wait ? 1 : 0;  // the claim's results move one step down
    // The decisions are pg::ClaimMachine's, as for every claim. This mode neither waits for another
    // attempt's save nor takes one over: the effect runs inside the claim's own transaction, so both
    // are off for the machine, which then answers in_progress for a key another attempt holds.
    ClaimOptions decide = options;
    decide.resume_stale = false;
    decide.wait = std::chrono::milliseconds(0);
    Claim claim;
    pg::ClaimMachine machine(claim, fence, fp, decide, m.options.claim_attempts, m.options.max_retry_after);
    using Next = pg::ClaimMachine::Next;
    // What the machine says, the transaction rolled back first when it throws.
    const auto decide_or_roll_back = [&](const auto& ask) {
        try {
            return ask();
        } catch (...) {
            rollback();
            throw;
        }
    };
    pg::Retrier broken_connections(m.options.claim_attempts, Clock::duration::zero());
    for (Next next = Next::round_trip; next == Next::round_trip;) {
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
            const Step waiting[] = {{&m.defs[pg::kBegin], &none, false},
                                    {&m.defs[pg::kLockTimeoutLocal], &wait_ms, false},
                                    {&m.defs[pg::kClaimInsert], &ins, false},
                                    {&m.defs[pg::kSelect], &sel, false},
                                    {&m.defs[pg::kLockTimeoutLocalDefault], &none, false},
                                    {&m.defs[pg::kSeqscanLocalOn], &none, true}};
            auto res = lock_wait ? m.run(**conn, waiting) : m.run(**conn, plain);
            StepResult* const failure = const_cast<StepResult*>(res.first_failure());
            if (lock_wait && failure != nullptr && failure->sqlstate() == "55P03") {
                // Another open transaction holds the key (or its table, for the read) past
                // lock_wait: answer at once.
                next = machine.on_busy();
            } else {
                // [INSERT, SELECT] as the machine reads them; any failure aborted the transaction
                // (a failed BEGIN or setting stands for the INSERT's).
                pg::StepResults two(2);
                two[0] = std::move(failure != nullptr && failure < &res[1 + shift] ? *failure : res[1 + shift]);
                two[1] = std::move(failure != nullptr && failure > &res[2 + shift] ? *failure : res[2 + shift]);
                next = decide_or_roll_back([&] { return machine.on_round_trip(two); });
            }
            if (next == Next::reclaim_expired) {
                // Past retention: claimed again inside this transaction (pg::ReclaimExpiredOp's rule).
                pg::ReclaimExpiredOp op(key, fp, fence, lease, retention);
                op.start(1);
                Params again;
                op.bind(again);
                const Step reclaim[] = {{&m.defs[pg::kSeqscanLocalDefault], &none, false},
                                        {&m.defs[pg::kReclaimExpired], &again, false},
                                        {&m.defs[pg::kSeqscanLocalOn], &none, true}};
                auto r = m.run(**conn, reclaim);
                StepResult* const f = const_cast<StepResult*>(r.first_failure());
                pg::StepResults one(1);
                one[0] = std::move(f != nullptr ? *f : r[1]);
                decide_or_roll_back([&] { return op.feed(one); });
                // Busy under lock_wait: answered at once, as for the claim's INSERT.
                next = lock_wait && op.answer() == pg::ReclaimAnswer::busy ? machine.on_busy()
                                                                           : machine.on_reclaimed(op.answer());
            }
            if (next == Next::done && machine.won()) break;
            // Not claimed (the transaction, aborted or not, is ended): answered, or tried again.
            rollback();
            if (next == Next::round_trip && machine.retrying()) {
                m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                if (machine.pause().count() > 0) {
                    conn.reset();  // back to the pool while pausing
                    std::this_thread::sleep_for(machine.pause());
                }
            }
        } catch (const pg::connection_broken&) {
            // Whatever the round trip was (the claim's or the re-claim's), nothing of it committed:
            // the claim starts again on a fresh connection.
            next = Next::round_trip;
            conn.reset();  // broken: closed as its lease ends
            const auto again = broken_connections.after_failure(std::current_exception(), "in-transaction claim",
                                                                [&m] { m.pool->suspect_idle(); });
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
            if (again.pause.count() > 0) std::this_thread::sleep_for(again.pause);
        }
    }
    if (!machine.won()) {
        TransactionOutcome out{claim.status, {}, claim.retry_after};
        if (claim.status == ClaimStatus::completed) {
            Record& record = *claim.existing;
            detail::open_result(m.options.sealing, m.options.table, key, record.fence, record.result);
            out.result = std::move(*record.result);
        }
        return out;
    }
    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);

    try {
        Transaction tx(&**conn, key, detail::answer_wait(m.options.statement_timeout, m.options.lock_timeout));
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
