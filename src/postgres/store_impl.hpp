// PostgresStore's state and its blocking driver (internal): the connections, the retry loop in
// which the engine's runners (sansio/runner.hpp) run the operations of ops.hpp, and the entry
// points of group commit. Shared by the files that implement PostgresStore: postgres_store.cpp
// (the single-key calls), admin.cpp (schema, distribution, inspection, stale keys, purge),
// batch.cpp (claim_batch, save_batch), in_transaction.cpp (run_in_transaction), wait.cpp
// (ClaimOptions::wait), layout.cpp (a distributed table's layout) and group_commit.cpp.
#pragma once

#include "idem/postgres_store.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <new>
#include <random>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "../process.hpp"
#include "../resend_rules.hpp"
#include "../sealed_results.hpp"
#include "../store_rules.hpp"
#include "connection.hpp"
#include "counters.hpp"
#include "group.hpp"
#include "immediate.hpp"
#include "pool.hpp"
#include "sansio/group_plan.hpp"
#include "sansio/machine.hpp"
#include "sansio/ops.hpp"
#include "sansio/record.hpp"
#include "sansio/rows.hpp"
#include "sansio/runner.hpp"
#include "sansio/sql.hpp"

namespace idem {

using pg::Clock;
using pg::Params;
using pg::parse_record;
using pg::Step;
using pg::StepResult;

using pg::add_claim_params;
using pg::claim_retryable;
using pg::throw_statement_error;

namespace pgstore {

// The store whose in-transaction effect runs on this thread (if any): a call to that store from
// inside the effect needs a second connection while the effect's transaction holds one.
inline thread_local const void* in_effect_of = nullptr;

}  // namespace pgstore

using pgstore::in_effect_of;

struct PostgresStore::Impl {
    // The coroutine type of the engine's runners (sansio/runner.hpp) on this store: blocking.
    template <class T>
    using Task = pg::Immediate<T>;

    PostgresOptions options;
    pg::ConnectSettings settings;
    pg::TableName table;
    std::vector<pg::StatementDef> defs;
    // Before the pool: connections forget() it as they close, so it must outlive them.
    std::unique_ptr<pg::Watchdog> watchdog;
    std::unique_ptr<pg::Pool> pool;

    std::atomic<std::size_t> waiting{0};  // callers listening inside wait_for_save
    // Are this store's connections sessions of their own (LISTEN heard)? See own_session().
    enum Session : int { kSessionUnknown, kSessionOwn, kSessionPooled };
    std::atomic<int> session{kSessionUnknown};
    // The process generation this store belongs to (see detail::fork_generation).
    const std::uint64_t generation = detail::fork_generation();

    ~Impl() {
        if (detail::fork_generation() == generation) return;  // the owner: the members close everything
        // A fork()ed child. The pooled connections are the parent's sessions, and the watchdog's
        // thread does not exist here (joining it, or destroying a condition variable it waited on,
        // never returns). Close this process's copies of the sockets and leak the rest, so that
        // nothing is said to the server on the parent's behalf.
        if (pool) pool->abandon_in_child();
        (void)pool.release();
        (void)watchdog.release();
    }

    /// Throws config_error when called in a fork()ed child of the process that made the store.
    void check_process() const {
        if (detail::fork_generation() != generation) {
            throw config_error(
                "idem: this PostgresStore belongs to the process that created it and cannot be used in a fork()ed "
                "child (its connections are the parent's sessions): create a new store in the child");
        }
    }

    /// A pooled connection for this store's own statements.
    // A pooled connection, waiting for one until `deadline` (default: pool_wait from now).
    pg::Lease acquire(std::optional<Clock::time_point> deadline = std::nullopt) {
        check_process();
        if (in_effect_of == this) {
            // Called from inside our own in-transaction effect, which holds a connection itself.
            if (options.pool_size == 1) {
                throw config_error(
                    "idem: PostgresStore called from inside its own in-transaction effect, whose open transaction "
                    "holds the pool's only connection (pool_size 1): run the effect's statements through its "
                    "Transaction, or give the store pool_size >= 2");
            }
            try {
                return pool->acquire(deadline);
            } catch (const pool_timeout& e) {
                throw pool_timeout(std::string(e.what()) +
                                   "; called from inside an in-transaction effect, which holds one connection itself");
            }
        }
        return pool->acquire(deadline);
    }

    // Statistics, sharded by thread (counters.hpp); stats() adds the shards up.
    std::array<pg::Counters, 16> counter_shards;
    pg::LargestGroups largest;
    // purge_expired met a Citus-distributed table (sql.cpp, kPurgeDistributed).
    std::atomic<bool> purge_distributed{false};
    // How the table is laid out, as far as this store knows: shapes the batch and group statements
    // (docs/scale-out.md). Found on the first batch or group (one catalog query), or by inspect()
    // and distribute(); `layout_known` false until then.
    std::atomic<pg::Layout> distribution{pg::Layout::plain};
    std::atomic<bool> layout_known{false};
    std::atomic<bool> citus{false};                // the citus extension is installed
    std::atomic<Clock::rep> recheck_layout_at{0};  // plain with Citus: ask again from then on
    pg::Counters& counters() noexcept { return counter_shards[detail::thread_index() % counter_shards.size()]; }

    Clock::time_point deadline() const {
        return Clock::now() + idem::detail::answer_wait(options.statement_timeout, options.lock_timeout);
    }

    pg::StepResults run(pg::Connection& conn, std::span<const Step> steps) {
        counters().round_trips.fetch_add(1, std::memory_order_relaxed);
        return conn.run(steps, deadline());
    }
    // One round trip of `segments` independent transactions, each of which may wait up to
    // lock_timeout on its own (one-shard segments on Citus): the wait for the answers grows with them.
    pg::StepResults run(pg::Connection& conn, std::span<const Step> steps, std::size_t segments) {
        counters().round_trips.fetch_add(1, std::memory_order_relaxed);
        const auto extra = options.lock_timeout * static_cast<long long>(segments > 1 ? segments - 1 : 0);
        return conn.run(steps, deadline() + extra);
    }

    // Steps that open a transaction block of their own ([BEGIN, …, COMMIT | Sync]). After a failed
    // statement, the Sync leaves an explicit block open in the failed state (unlike an implicit
    // transaction, which it ends): roll it back, or the pooled connection would answer 25P02 to
    // whoever uses it next. A connection where even that fails is discarded.
    pg::StepResults run_block(pg::Connection& conn, std::span<const Step> steps, std::size_t segments = 1) {
        pg::StepResults res = run(conn, steps, segments);
        if (PQtransactionStatus(conn.native()) != PQTRANS_IDLE) {
            Params none;
            const Step rollback{&defs[pg::kRollback], &none};
            try {
                if (!conn.run(std::span(&rollback, 1), deadline())[0].ok()) conn.mark_broken();
            } catch (const pg::connection_broken&) {
                conn.mark_broken();
            }
            if (PQtransactionStatus(conn.native()) != PQTRANS_IDLE) conn.mark_broken();
        }
        return res;
    }

    pg::StepResults run_one(pg::Connection& conn, pg::Stmt stmt, Params& params) {
        const Step step{&defs[stmt], &params};
        return run(conn, std::span(&step, 1));
    }

    // Runs one attempt of an operation of ops.hpp on `conn`: its statements, one at a time.
    template <class Op>
    void run_op(pg::Connection& conn, Op& op, int attempt) {
        pg::run_op(*this, conn, op, attempt).get();
    }

    // A first attempt's connection, taken before with_connection (free_connection): the lease, or
    // the failure to open one (an attempt that counts), or neither: with_connection acquires one,
    // waiting until `deadline` when set (a caller that has waited in a group's queue already waits
    // no longer in all than pool_wait).
    struct FirstTry {
        std::optional<pg::Lease> lease;
        std::exception_ptr failure;
        std::optional<Clock::time_point> deadline;
        bool found() const noexcept { return lease.has_value() || failure != nullptr; }
    };

    // pg::run_claim's driver on this store (postgres_store.cpp).
    struct ClaimDriver;

    // Runs an operation with the store's retries (with_connection); returns it, done.
    template <class Op>
    Op& drive(const char* what, Op& op, Clock::duration keep_trying = Clock::duration::zero(), FirstTry first = {}) {
        with_connection(
            what, [&](pg::Connection& conn, int attempt) { run_op(conn, op, attempt); }, keep_trying, std::move(first));
        return op;
    }

    std::optional<Record> select(pg::Connection& conn, const Key& key) {
        pg::ReadOp op(key);
        run_op(conn, op, 1);
        return std::move(op.record());
    }

    // Runs `f` on a pooled connection (the first attempt on `first`, when given); on a broken
    // connection retries on a fresh one, up to claim_attempts times in all. f(conn, attempt) gets
    // the 1-based attempt number; attempt > 1 means an earlier attempt may have committed.
    //
    // Also retried: a serialization failure or deadlock (40001, 40P01) that f reports as a
    // database_error. Every caller's f sends single-statement writes and reads, each its own
    // transaction (save, release, lease, phase, take-over, purge, read, and their read-backs):
    // PostgreSQL rolled the failed statement back whole, so it is safe to send again. Under a
    // REPEATABLE READ or SERIALIZABLE database default even a one-row UPDATE can be chosen as the
    // victim, and a save must not fail for it — its effect has already run. (claim handles its own
    // conflicts; run_in_transaction does not come here.)
    template <class F>
    auto with_connection(const char* what, F&& f, Clock::duration keep_trying = Clock::duration::zero(),
                         FirstTry first = {}) {
        pg::Retrier retry(options.claim_attempts, keep_trying);
        if (first.failure) {  // the first attempt already failed to open its connection
            try {
                std::rethrow_exception(first.failure);
            } catch (const store_unavailable&) {
                after_failure(retry, what);
            } catch (const database_error&) {
                after_failure(retry, what);
            }
        }
        for (;;) {
            try {
                pg::Lease lease = first.lease ? std::move(*first.lease) : acquire(first.deadline);
                first.lease.reset();
                first.deadline.reset();
                if constexpr (std::is_invocable_v<F, pg::Lease&, int>) {
                    return f(lease, retry.attempt());  // f may keep the connection (group commit's relay)
                } else {
                    return f(*lease, retry.attempt());
                }
            } catch (const store_unavailable&) {
                after_failure(retry, what);
            } catch (const database_error&) {
                after_failure(retry, what);
            }
        }
    }

    // In a catch block of with_connection: the retry policy's verdict (throws to give up), counted,
    // and its pause.
    void after_failure(pg::Retrier& retry, const char* what) {
        const auto next = retry.after_failure(std::current_exception(), what, [this] { pool->suspect_idle(); });
        counters().retries.fetch_add(1, std::memory_order_relaxed);
        if (next.pause.count() > 0) std::this_thread::sleep_for(next.pause);
    }

    // A saved key had waiters (ClaimOptions::wait): NOTIFY them from our own connection. Best
    // effort — a waiter also wakes at its deadline and re-reads.
    void wake_waiters(const Key& key) noexcept {
        try {
            pg::NotifyOp op(table, key);
            drive("notify", op);
        } catch (...) {
        }
    }

    // Gives a stale claim (fence `stale`, lease passed) the fence `fresh`. The taken-over record on
    // success. Reconnect-safe: after a broken connection, finding `fresh` in place means we won.
    std::optional<Record> take_over(const Key& key, Fence stale, Fence fresh, std::chrono::milliseconds lease,
                                    bool new_attempt) {
        pg::TakeOverOp op(key, stale, fresh, lease, new_attempt);
        return std::move(drive("take_over", op).taken());
    }

    // ClaimOptions::wait (wait.cpp; docs/design.md, "Waiting instead of 409"): until the machine's
    // deadline, polls the key and, where LISTEN works, wakes at once on the saver's NOTIFY. Returns
    // what the machine decided next.
    pg::ClaimMachine::Next wait_for_save(const Key& key, pg::ClaimMachine& machine);
    pg::StepResults poll_waited(pg::Connection& conn, const Key& key, Fence waited_for);
    // Whether LISTEN on `conn` would be heard: not through a pooler. Asked once per store.
    bool own_session(pg::Connection& conn);
    // The listening wait, on one pooled connection; nullopt: LISTEN is not usable here (poll).
    std::optional<pg::ClaimMachine::Next> listen_for_save(const Key& key, pg::ClaimMachine& machine, Fence waited_for);

    // ---- Statements for many keys: claim_batch, save_batch and groups share them ----
    // Plain PostgreSQL: one array statement for all rows. A Citus-distributed table: statements that
    // each stay on one shard (an array statement joins the table with unnest() and spans every
    // shard, through the coordinator), the writes inside BEGIN/COMMIT so that they commit together.

    // The table's layout (layout.cpp): asked once per store, on a pooled connection, and again
    // now and then while Citus is installed and the table is not distributed.
    pg::Layout layout(pg::Connection& conn);
    // Records a layout learnt by distribute() or inspect().
    void known_layout(pg::Layout l) noexcept {
        distribution.store(l, std::memory_order_relaxed);
        layout_known.store(true, std::memory_order_release);
    }

    using ClaimRow = pg::ClaimRow;
    using ClaimAnswers = pg::ClaimAnswers;
    using KeyRef = pg::KeyRef;
    using SaveRow = pg::SaveRow;
    using SaveAnswers = pg::SaveAnswers;

    // The claims of a batch or a group in one round trip (pg::ClaimRowsPlan). Throws connection_broken.
    ClaimAnswers claim_rows(pg::Connection& conn, std::span<const ClaimRow> rows) {
        const pg::ClaimRowsPlan plan(defs, layout(conn), rows);
        return plan.read(plan.blocks() ? run_block(conn, plan.steps(), plan.segments())
                                       : run(conn, plan.steps(), plan.segments()));
    }

    // The saves of a batch or a group in one round trip (pg::SaveRowsPlan). Throws connection_broken.
    SaveAnswers save_rows(pg::Connection& conn, std::span<const SaveRow> rows) {
        const pg::SaveRowsPlan plan(defs, layout(conn), rows);
        return plan.read(run(conn, plan.steps(), plan.segments()));
    }

    // ---- Group commit (group_commit.cpp; docs/design.md, "Group commit") ----
    // How many groups may be in flight at once, per kind (claims, saves): one, relayed (docs/design.md
    // and docs/benchmarks.md have the figures behind the choice; pool_size is at least 1).
    static constexpr std::size_t kGroupsInFlight = 1;
    std::unique_ptr<pg::Combiner> claim_groups, save_groups;
    struct GroupCommit;

    /// A claim's first attempt through group commit, by a caller that found no free connection
    /// and waits for one until `deadline`: `slot` gets the group's answer. False: the deadline
    /// passed in the queue and the caller left it, nothing sent for it (Got::alone).
    bool claim_in_group(pg::ClaimSlot& slot, Clock::time_point deadline);
    /// A save's first attempt through group commit, as claim_in_group.
    bool save_in_group(pg::SaveSlot& slot, Clock::time_point deadline);

    // The single-key claim round trip (pg::ClaimRoundTrip), [INSERT, SELECT | Sync] on one plain node,
    // a transaction block wherever Citus is installed (also for a table not known to be distributed:
    // it may be by now). `keep`: on one plain node, the connection is kept there after the round trip
    // (group commit relays the next group on it) instead of going back to the pool. `first`: the
    // connection for the first attempt, when the caller has one.
    pg::StepResults claim_round_trip(const Key& key, const Fingerprint& fp, Fence fence,
                                     std::chrono::milliseconds lease, std::chrono::seconds retention,
                                     std::optional<pg::Lease>* keep = nullptr, FirstTry first = {}) {
        return with_connection(
            "claim",
            [&](pg::Lease& leased, int) {
                pg::Connection& conn = *leased;
                using Shape = pg::ClaimRoundTrip::Shape;
                if (relay_possible(conn)) {
                    const pg::ClaimRoundTrip trip(defs, Shape::pipeline, key, fp, fence, lease, retention);
                    pg::StepResults res = run(conn, trip.steps());
                    if (keep) keep->emplace(std::move(leased));
                    return res;
                }
                const pg::ClaimRoundTrip trip(defs, Shape::block, key, fp, fence, lease, retention);
                return trip.answers(run_block(conn, trip.steps()));
            },
            Clock::duration::zero(), std::move(first));
    }

    // Whether the next group may be sent by the leader that relays it: on one plain node. A
    // distributed table's claims go in explicit blocks that may need a ROLLBACK after their answers
    // (run_block): the group's own leader sends those.
    bool relay_possible(pg::Connection& conn) {
        return layout(conn) == pg::Layout::plain && !citus.load(std::memory_order_relaxed);
    }

    // A save's own round trips (without group commit, and after a group's failure): the one-row UPDATE,
    // sent again within save_retry_window. `group_sent`: a group's UPDATE may have saved it already.
    // `first`: the connection for the first attempt, when the caller has one.
    void save_alone(const Key& key, Fence fence, std::string_view result, bool group_sent, FirstTry first = {}) {
        pg::SaveOp op(key, fence, result, group_sent);
        if (drive("save", op, options.save_retry_window, std::move(first)).waiters()) wake_waiters(key);
    }

    // Group commit engages only for a caller that would wait for a pooled connection: one that
    // finds a connection free goes alone on it, exactly as without group commit, so grouping never
    // costs a caller that could have gone at once (docs/design.md, "Group commit"). found() false:
    // join the group, which waits for a connection until `deadline` (pool_wait from now) for it.
    // Opening a new connection failed: the failure is the caller's first attempt, which goes on
    // alone with its retries (with_connection), as without group commit.
    FirstTry free_connection() {
        check_process();
        try {
            FirstTry out{pool->try_acquire(), nullptr, std::nullopt};
            if (!out.lease) out.deadline = Clock::now() + options.pool_wait;
            return out;
        } catch (...) {
            return FirstTry{std::nullopt, std::current_exception(), std::nullopt};
        }
    }
};

}  // namespace idem
