#include "idem/postgres_store.hpp"

#include "idem/transaction.hpp"

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

#include "../common.hpp"
#include "../resend_rules.hpp"
#include "connection.hpp"
#include "group.hpp"
#include "machine.hpp"
#include "ops.hpp"
#include "pool.hpp"
#include "record.hpp"
#include "rows.hpp"
#include "sql.hpp"

namespace idem {

using pg::Clock;
using pg::Params;
using pg::parse_record;
using pg::Step;
using pg::StepResult;

namespace {

using pg::add_claim_params;
using pg::claim_retryable;
using pg::throw_statement_error;

// The store whose in-transaction effect runs on this thread (if any): a call to that store from
// inside the effect needs a second connection while the effect's transaction holds one.
thread_local const void* in_effect_of = nullptr;

// A member's own copy of a group's exception, message and all. Each member rethrows, catches and
// destroys its exception on its own thread; an exception object, or a std::runtime_error message,
// shared between threads is reference-counted inside libstdc++, out of ThreadSanitizer's sight
// (seen: races reported on the vptr, then on the message buffer).
template <class E>
std::exception_ptr fresh(const E& x) {
    return std::make_exception_ptr(E(std::string(x.what()), std::string(x.sqlstate())));
}

std::exception_ptr own_copy(const std::exception_ptr& e) {
    if (!e) return e;
    try {
        std::rethrow_exception(e);
    } catch (const pg::connection_broken& x) {
        return fresh(x);
    } catch (const pool_timeout& x) {
        return fresh(x);
    } catch (const store_unavailable& x) {
        return fresh(x);
    } catch (const config_error& x) {
        return fresh(x);
    } catch (const database_error& x) {
        return fresh(x);
    } catch (const corrupt_record& x) {
        return fresh(x);
    } catch (const lease_lost& x) {
        return fresh(x);
    } catch (const error& x) {
        return fresh(x);
    } catch (const std::bad_alloc&) {
        return std::make_exception_ptr(std::bad_alloc());
    } catch (const std::exception& x) {
        return std::make_exception_ptr(std::runtime_error(std::string(x.what())));
    } catch (...) {
        return std::make_exception_ptr(std::runtime_error("idem: unknown exception in a claim group"));
    }
}

}  // namespace

struct PostgresStore::Impl {
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
    pg::Lease acquire() {
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
                return pool->acquire();
            } catch (const pool_timeout& e) {
                throw pool_timeout(std::string(e.what()) +
                                   "; called from inside an in-transaction effect, which holds one connection itself");
            }
        }
        return pool->acquire();
    }

    // Statistics, sharded by thread: every call bumps a counter or two, and a single shared cache
    // line would bounce between the cores on each of them. stats() adds the shards up (unsigned
    // arithmetic: a shard's fetch_sub of another shard's add still sums exactly).
    struct alignas(64) Counters {
        std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0},
            retries{0}, opened{0}, discarded{0}, claim_groups{0}, grouped_claims{0}, save_groups{0}, grouped_saves{0};
    };
    std::atomic<std::uint64_t> largest_claim_group{0}, largest_save_group{0};
    // purge_expired met a Citus-distributed table (sql.cpp, kPurgeDistributed).
    std::atomic<bool> purge_distributed{false};
    // How the table is laid out, as far as this store knows: shapes the batch and group statements
    // (docs/scale-out.md). Found on the first batch or group (one catalog query), or by inspect()
    // and distribute(); kUnknown until then.
    enum Distribution : int { kUnknown, kPlain, kByScope, kByKey };
    std::atomic<int> distribution{kUnknown};
    std::atomic<bool> citus{false};                // the citus extension is installed
    std::atomic<Clock::rep> recheck_layout_at{0};  // kPlain with Citus: ask again from then on
    std::array<Counters, 16> counter_shards;
    Counters& counters() noexcept { return counter_shards[detail::thread_index() % counter_shards.size()]; }

    Clock::time_point deadline() const {
        return Clock::now() + options.statement_timeout + options.lock_timeout + std::chrono::seconds(1);
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
        op.start(attempt);
        for (;;) {
            Params p;
            op.bind(p);
            if (op.feed(run_one(conn, op.statement(), p))) return;
        }
    }

    // Runs an operation with the store's retries (with_connection); returns it, done.
    template <class Op>
    Op& drive(const char* what, Op& op, Clock::duration keep_trying = Clock::duration::zero()) {
        with_connection(
            what, [&](pg::Connection& conn, int attempt) { run_op(conn, op, attempt); }, keep_trying);
        return op;
    }

    std::optional<Record> select(pg::Connection& conn, const Key& key) {
        pg::ReadOp op(key);
        run_op(conn, op, 1);
        return std::move(op.record());
    }

    // Runs `f` on a pooled connection; on a broken connection retries on a fresh one, up to
    // claim_attempts times in all. f(conn, attempt) gets the 1-based attempt number; attempt > 1
    // means an earlier attempt may have committed.
    //
    // Also retried: a serialization failure or deadlock (40001, 40P01) that f reports as a
    // database_error. Every caller's f sends single-statement writes and reads, each its own
    // transaction (save, release, lease, phase, take-over, purge, read, and their read-backs):
    // PostgreSQL rolled the failed statement back whole, so it is safe to send again. Under a
    // REPEATABLE READ or SERIALIZABLE database default even a one-row UPDATE can be chosen as the
    // victim, and a save must not fail for it — its effect has already run. (claim handles its own
    // conflicts; run_in_transaction does not come here.)
    template <class F>
    auto with_connection(const char* what, F&& f, Clock::duration keep_trying = Clock::duration::zero()) {
        pg::RetryPolicy retry(options.claim_attempts, keep_trying);
        for (;;) {
            try {
                pg::Lease lease = acquire();
                if constexpr (std::is_invocable_v<F, pg::Lease&, int>) {
                    return f(lease, retry.attempt());  // f may keep the connection (group commit's relay)
                } else {
                    return f(*lease, retry.attempt());
                }
            } catch (const store_unavailable& e) {
                // The retry must not pick another dead idle connection (nor the next call, when
                // this was the last attempt): before the verdict, which may throw.
                if (dynamic_cast<const pg::connection_broken*>(&e) != nullptr) pool->suspect_idle();
                const auto next = retry.after_failure(std::current_exception(), what);
                counters().retries.fetch_add(1, std::memory_order_relaxed);
                if (next.pause.count() > 0) std::this_thread::sleep_for(next.pause);
            } catch (const database_error&) {
                const auto next = retry.after_failure(std::current_exception(), what);
                counters().retries.fetch_add(1, std::memory_order_relaxed);
                if (next.pause.count() > 0) std::this_thread::sleep_for(next.pause);
            }
        }
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

    // ClaimOptions::wait (docs/design.md, "Waiting instead of 409"). Until the machine's deadline:
    // read the key again now and then (a poll, kWaitPoll: one primary-key SELECT) and, where LISTEN
    // works, wake at once on the saver's NOTIFY. Polling is what makes waiting work everywhere: a
    // pooler in transaction mode (PgBouncer) runs LISTEN on a server connection it then hands to
    // other clients, and the NOTIFY never reaches the waiter — found behind PgBouncer 1.18, where a
    // wait slept to its end. With LISTEN too, polls are the backstop: a notification that does not
    // come (a failed best-effort NOTIFY, a save through another Citus node) costs one interval at
    // most, instead of the rest of the wait. Returns what the machine decided next.
    pg::ClaimMachine::Next wait_for_save(const Key& key, pg::ClaimMachine& machine) {
        using Strategy = PostgresOptions::WaitStrategy;
        const Fence waited_for = machine.stale_fence();
        const bool pooled = session.load(std::memory_order_relaxed) == kSessionPooled;
        if (options.wait_strategy != Strategy::poll && !pooled) {
            // Listeners hold a connection while they wait: never more than pool_size - 1 of them,
            // so the owner's save always finds one. Past that, wait by polling (notify: in_progress).
            if (waiting.fetch_add(1) + 1 < options.pool_size) {
                struct Done {
                    std::atomic<std::size_t>& n;
                    ~Done() { n.fetch_sub(1); }
                } leave{waiting};
                if (auto next = listen_for_save(key, machine, waited_for)) return *next;
            } else {
                waiting.fetch_sub(1);
                if (options.wait_strategy == Strategy::notify) return machine.on_waited(false);
            }
        }
        // Polling: the connection goes back to the pool between polls.
        std::this_thread::sleep_until(machine.next_poll());
        try {
            return with_connection("wait", [&](pg::Connection& conn, int) {
                return machine.on_polled(poll_waited(conn, key, waited_for));
            });
        } catch (const pool_timeout&) {
            return machine.on_waited(false);  // no connection to look with: the key was in progress
        }
    }

    pg::StepResults poll_waited(pg::Connection& conn, const Key& key, Fence waited_for) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(waited_for);
        return run_one(conn, pg::kWaitPoll, p);
    }

    // Whether LISTEN on `conn` would be heard (wait_strategy automatic): not through a pooler. The
    // server's backend pid differs from the one libpq got at connect when a pooler (PgBouncer, any
    // pool mode) made that up; a direct session, a TCP proxy or a Citus coordinator keeps it. Asked
    // once per store (one round trip on its first wait): every connection goes the same way.
    bool own_session(pg::Connection& conn) {
        if (options.wait_strategy == PostgresOptions::WaitStrategy::notify) return true;
        int known = session.load(std::memory_order_relaxed);
        if (known == kSessionUnknown) {
            Params pid;
            pid.int4(PQbackendPID(conn.native()));
            auto res = run_one(conn, pg::kOwnSession, pid);
            if (!res[0].ok()) throw_statement_error(res[0], "wait");
            known = pg::get_bool(res[0].result.get(), 0, 0) ? kSessionOwn : kSessionPooled;
            session.store(known, std::memory_order_relaxed);
        }
        return known == kSessionOwn;
    }

    // The listening wait, on one pooled connection held throughout: LISTEN, flag the row as waited
    // for, then wake on the saver's NOTIFY, on a poll that is due (automatic; notify polls at the
    // deadline only), or at the deadline. nullopt: LISTEN is not usable here (a pooler): poll.
    std::optional<pg::ClaimMachine::Next> listen_for_save(const Key& key, pg::ClaimMachine& machine, Fence waited_for) {
        using Next = pg::ClaimMachine::Next;
        return with_connection("wait", [&](pg::Connection& conn, int) -> std::optional<Next> {
            if (!own_session(conn)) return std::nullopt;
            const std::string payload = pg::notify_payload(table, key);
            Params none, mark;
            mark.text(key.scope()).text(key.value());
            // LISTEN first: a save committed after the mark is then certain to be heard.
            const Step steps[] = {{&defs[pg::kListen], &none}, {&defs[pg::kMarkWaiter], &mark}};
            const bool polls = options.wait_strategy != PostgresOptions::WaitStrategy::notify;
            std::optional<Next> next;
            try {
                auto res = run(conn, steps);
                if (!res[0].ok()) throw_statement_error(res[0], "listen");
                if (!res[1].ok()) throw_statement_error(res[1], "wait");
                if (res[1].rows() == 0) next = machine.on_waited(true);  // no longer in progress: read it
                while (!next) {
                    const Clock::time_point until = polls ? machine.next_poll() : machine.wait_until();
                    if (conn.wait_notification(pg::kChannel, payload, until)) {
                        next = machine.on_waited(true);
                        break;
                    }
                    const Next polled = machine.on_polled(poll_waited(conn, key, waited_for));
                    if (polled != Next::wait) next = polled;
                }
            } catch (...) {
                conn.mark_broken();  // may still be listening: never pool it again
                throw;
            }
            // The answer stands whatever happens now: a connection that cannot stop listening is
            // discarded, not retried with (that would wait again).
            try {
                auto done = run_one(conn, pg::kUnlisten, none);
                if (!done[0].ok()) conn.mark_broken();
                // Drop notifications that arrived meanwhile, so the pooled connection is clean.
                conn.wait_notification(pg::kChannel, "", Clock::now());
            } catch (...) {
                conn.mark_broken();
            }
            return next;
        });
    }

    // ---- Statements for many keys: claim_batch, save_batch and groups share them ----
    // Plain PostgreSQL: one array statement for all rows. A Citus-distributed table: statements that
    // each stay on one shard (an array statement joins the table with unnest() and spans every
    // shard; measured 10-20x slower), the writes inside BEGIN/COMMIT so that they commit together.

    // The table's layout (see `distribution`); asked once per store, on a pooled connection, and
    // like a connection's set-up not counted in stats().round_trips. A failed question is not
    // remembered: the batch goes with arrays, which work everywhere, and asks next time.
    int layout(pg::Connection& conn) {
        switch (options.statement_shape) {
            case PostgresOptions::StatementShape::arrays: return kPlain;
            case PostgresOptions::StatementShape::per_scope: return kByScope;
            case PostgresOptions::StatementShape::per_key: return kByKey;
            case PostgresOptions::StatementShape::automatic: break;
        }
        const int known = distribution.load(std::memory_order_relaxed);
        // Not distributed, but Citus is there: asked again now and then (the table may be
        // distributed later, by distribute() in another process or by hand).
        if (known != kUnknown &&
            (known != kPlain || !citus.load(std::memory_order_relaxed) ||
             Clock::now().time_since_epoch().count() < recheck_layout_at.load(std::memory_order_relaxed))) {
            return known;
        }
        const auto ask = [&](pg::Stmt stmt, Params& p) {
            const Step step{&defs[stmt], &p};
            return conn.run(std::span(&step, 1), deadline());
        };
        Params none;
        auto installed = ask(pg::kCitusInstalled, none);
        if (!installed[0].ok() || installed[0].rows() != 1) return kPlain;
        int found = kPlain;
        const bool with_citus = pg::get_bool(installed[0].result.get(), 0, 0);
        if (with_citus) {
            Params p;
            p.text(table.qualified);
            auto column = ask(pg::kDistributionColumn, p);
            if (!column[0].ok()) return kPlain;
            if (column[0].rows() == 1) {
                const std::string_view c = pg::get_bytes(column[0].result.get(), 0, 0);
                found = c == "scope" ? kByScope : c == "key" ? kByKey : kPlain;
            }
        }
        citus.store(with_citus, std::memory_order_relaxed);
        recheck_layout_at.store((Clock::now() + std::chrono::seconds(60)).time_since_epoch().count(),
                                std::memory_order_relaxed);
        distribution.store(found, std::memory_order_relaxed);
        return found;
    }

    using ClaimRow = pg::ClaimRow;
    using ClaimAnswers = pg::ClaimAnswers;
    using KeyRef = pg::KeyRef;
    using SaveRow = pg::SaveRow;
    using SaveAnswers = pg::SaveAnswers;

    pg::Layout layout_of(int shape) const noexcept {
        return shape == kByScope ? pg::Layout::by_scope : shape == kByKey ? pg::Layout::by_key : pg::Layout::plain;
    }

    // The claims of a batch or a group in one round trip (pg::ClaimRowsPlan). Throws connection_broken.
    ClaimAnswers claim_rows(pg::Connection& conn, std::span<const ClaimRow> rows) {
        const pg::ClaimRowsPlan plan(defs, layout_of(layout(conn)), rows);
        return plan.read(plan.blocks() ? run_block(conn, plan.steps(), plan.segments())
                                       : run(conn, plan.steps(), plan.segments()));
    }

    // The saves of a batch or a group in one round trip (pg::SaveRowsPlan). Throws connection_broken.
    SaveAnswers save_rows(pg::Connection& conn, std::span<const SaveRow> rows) {
        const pg::SaveRowsPlan plan(defs, layout_of(layout(conn)), rows);
        return plan.read(run(conn, plan.steps(), plan.segments()));
    }

    // ---- Group commit (docs/design.md, "Group commit") ----
    // How many groups may be in flight at once, per kind (claims, saves): one, relayed (docs/design.md
    // and docs/benchmarks.md have the figures behind the choice; pool_size is at least 1).
    static constexpr std::size_t kGroupsInFlight = 1;
    std::unique_ptr<pg::Combiner> claim_groups, save_groups;

    static void note_group(std::atomic<std::uint64_t>& groups, std::atomic<std::uint64_t>& members,
                           std::atomic<std::uint64_t>& largest, std::size_t n) noexcept {
        groups.fetch_add(1, std::memory_order_relaxed);
        members.fetch_add(n, std::memory_order_relaxed);
        for (auto seen = largest.load(std::memory_order_relaxed);
             n > seen && !largest.compare_exchange_weak(seen, n, std::memory_order_relaxed);) {
        }
    }

    struct ClaimFlight;
    struct SaveFlight;

    // One claim() caller in a group. The leader writes `got` (and what goes with it) for every member
    // before Combiner::answered; the member reads it after join() returns.
    struct ClaimMember : pg::Combiner::Member {
        const Key* key;
        const Fingerprint* fp;
        Fence fence;
        std::chrono::milliseconds lease;
        std::chrono::seconds retention;
        Claim* out;  // `found`: the record read is decoded into out->existing
        enum class Got { alone, plain, won, found, absent, error } got = Got::alone;
        pg::StepResults plain;     // plain: a group of one ran today's round trip; these are its answers
        std::exception_ptr error;  // error: what the member's own call throws
        // As the leader of a relayed group: the previous leader sent it (`flight`: its answers are to
        // be read), or tried to (no flight: every member's answer is written already).
        bool relayed = false;
        std::unique_ptr<ClaimFlight> flight;
    };

    // Today's claim round trip: [INSERT, SELECT | Sync]; see PostgresStore::claim. `keep`: on one
    // plain node, the connection is kept there after the round trip (group commit relays the next
    // group on it) instead of going back to the pool.
    pg::StepResults claim_round_trip(const Key& key, const Fingerprint& fp, Fence fence,
                                     std::chrono::milliseconds lease, std::chrono::seconds retention,
                                     std::optional<pg::Lease>* keep = nullptr) {
        return with_connection("claim", [&](pg::Lease& leased, int) {
            pg::Connection& conn = *leased;
            Params ins;
            add_claim_params(ins, key, fp, fence, lease, retention);
            Params sel;
            sel.text(key.scope()).text(key.value());
            // [INSERT, SELECT | Sync]: one round trip, one implicit transaction; the claim is
            // committed when the Sync's answer arrives, which run() waits for. The SELECT is its own
            // statement, so under READ COMMITTED it takes a new snapshot and sees a conflicting
            // claim that committed while the INSERT waited for it (one statement could not: see
            // docs/design.md); under REPEATABLE READ that case is a 40001 from the INSERT, retried.
            // One Sync instead of one per statement: one send() and one transaction fewer per claim.
            // (with Citus installed, also for a table not known to be distributed: it may be by now)
            if (relay_possible(conn)) {
                const Step steps[] = {{&defs[pg::kClaimInsert], &ins, false}, {&defs[pg::kSelect], &sel}};
                pg::StepResults res = run(conn, steps);
                if (keep) keep->emplace(std::move(leased));
                return res;
            }
            // A distributed table: Citus does not take a pipeline's implicit transaction for a
            // transaction block, and commits the INSERT on its shard at once (seen: a claim whose
            // read failed left its row behind). BEGIN … COMMIT makes the INSERT commit or roll back
            // with the read, as on one node. The answers are mapped back to [INSERT, SELECT], a
            // failed BEGIN onto the INSERT, a failed COMMIT onto the SELECT (as Connection::run does).
            Params none;
            const Step steps[] = {{&defs[pg::kBegin], &none, false},
                                  {&defs[pg::kClaimInsert], &ins, false},
                                  {&defs[pg::kSelect], &sel, false},
                                  {&defs[pg::kCommit], &none, true}};
            pg::StepResults all = run_block(conn, steps);
            pg::StepResults two(2);
            two[0] = std::move(all[0].failed ? all[0] : all[1]);
            two[1] = std::move(all[3].failed ? all[3] : all[2]);
            return two;
        });
    }

    // A group's statements on their way: sent on a connection, answers not read yet. Sent by the
    // group's own leader, or relayed: by the previous group's leader, on the connection it just read
    // its own answers from, so that the server starts on this group while its leader's thread wakes
    // up. Views into the members (who wait for their answers) and into itself: never moved once sent.
    struct Flight {
        std::span<const Step> steps;
        Clock::time_point deadline;
        std::optional<pg::Lease> conn;  // while its answers are unread

        Flight() = default;
        Flight(const Flight&) = delete;
        Flight& operator=(const Flight&) = delete;
        ~Flight() {
            if (conn) (*conn)->abandon_exchange();  // unread answers: the connection is never reused
        }
        // Throws connection_broken (then nothing is in flight: `lease` is discarded, broken).
        void send(pg::Lease lease) {
            lease->send_pipeline(steps, deadline);
            conn.emplace(std::move(lease));
        }
        // The answers; `lease` gets the connection back (for the next group: it is marked broken
        // when receiving failed). Throws what receive_pipeline throws.
        pg::StepResults receive(std::optional<pg::Lease>& lease) {
            lease.emplace(std::move(*conn));
            conn.reset();
            return (*lease)->receive_pipeline(steps, deadline);
        }
    };
    struct ClaimFlight : Flight {
        std::vector<ClaimMember*> ms;  // by key: concurrent groups (and batches) lock shared keys in one order
        std::vector<ClaimRow> rows;
        std::optional<pg::ClaimRowsPlan> plan;  // two members or more: the batch statements
        Params ins, sel;                        // one member: today's [INSERT, SELECT | Sync]
        std::array<Step, 2> one;
    };

    // Whether the next group may be sent by the leader that relays it: on one plain node. A
    // distributed table's claims go in explicit blocks that may need a ROLLBACK after their answers
    // (run_block): the group's own leader sends those.
    bool relay_possible(pg::Connection& conn) {
        return layout(conn) == kPlain && !citus.load(std::memory_order_relaxed);
    }

    static void every_claim(const std::vector<pg::Combiner::Member*>& group, ClaimMember::Got got,
                            const std::exception_ptr& e = nullptr) {
        for (pg::Combiner::Member* m : group) {
            auto& c = static_cast<ClaimMember&>(*m);
            c.got = got, c.error = own_copy(e);
        }
    }

    // The members of a group in key order: concurrent groups (and batches) lock shared keys in one
    // order. Their rows, for pg::ClaimRowsPlan (views into the members).
    static std::vector<ClaimMember*> by_key(const std::vector<pg::Combiner::Member*>& group) {
        std::vector<ClaimMember*> ms;
        ms.reserve(group.size());
        for (pg::Combiner::Member* m : group) ms.push_back(static_cast<ClaimMember*>(m));
        std::sort(ms.begin(), ms.end(), [](const ClaimMember* a, const ClaimMember* b) { return *a->key < *b->key; });
        return ms;
    }
    static std::vector<ClaimRow> rows_of(const std::vector<ClaimMember*>& ms) {
        std::vector<ClaimRow> rows;
        rows.reserve(ms.size());
        for (const ClaimMember* c : ms) {
            rows.push_back({c->key->scope(), c->key->value(), c->fp->bytes(),
                            static_cast<std::int16_t>(c->fp->algorithm()), c->fence, c->lease.count(),
                            c->retention.count()});
        }
        return rows;
    }
    // Writes every member's answer from the group's (row j: ms[j]).
    static void answer_members(const ClaimAnswers& a, const std::vector<ClaimMember*>& ms) {
        for (std::size_t j = 0; j < ms.size(); ++j) {
            ClaimMember* c = ms[j];
            std::exception_ptr error;
            switch (pg::claim_member_answer(a, j, c->fence, *c->key, c->out->existing, error)) {
                case pg::MemberAnswer::alone: c->got = ClaimMember::Got::alone; break;
                case pg::MemberAnswer::won: c->got = ClaimMember::Got::won; break;
                case pg::MemberAnswer::found: c->got = ClaimMember::Got::found; break;
                case pg::MemberAnswer::absent: c->got = ClaimMember::Got::absent; break;
                case pg::MemberAnswer::error: c->got = ClaimMember::Got::error, c->error = own_copy(error); break;
            }
        }
    }

    // Sends the claims of `group` on `conn` (one plain node). On failure every member's answer is
    // written (alone: the statements may have reached the server; each member's retry with its own
    // fence recognises whatever committed) and null is returned. Never throws.
    std::unique_ptr<ClaimFlight> send_claims(const std::vector<pg::Combiner::Member*>& group, pg::Lease conn) noexcept {
        try {
            note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, group.size());
            auto f = std::make_unique<ClaimFlight>();
            f->ms = by_key(group);
            if (f->ms.size() == 1) {  // exactly today's statements
                const ClaimMember& c = *f->ms[0];
                add_claim_params(f->ins, *c.key, *c.fp, c.fence, c.lease, c.retention);
                f->sel.text(c.key->scope()).text(c.key->value());
                f->one = {Step{&defs[pg::kClaimInsert], &f->ins, false}, Step{&defs[pg::kSelect], &f->sel}};
                f->steps = f->one;
            } else {
                f->rows = rows_of(f->ms);
                // [claims | Sync | read | Sync]: the claims commit at the first Sync, the read takes
                // its own snapshot (as the single-key path's does).
                f->plan.emplace(defs, pg::Layout::plain, f->rows);
                f->steps = f->plan->steps();
            }
            f->deadline = deadline();
            counters().round_trips.fetch_add(1, std::memory_order_relaxed);
            f->send(std::move(conn));
            return f;
        } catch (const pg::connection_broken&) {
            pool->suspect_idle();
        } catch (...) {
        }
        every_claim(group, ClaimMember::Got::alone);
        return nullptr;
    }

    // Reads the answers of a flight and writes every member's. Returns the connection, for the next
    // group, unless it broke. Never throws.
    std::optional<pg::Lease> land_claims(ClaimFlight& f) noexcept {
        std::optional<pg::Lease> conn;
        try {
            pg::StepResults res = f.receive(conn);
            if (!f.plan) {
                f.ms[0]->plain = std::move(res);
                f.ms[0]->got = ClaimMember::Got::plain;
                return conn;
            }
            answer_members(f.plan->read(std::move(res)), f.ms);
            return conn;
        } catch (const pg::connection_broken&) {
            // The group may have committed before its answer was lost: each member goes again alone
            // with its own fence and recognises its row (today's reconnect-safe retry).
            pool->suspect_idle();
        } catch (...) {
        }
        for (ClaimMember* c : f.ms) c->got = ClaimMember::Got::alone, c->error = nullptr;
        return std::nullopt;
    }

    // A group's own leader sends and reads its statements. Returns the connection when the next
    // group may be relayed on it. Never throws: should anything throw all the same (out of memory),
    // every member goes alone with its fence, a retry of its own that recognises whatever the group
    // committed for it.
    std::optional<pg::Lease> answer_claim_group(const std::vector<pg::Combiner::Member*>& group) noexcept {
        try {
            if (group.size() == 1) {  // alone: exactly today's round trip
                note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, 1);
                ClaimMember& c = static_cast<ClaimMember&>(*group[0]);
                std::optional<pg::Lease> kept;
                try {
                    c.plain = claim_round_trip(*c.key, *c.fp, c.fence, c.lease, c.retention, &kept);
                    c.got = ClaimMember::Got::plain;
                } catch (...) {
                    c.got = ClaimMember::Got::error, c.error = own_copy(std::current_exception());
                }
                return kept;
            }
            std::optional<pg::Lease> conn;
            try {
                conn.emplace(acquire());
            } catch (...) {
                // Nothing was sent: each member gets what its own call would have (pool_timeout,
                // store_unavailable, config_error), without waiting for a connection once more.
                note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, group.size());
                every_claim(group, ClaimMember::Got::error, std::current_exception());
                return std::nullopt;
            }
            bool plain = false;
            try {
                plain = relay_possible(**conn);
            } catch (const pg::connection_broken&) {
                // the layout's question met a dead connection: nothing of the group was sent
                pool->suspect_idle();
                note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, group.size());
                every_claim(group, ClaimMember::Got::alone);
                return std::nullopt;
            }
            if (plain) {
                auto f = send_claims(group, std::move(*conn));
                return f ? land_claims(*f) : std::nullopt;
            }
            note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, group.size());
            const std::vector<ClaimMember*> ms = by_key(group);
            try {
                // A distributed table: one-shard segments (pg::ClaimRowsPlan), in blocks where needed.
                const std::vector<ClaimRow> rows = rows_of(ms);
                answer_members(claim_rows(**conn, rows), ms);
            } catch (const pg::connection_broken&) {
                pool->suspect_idle();
                every_claim(group, ClaimMember::Got::alone);
            }
            return std::nullopt;
        } catch (...) {
            every_claim(group, ClaimMember::Got::alone);
            return std::nullopt;
        }
    }

    // One save() caller in a group.
    struct SaveMember : pg::Combiner::Member {
        const Key* key;
        Fence fence;
        std::string_view result;
        enum class Got { alone, saved, lost } got = Got::alone;
        bool waiters = false;  // saved: someone LISTENs for this key
        bool sent = false;     // alone: the group's statement may have committed this save
        bool relayed = false;  // as for ClaimMember
        std::unique_ptr<SaveFlight> flight;
    };

    // As ClaimFlight, for saves: one UPDATE for the rows (pg::SaveRowsPlan), or today's one-row UPDATE.
    struct SaveFlight : Flight {
        std::vector<SaveMember*> sent;  // by key; a key or fence twice goes alone instead
        std::vector<SaveRow> rows;
        std::optional<pg::SaveRowsPlan> plan;
        Params one_params;
        Step one;
    };

    // Sends the saves of `group` on `conn` (any layout: a save is one statement per segment, never a
    // block). Members not sent (a key or fence twice, or a failure) are answered alone, and null is
    // returned when nothing is in flight. Never throws.
    std::unique_ptr<SaveFlight> send_saves(const std::vector<pg::Combiner::Member*>& group, pg::Lease conn) noexcept {
        std::vector<SaveMember*> ms;
        try {
            note_group(counters().save_groups, counters().grouped_saves, largest_save_group, group.size());
            ms.reserve(group.size());
            for (pg::Combiner::Member* m : group) {
                auto* v = static_cast<SaveMember*>(m);
                v->got = SaveMember::Got::alone;
                ms.push_back(v);
            }
            std::sort(ms.begin(), ms.end(), [](const SaveMember* a, const SaveMember* b) { return *a->key < *b->key; });
            auto f = std::make_unique<SaveFlight>();
            // A key or fence twice in one UPDATE would be ambiguous (one row, two answers): the second
            // goes alone, after the group, exactly as a concurrent save of it does today.
            std::unordered_set<Fence> fences;
            for (std::size_t j = 0; j < ms.size(); ++j) {
                if ((j > 0 && *ms[j]->key == *ms[j - 1]->key) || !fences.insert(ms[j]->fence).second) continue;
                f->sent.push_back(ms[j]);
            }
            if (f->sent.size() == 1) {  // alone: today's statement
                const SaveMember& v = *f->sent[0];
                f->one_params.text(v.key->scope()).text(v.key->value()).int8(v.fence).bytes(v.result);
                f->one = Step{&defs[pg::kSave], &f->one_params};
                f->steps = std::span(&f->one, 1);
                f->deadline = deadline();
            } else {
                f->rows.reserve(f->sent.size());
                for (const SaveMember* v : f->sent)
                    f->rows.push_back({v->key->scope(), v->key->value(), v->result, v->fence});
                f->plan.emplace(defs, layout_of(layout(*conn)), f->rows);
                f->steps = f->plan->steps();
                const auto segments = f->plan->segments();
                f->deadline =
                    deadline() + options.lock_timeout * static_cast<long long>(segments > 1 ? segments - 1 : 0);
            }
            for (SaveMember* v : f->sent) v->sent = true;
            counters().round_trips.fetch_add(1, std::memory_order_relaxed);
            f->send(std::move(conn));
            return f;
        } catch (const pg::connection_broken&) {
            pool->suspect_idle();
        } catch (...) {
        }
        for (SaveMember* v : ms) v->got = SaveMember::Got::alone;  // `sent` says whether it may have been saved
        return nullptr;
    }

    std::optional<pg::Lease> land_saves(SaveFlight& f) noexcept {
        std::optional<pg::Lease> conn;
        try {
            pg::StepResults res = f.receive(conn);
            if (!f.plan) {
                SaveMember& v = *f.sent[0];
                if (!res[0].ok()) return conn;  // it goes alone (40001 retried there, ...)
                v.got = SaveMember::Got::lost;  // its fence no longer owns the key
                const PGresult* r = res[0].result.get();
                if (PQntuples(r) == 1) v.got = SaveMember::Got::saved, v.waiters = pg::get_bool(r, 0, 0);
                return conn;
            }
            SaveAnswers a = f.plan->read(std::move(res));
            for (std::size_t j = 0; j < f.sent.size(); ++j) {
                SaveMember* v = f.sent[j];
                // its statement failed (nothing of it committed): it goes alone (40001 retried there, ...)
                if (a.row_failed[j]) continue;
                const auto it = a.saved.find(v->fence);
                v->got = it != a.saved.end() ? SaveMember::Got::saved : SaveMember::Got::lost;
                if (it != a.saved.end()) v->waiters = it->second;
            }
            return conn;
        } catch (const pg::connection_broken&) {
            pool->suspect_idle();
        } catch (...) {
        }
        for (SaveMember* v : f.sent) v->got = SaveMember::Got::alone;
        return std::nullopt;
    }

    // A save group's own leader sends and reads its statement. Returns the connection for the next
    // group. Never throws.
    std::optional<pg::Lease> answer_save_group(const std::vector<pg::Combiner::Member*>& group) noexcept {
        std::unique_ptr<SaveFlight> f;
        try {
            f = send_saves(group, acquire());
        } catch (...) {
            // nothing sent: each goes alone (and keeps trying for its save_retry_window)
            note_group(counters().save_groups, counters().grouped_saves, largest_save_group, group.size());
            for (pg::Combiner::Member* m : group) static_cast<SaveMember*>(m)->got = SaveMember::Got::alone;
        }
        return f ? land_saves(*f) : std::nullopt;
    }

    // A save's own round trips (today's, and what follows a group's failure): the one-row UPDATE,
    // sent again within save_retry_window. `group_sent`: a group's UPDATE may have saved it already.
    void save_alone(const Key& key, Fence fence, std::string_view result, bool group_sent) {
        pg::SaveOp op(key, fence, result, group_sent);
        if (drive("save", op, options.save_retry_window).waiters()) wake_waiters(key);
    }

    // A group's leader, start to end (claims and saves alike): its answers (reading a relayed
    // flight, or sending and reading its own statements), then the relay of the next group, then
    // its members woken. Never throws.
    template <class M>
    void lead(pg::Combiner& groups, M& me, const std::vector<pg::Combiner::Member*>& group) noexcept {
        constexpr bool claims = std::is_same_v<M, ClaimMember>;
        std::optional<pg::Lease> conn = me.flight    ? land(*me.flight)
                                        : me.relayed ? std::nullopt  // answered by the relay's failure
                                        : claims     ? answer_claim_group(group)
                                                     : answer_save_group(group);
        me.flight.reset();
        std::vector<pg::Combiner::Member*> next;
        if (groups.take_next(next)) {
            auto& lead = static_cast<M&>(*next.front());
            // Not while another caller waits for a pooled connection: the chain would keep this one
            // for as long as callers queue.
            if (conn && !(*conn)->broken() && !pool->has_waiters() && may_relay<M>(**conn)) {
                lead.relayed = true;
                if constexpr (claims) {
                    lead.flight = send_claims(next, std::move(*conn));
                } else {
                    lead.flight = send_saves(next, std::move(*conn));
                }
            }
            conn.reset();
            groups.hand_over(std::move(next));
        }
        conn.reset();
        groups.answered(group);
    }
    std::optional<pg::Lease> land(ClaimFlight& f) noexcept { return land_claims(f); }
    std::optional<pg::Lease> land(SaveFlight& f) noexcept { return land_saves(f); }
    template <class M>
    bool may_relay(pg::Connection& conn) noexcept {
        if constexpr (!std::is_same_v<M, ClaimMember>) {
            return true;  // a save group is single statements, never a block: any layout
        } else {
            try {
                return relay_possible(conn);
            } catch (...) {
                return false;  // the layout's question failed: the group's own leader sends it
            }
        }
    }
};

PostgresStore::PostgresStore(std::string conninfo, PostgresOptions options) : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    if (options.pool_size == 0) throw config_error("idem: pool_size must be at least 1");
    if (options.claim_attempts < 1) throw config_error("idem: claim_attempts must be at least 1");
    if (options.statement_timeout.count() <= 0 || options.lock_timeout.count() <= 0) {
        throw config_error("idem: statement_timeout and lock_timeout must be positive");
    }
    if (options.lock_timeout >= options.statement_timeout) {
        throw config_error("idem: lock_timeout must be shorter than statement_timeout");
    }
    if (options.default_lease.count() <= 0 || options.default_retention.count() <= 0) {
        throw config_error("idem: default_lease and default_retention must be positive");
    }
    m.table = pg::TableName::parse(options.table);
    m.defs = pg::statements(m.table);
    m.settings = pg::ConnectSettings{std::move(conninfo),       options.application_name, options.connect_timeout,
                                     options.statement_timeout, options.lock_timeout,     options.prepared_statements,
                                     options.session_options};
    m.options = std::move(options);
    // Deadlines are kept to within one tick (they are statement_timeout + lock_timeout + 1 s away).
    m.watchdog = std::make_unique<pg::Watchdog>(std::chrono::milliseconds(50));
    m.settings.watchdog = m.watchdog.get();
    m.claim_groups = std::make_unique<pg::Combiner>(Impl::kGroupsInFlight);
    m.save_groups = std::make_unique<pg::Combiner>(Impl::kGroupsInFlight);
    m.pool = std::make_unique<pg::Pool>(
        m.options.pool_size, m.options.pool_wait, m.options.health_check_after,
        [&m] { return std::make_unique<pg::Connection>(m.settings, m.defs); },
        [&m](pg::Connection& conn) {
            try {
                Params none;
                return m.run_one(conn, pg::kPing, none)[0].ok();
            } catch (const error&) {
                return false;
            }
        },
        [&m](bool opened) { (opened ? m.counters().opened : m.counters().discarded).fetch_add(1); });
}

PostgresStore::~PostgresStore() = default;

int PostgresStore::schema_version() noexcept { return pg::kSchemaVersion; }

std::string PostgresStore::schema_sql(const std::string& table) { return pg::schema_sql(pg::TableName::parse(table)); }

const PostgresOptions& PostgresStore::options() const noexcept { return impl_->options; }

std::size_t PostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

namespace {

// A plain (non-pipelined) connection of its own for DDL and catalog questions: simple-protocol
// statements, one at a time, each failure a typed idem error.
class AdminSession {
public:
    AdminSession(const pg::ConnectSettings& settings, const char* what) : what_(what) {
        const std::string timeout =
            std::to_string(std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000));
        const char* keys[] = {"dbname", "connect_timeout", "application_name", nullptr};
        const char* values[] = {settings.conninfo.c_str(), timeout.c_str(), settings.application_name.c_str(), nullptr};
        conn_.reset(PQconnectdbParams(keys, values, 1));
        if (!conn_)
            throw store_unavailable(std::string("idem: ") + what + ": out of memory creating a PostgreSQL connection");
        if (PQstatus(conn_.get()) != CONNECTION_OK) pg::throw_connect_error(PQerrorMessage(conn_.get()));
        pg::quiet_notices(conn_.get());
    }

    /// Runs one statement (text parameters $1..$n); throws config_error / store_unavailable /
    /// database_error as the SQLSTATE says.
    pg::ResultPtr exec(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::vector<const char*> args;
        for (const auto& p : params) args.push_back(p.c_str());
        pg::ResultPtr r(params.empty() ? PQexec(conn_.get(), sql.c_str())
                                       : PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(args.size()), nullptr,
                                                      args.data(), nullptr, nullptr, 0));
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
            const std::string sqlstate = state ? state : "";
            std::string msg = std::string("idem: ") + what_ + " failed: " + PQerrorMessage(conn_.get());
            while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
            if (sqlstate.empty()) throw store_unavailable(msg);  // the connection failed
            pg::throw_database_error(std::move(msg), sqlstate);
        }
        return r;
    }

    /// The first column of the first row, or nullopt for no row or NULL.
    std::optional<std::string> value(const std::string& sql, const std::vector<std::string>& params = {}) {
        auto r = exec(sql, params);
        if (PQntuples(r.get()) < 1 || PQgetisnull(r.get(), 0, 0)) return std::nullopt;
        return std::string(PQgetvalue(r.get(), 0, 0));
    }

    /// The citus extension's version in this database, or nullopt.
    std::optional<std::string> citus_version() {
        return value("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'citus'");
    }
    /// On a Citus node: whether it is a worker (its group is not the coordinator's, 0).
    bool citus_worker() { return value("SELECT groupid <> 0 FROM pg_catalog.pg_dist_local_group") == "t"; }
    /// On a Citus node: the table's distribution column, or nullopt (not distributed, or a
    /// reference / single-shard table, whose partkey is NULL).
    std::optional<std::string> distribution_column(const std::string& qualified) {
        return value(
            "SELECT pg_catalog.column_to_column_name(logicalrelid, partkey) FROM pg_catalog.pg_dist_partition "
            "WHERE logicalrelid = pg_catalog.to_regclass($1) AND partkey IS NOT NULL",
            {qualified});
    }
    void refuse_worker() {
        if (citus_version() && citus_worker()) {
            throw config_error(std::string("idem: ") + what_ +
                               ": connected to a Citus worker node; run it against the coordinator (DDL on a "
                               "worker would create tables that only that node sees)");
        }
    }

private:
    const char* what_;
    pg::ConnPtr conn_;
};

std::string table_literal(const pg::TableName& t) { return t.schema.empty() ? t.table : t.schema + "." + t.table; }

}  // namespace

void PostgresStore::ensure_schema() {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "ensure_schema");
    db.refuse_worker();
    const std::string literal = table_literal(m.table);
    db.exec("BEGIN");
    // Waits as long as it takes for a concurrent ensure_schema() (the lock below) and for the
    // table's locks, whatever lock_timeout the role carries (docs/scale-out.md has operators set
    // one for idem's statements: eight instances starting at once timed out on it).
    db.exec("SET LOCAL lock_timeout = 0");
    // Serialises concurrent ensure_schema() calls (several instances starting at once): without it,
    // two CREATE TABLE IF NOT EXISTS can still collide on the catalog's unique index. One lock for
    // every table: stores of different tables share the schema's idem_schema_version table.
    db.exec("SELECT pg_advisory_xact_lock(hashtext($1))", {"idem.ensure_schema"});
    if (!m.table.schema.empty()) db.exec("CREATE SCHEMA IF NOT EXISTS \"" + m.table.schema + "\"");
    // One statement at a time (Citus refuses multi-statement strings that carry DDL).
    for (const std::string& statement : pg::schema_statements(m.table)) db.exec(statement);
    auto r = db.exec("SELECT version FROM " + m.table.version_table + " WHERE table_name = $1", {literal});
    const int found = PQntuples(r.get()) == 1 ? std::stoi(PQgetvalue(r.get(), 0, 0)) : 0;
    if (found > pg::kSchemaVersion) {
        db.exec("ROLLBACK");
        throw config_error("idem: table " + literal + " has schema version " + std::to_string(found) +
                           ", newer than this idem (" + std::to_string(pg::kSchemaVersion) + ")");
    }
    db.exec("COMMIT");
}

void PostgresStore::distribute(DistributeBy by) {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "distribute");
    const auto version = db.citus_version();
    if (!version) {
        throw config_error(
            "idem: distribute: the citus extension is not installed in this database "
            "(CREATE EXTENSION citus on the coordinator)");
    }
    db.refuse_worker();
    const std::string column = by == DistributeBy::scope ? "scope" : "key";
    if (!db.value("SELECT pg_catalog.to_regclass($1)", {m.table.qualified})) {
        throw config_error(
            "idem: distribute: table " + table_literal(m.table) + " does not exist (call ensure_schema() first)",
            "42P01");
    }
    if (const auto current = db.distribution_column(m.table.qualified)) {
        if (*current == column) return;  // already done: idempotent
        throw config_error("idem: distribute: table " + table_literal(m.table) + " is already distributed by " +
                           *current + ", not " + column + " (undistribute_table() first to change it)");
    }
    // create_distributed_table copies existing rows into the shards; concurrent calls serialise on
    // Citus's own lock, and the loser finds the table distributed (checked again below).
    try {
        db.exec("SELECT pg_catalog.create_distributed_table($1::regclass, $2)", {m.table.qualified, column});
        // The rows were copied into the shards; their old copies stay in the coordinator's table
        // (unseen, but on disk) until this.
        db.exec("SELECT pg_catalog.truncate_local_data_after_distributing_table($1::regclass)", {m.table.qualified});
    } catch (const database_error&) {
        if (db.distribution_column(m.table.qualified) != column) throw;
    }
    m.citus.store(true, std::memory_order_relaxed);
    m.distribution.store(by == DistributeBy::scope ? Impl::kByScope : Impl::kByKey, std::memory_order_relaxed);
}

Deployment PostgresStore::inspect() {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "inspect");
    Deployment d;
    const auto version = db.citus_version();
    if (!version) {
        m.citus.store(false, std::memory_order_relaxed);
        m.distribution.store(Impl::kPlain, std::memory_order_relaxed);
        return d;
    }
    d.citus = true;
    d.citus_version = *version;
    m.citus.store(true, std::memory_order_relaxed);
    d.coordinator = !db.citus_worker();
    const auto column = db.distribution_column(m.table.qualified);
    if (column == "scope") d.distributed_by = DistributeBy::scope;
    if (column == "key") d.distributed_by = DistributeBy::key;
    m.distribution.store(!d.distributed_by                          ? Impl::kPlain
                         : *d.distributed_by == DistributeBy::scope ? Impl::kByScope
                                                                    : Impl::kByKey,
                         std::memory_order_relaxed);
    if (!d.coordinator) {
        d.warnings.push_back(
            "connected to a Citus worker node: ensure_schema() and distribute() refuse there, and "
            "ClaimOptions::wait only hears saves made through the same node");
    }
    if (!column &&
        db.value("SELECT 1 FROM pg_catalog.pg_dist_partition WHERE logicalrelid = pg_catalog.to_regclass($1)",
                 {m.table.qualified})) {
        d.warnings.push_back("table " + table_literal(m.table) +
                             " is a Citus reference or single-shard table: idem supports a table distributed by "
                             "scope or key (distribute()), or a local one");
    }
    if (column && !d.distributed_by) {
        d.warnings.push_back("table " + table_literal(m.table) + " is distributed by '" + *column +
                             "', which is neither scope nor key");
    }
    if (!d.distributed_by) return d;
    // idem's session settings (startup options) stay on the coordinator: the shards' statements run
    // with the settings of the worker sessions Citus opens, i.e. the role's and the database's.
    struct Wanted {
        const char* name;
        std::string value;
        const char* why;
    };
    const Wanted wanted[] = {
        {"lock_timeout", std::to_string(m.options.lock_timeout.count()),
         "a claim meeting an uncommitted claim of its key waits on the shard up to statement_timeout and fails "
         "as store_unavailable instead of answering in_progress"},
        {"enable_seqscan", "off",
         "cached plans of idem's key lookups on the shards may become sequential scans after an ANALYZE of "
         "a nearly empty table"},
    };
    const std::string role = db.value("SELECT current_user").value_or("<role>");
    for (const Wanted& w : wanted) {
        try {
            auto r = db.exec("SELECT nodename, nodeport, success, result FROM pg_catalog.run_command_on_workers($1)",
                             {std::string("SELECT setting FROM pg_catalog.pg_settings WHERE name = '") + w.name + "'"});
            for (int row = 0; row < PQntuples(r.get()); ++row) {
                const std::string node = std::string(PQgetvalue(r.get(), row, 0)) + ":" + PQgetvalue(r.get(), row, 1);
                const std::string got = PQgetvalue(r.get(), row, 3);
                if (std::string_view(PQgetvalue(r.get(), row, 2)) != "t") {
                    d.warnings.push_back("could not read " + std::string(w.name) + " on worker " + node + ": " + got);
                } else if (got != w.value) {
                    const std::string unit = std::string(w.name) == "lock_timeout" ? "ms" : "";
                    d.warnings.push_back("worker " + node + " runs idem's statements with " + w.name + " = " + got +
                                         unit + " (idem asks for " + w.value + unit + "): " + w.why +
                                         ". Fix, on the coordinator (Citus propagates it to the workers): "
                                         "ALTER ROLE \"" +
                                         role + "\" SET " + w.name + " = '" + w.value + unit + "'");
                }
            }
        } catch (const error& e) {
            d.warnings.push_back(std::string("could not read the workers' ") + w.name + ": " + e.what());
        }
    }
    return d;
}

Claim PostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    // One fence for every attempt: after a broken connection, the retry recognises its own claim.
    return claim_with_fence(key, fp, options, detail::new_fence());
}

Claim PostgresStore::claim_with_fence(const Key& key, const Fingerprint& fp, const ClaimOptions& options, Fence fence) {
    Impl& m = *impl_;
    m.counters().claims.fetch_add(1, std::memory_order_relaxed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    // Every path fills and returns this one object (so it is built in the caller's Claim: a
    // replay decodes its row straight into it, with no Record moved or copied on the way out).
    // The decisions are pg::ClaimMachine's (shared with idem::asio); this loop does its I/O.
    Claim out;
    const auto claim_params = [&](Params& p) { add_claim_params(p, key, fp, fence, lease, retention); };
    using Got = Impl::ClaimMember::Got;
    // Group commit takes the first attempt only (one round trip); whatever follows (retries, an
    // expired record, resume, wait) goes alone. Not from inside this store's own in-transaction
    // effect: that call must not wait behind a group (acquire() says why).
    bool grouped = m.options.group_commit && in_effect_of != &m;

    pg::ClaimMachine machine(out, fence, fp, options, m.options.claim_attempts, m.options.max_retry_after);
    auto next = pg::ClaimMachine::Next::round_trip;
    while (next != pg::ClaimMachine::Next::done) {
        switch (next) {
            case pg::ClaimMachine::Next::round_trip: {
                Got got = Got::alone;
                pg::StepResults res;
                if (grouped) {
                    grouped = false;
                    m.check_process();
                    Impl::ClaimMember me;
                    me.key = &key, me.fp = &fp, me.fence = fence, me.lease = lease, me.retention = retention,
                    me.out = &out;
                    std::vector<pg::Combiner::Member*> group;
                    const auto role = m.claim_groups->join(me, m.options.pool_wait, group);
                    if (role == pg::Combiner::Role::lead) m.lead(*m.claim_groups, me, group);
                    if (me.got == Got::error) std::rethrow_exception(me.error);
                    got = me.got;
                    // (a group's failed statement counts as an attempt: going alone after it is a retry)
                    if (got == Got::alone && role != pg::Combiner::Role::alone) {
                        m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                    }
                    if (got == Got::plain) res = std::move(me.plain);
                    if (got == Got::won) {
                        next = machine.on_won();
                        break;
                    }
                    if (got == Got::found) {
                        next = machine.on_found();
                        break;
                    }
                    if (got == Got::absent) {
                        next = machine.on_absent(false);
                        break;
                    }
                }
                if (got == Got::alone) res = m.claim_round_trip(key, fp, fence, lease, retention);
                next = machine.on_round_trip(res);
                break;
            }
            case pg::ClaimMachine::Next::reclaim_expired:
                next = machine.on_reclaimed(m.with_connection("claim (expired)", [&](pg::Connection& conn, int) {
                    Params p;
                    claim_params(p);
                    auto r = m.run_one(conn, pg::kReclaimExpired, p);
                    if (!r[0].ok()) throw_statement_error(r[0], "claim (expired)");
                    return r[0].rows() == 1;
                }));
                break;
            case pg::ClaimMachine::Next::take_over: {
                auto taken = m.take_over(key, machine.stale_fence(), fence, lease, true);
                if (taken) emit(Event::taken_over, &key);
                next = machine.on_taken_over(std::move(taken));
                break;
            }
            case pg::ClaimMachine::Next::wait: next = m.wait_for_save(key, machine); break;
            case pg::ClaimMachine::Next::done: break;
        }
        if (next == pg::ClaimMachine::Next::round_trip && machine.retrying()) {
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
            if (machine.pause().count() > 0) std::this_thread::sleep_for(machine.pause());
        }
    }
    if (machine.won()) m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
    return out;
}

void PostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    if (result.size() > m.options.max_result_bytes) {
        throw response_too_large("idem: result of " + std::to_string(result.size()) +
                                     " bytes exceeds max_result_bytes " + std::to_string(m.options.max_result_bytes),
                                 std::string(result));
    }
    m.counters().saves.fetch_add(1, std::memory_order_relaxed);
    // Group commit: the first attempt may share one UPDATE with concurrent saves (see claim()).
    bool group_sent = false;  // the group's statement may have committed this save before it failed
    if (m.options.group_commit && in_effect_of != &m) {
        m.check_process();
        Impl::SaveMember me;
        me.key = &key, me.fence = fence, me.result = result;
        std::vector<pg::Combiner::Member*> group;
        if (m.save_groups->join(me, m.options.pool_wait, group) == pg::Combiner::Role::lead)
            m.lead(*m.save_groups, me, group);
        if (me.got == Impl::SaveMember::Got::lost) {
            throw lease_lost("idem: save refused: fence " + std::to_string(fence) + " no longer owns the key");
        }
        if (me.got == Impl::SaveMember::Got::saved) {
            if (me.waiters) m.wake_waiters(key);
            return;
        }
        group_sent = me.sent;
        if (group_sent) m.counters().retries.fetch_add(1, std::memory_order_relaxed);
    }
    m.save_alone(key, fence, result, group_sent);
}

std::vector<Claim> PostgresStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                              const ClaimOptions& options) {
    Impl& m = *impl_;
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch needs one fingerprint per key");
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    std::vector<std::optional<Claim>> out(keys.size());
    // Claims won so far: released again if a later part of the batch fails, so an exception never
    // strands a claim whose effect will not run. Not a key taken over (resume_stale, `existing`
    // set): an earlier attempt's outcome is unknown there, and deleting its record (recovery point
    // included) would let the next claim run the effect again. It stays in progress, stale again
    // when our lease passes.
    const auto release_won = [&] {
        for (std::size_t i = 0; i < out.size(); ++i) {
            if (out[i] && out[i]->status == ClaimStatus::claimed && !out[i]->existing) {
                try {
                    release(keys[i], out[i]->fence);
                } catch (const error&) {
                    // stays in progress: safe (the effect did not run), the reconciler releases it
                }
            }
        }
    };
    try {
        // Chunks keep one transaction's lock count and one statement's size bounded.
        constexpr std::size_t kChunk = 1024;
        for (std::size_t begin = 0; begin < keys.size(); begin += kChunk) {
            const std::size_t n = std::min(kChunk, keys.size() - begin);
            // Claims in key order: concurrent batches that share keys lock them in the same order.
            std::vector<std::size_t> order(n);
            for (std::size_t j = 0; j < n; ++j) order[j] = begin + j;
            std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
            for (std::size_t j = 1; j < n; ++j) {
                if (keys[order[j]] == keys[order[j - 1]]) throw config_error("idem: claim_batch keys must be distinct");
            }
            std::vector<Impl::ClaimRow> rows(n);
            for (std::size_t j = 0; j < n; ++j) {
                const std::size_t i = order[j];
                rows[j] = {keys[i].scope(),     keys[i].value(),
                           fps[i].bytes(),      static_cast<std::int16_t>(fps[i].algorithm()),
                           detail::new_fence(), lease.count(),
                           retention.count()};
            }
            m.counters().claims.fetch_add(n, std::memory_order_relaxed);

            for (int failures = 0;; ++failures) {
                // [claims | Sync | read | Sync], one round trip: on one node every claim of the chunk
                // commits together (two array statements); on Citus each shard's segment on its own
                // (Impl::claim_rows).
                Impl::ClaimAnswers a = m.with_connection(
                    "claim_batch", [&](pg::Connection& conn, int) { return m.claim_rows(conn, rows); });
                if (a.write_failure >= 0 && std::all_of(a.row_failed.begin(), a.row_failed.end(),
                                                        [](bool f) { return f; })) {  // nothing committed
                    const StepResult& failed = a.res[static_cast<std::size_t>(a.write_failure)];
                    if (!claim_retryable(failed.sqlstate())) throw_statement_error(failed, "claim_batch");
                    m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                    if (failures + 1 < m.options.claim_attempts) {
                        thread_local std::minstd_rand jitter{std::random_device{}()};
                        std::this_thread::sleep_for(std::chrono::milliseconds(1 + jitter() % 20));
                        continue;
                    }
                    // Contended: settle each key on its own (each with its own bounded retries).
                    m.counters().claims.fetch_sub(n, std::memory_order_relaxed);  // claim() counts again
                    for (std::size_t j = 0; j < n; ++j) {
                        out[order[j]] = claim_with_fence(keys[order[j]], fps[order[j]], options, rows[j].fence);
                    }
                    break;
                }
                // The claims committed under their own Sync: won whatever happens to the read.
                // Recorded first, so that release_won() frees them if the batch throws later.
                std::vector<bool> inserted(n, false);
                for (std::size_t j = 0; j < n; ++j) {
                    if (!a.won.contains(rows[j].fence)) continue;
                    inserted[j] = true;
                    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                    out[order[j]] = Claim{ClaimStatus::claimed, rows[j].fence, std::nullopt, {}};
                }
                if (a.write_failure >= 0) {
                    // Some claim segments committed, others not (a distributed table: one segment
                    // per shard). A refusal that no retry heals fails the batch (release_won()
                    // frees what it won); anything else, the keys of the failed segments settle below.
                    const StepResult& failed = a.res[static_cast<std::size_t>(a.write_failure)];
                    if (!claim_retryable(failed.sqlstate())) throw_statement_error(failed, "claim_batch");
                    m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                }
                for (std::size_t j = 0; j < n; ++j) {
                    const std::size_t i = order[j];
                    if (inserted[j]) continue;  // recorded above
                    if (a.row_failed[j] || a.read_failure >= 0) {
                        // Its claim did not commit, or the read failed (a transaction of its own):
                        // the single-key path, which retries or reports the failure; if it throws,
                        // release_won() frees the claims won above.
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);  // claim() counts again
                        out[i] = claim_with_fence(keys[i], fps[i], options, rows[j].fence);
                        continue;
                    }
                    std::optional<Record> record;
                    if (auto it = a.found.find(Impl::KeyRef(rows[j].scope, rows[j].key)); it != a.found.end()) {
                        record = parse_record(it->second.first, it->second.second);
                    }
                    if (record && record->fence == rows[j].fence && record->state == RecordState::in_progress) {
                        // ours: an attempt whose answer was lost with its connection committed it
                        m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                        out[i] = Claim{ClaimStatus::claimed, rows[j].fence, std::nullopt, {}};
                        continue;
                    }
                    const ClaimStatus status = record ? classify(*record, fps[i]) : ClaimStatus::in_progress;
                    // The rare cases (a vanished row, an expired record, resume or wait requested) take
                    // the single-key path, which knows them all.
                    if (!record || record->expired ||
                        (status == ClaimStatus::in_progress && (options.resume_stale || options.wait.count() > 0))) {
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);
                        out[i] = claim_with_fence(keys[i], fps[i], options, rows[j].fence);
                        continue;
                    }
                    Claim c{status, 0, std::move(record), {}};
                    if (status == ClaimStatus::in_progress) {
                        c.retry_after = detail::retry_after_hint(
                            c.existing->lease_until, std::chrono::system_clock::now(), m.options.max_retry_after);
                    }
                    out[i] = std::move(c);
                }
                break;
            }
        }
    } catch (...) {
        release_won();
        throw;
    }
    std::vector<Claim> claims;
    claims.reserve(out.size());
    for (auto& c : out) claims.push_back(std::move(*c));
    return claims;
}

std::vector<SaveStatus> PostgresStore::save_batch(std::span<const SaveRequest> saves) {
    Impl& m = *impl_;
    std::vector<SaveStatus> statuses(saves.size(), SaveStatus::lease_lost);
    std::vector<std::size_t> order;                // positions in saves, by key
    std::unordered_map<Fence, std::size_t> index;  // fence → position in saves
    for (std::size_t i = 0; i < saves.size(); ++i) {
        if (saves[i].result.size() > m.options.max_result_bytes) {
            statuses[i] = SaveStatus::too_large;  // decided before any I/O
            continue;
        }
        order.push_back(i);
        index.emplace(saves[i].fence, i);
    }
    if (order.empty()) return statuses;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return saves[a].key < saves[b].key; });
    std::vector<Impl::SaveRow> rows;
    rows.reserve(order.size());
    for (std::size_t i : order)
        rows.push_back({saves[i].key.scope(), saves[i].key.value(), saves[i].result, saves[i].fence});
    m.counters().saves.fetch_add(rows.size(), std::memory_order_relaxed);
    std::vector<std::size_t> notify, alone;
    m.with_connection(
        "save_batch",
        [&](pg::Connection& conn, int attempt) {
            notify.clear(), alone.clear();
            // One UPDATE … FROM unnest for every result (Impl::save_rows). On Citus one statement per
            // scope or key, each committed on its own: when only some failed, the others are saved and
            // the failed rows go through save() one by one (below), which retries and re-reads.
            Impl::SaveAnswers a = m.save_rows(conn, rows);
            if (a.failure >= 0) {
                if (std::all_of(a.row_failed.begin(), a.row_failed.end(), [](bool f) { return f; })) {
                    throw_statement_error(a.res[static_cast<std::size_t>(a.failure)], "save_batch");
                }
                for (std::size_t j = 0; j < rows.size(); ++j) {
                    if (a.row_failed[j]) alone.push_back(index.at(rows[j].fence));
                }
            }
            for (auto [fence, waiters] : a.saved) {
                auto it = index.find(fence);
                if (it == index.end()) continue;
                statuses[it->second] = SaveStatus::saved;
                if (waiters) notify.push_back(it->second);
            }
            if (attempt > 1) {  // an earlier attempt of this batch may have committed before its connection broke
                for (auto [fence, i] : index) {
                    if (statuses[i] != SaveStatus::lease_lost) continue;
                    if (detail::save_landed(m.select(conn, saves[i].key), fence, saves[i].result)) {
                        statuses[i] = SaveStatus::saved;
                    }
                }
            }
        },
        m.options.save_retry_window);
    for (std::size_t i : notify) m.wake_waiters(saves[i].key);
    for (std::size_t i : alone) {
        if (statuses[i] == SaveStatus::saved) continue;              // an earlier attempt's, recognised above
        m.counters().saves.fetch_sub(1, std::memory_order_relaxed);  // save() counts again
        try {
            save(saves[i].key, saves[i].fence, saves[i].result);
            statuses[i] = SaveStatus::saved;
        } catch (const lease_lost&) {
            statuses[i] = SaveStatus::lease_lost;
        }
    }
    return statuses;
}

void PostgresStore::release(const Key& key, Fence fence) {
    Impl& m = *impl_;
    m.counters().releases.fetch_add(1, std::memory_order_relaxed);
    pg::ReleaseOp op(key, fence);
    m.drive("release", op);
}

void PostgresStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    Impl& m = *impl_;
    auto op = pg::OwnedWriteOp::extend_lease(key, fence, lease);
    m.drive(op.what(), op);
}

void PostgresStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    Impl& m = *impl_;
    auto op = pg::OwnedWriteOp::record_phase(key, fence, phase, data);
    m.drive(op.what(), op);
}

std::optional<Fence> PostgresStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                              bool new_attempt) {
    const Fence fence = detail::new_fence();
    if (!impl_->take_over(key, stale_fence, fence, lease, new_attempt)) return std::nullopt;
    emit(Event::taken_over, &key);
    return fence;
}

std::optional<Record> PostgresStore::read(const Key& key) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    pg::ReadOp op(key);
    return std::move(m.drive("read", op).record());
}

std::vector<StaleKey> PostgresStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    const pg::Stmt stmt = scopes.kind() == ScopeFilter::Kind::exact    ? pg::kListStaleInScope
                          : scopes.kind() == ScopeFilter::Kind::prefix ? pg::kListStaleScopePrefix
                                                                       : pg::kListStale;
    return m.with_connection("list_stale", [&](pg::Connection& conn, int) {
        Params p;
        p.int8(static_cast<std::int64_t>(std::min<std::size_t>(limit, INT64_MAX)));
        if (stmt != pg::kListStale) p.text(scopes.text());
        // list_stale must scan (no index separates in-progress keys): seqscan back on for it, each
        // step under its own Sync so that the reset runs even if the scan fails. Sessions without
        // idem's options (poolers) never turned it off.
        Params none;
        const bool toggle = m.options.session_options;
        const Step with_toggle[] = {
            {&m.defs[pg::kSeqscanOn], &none}, {&m.defs[stmt], &p}, {&m.defs[pg::kSeqscanDefault], &none}};
        auto res = toggle ? m.run(conn, with_toggle) : m.run_one(conn, stmt, p);
        const StepResult& listed = res[toggle ? 1 : 0];
        if (toggle && (!res[0].ok() || !res[2].ok())) conn.mark_broken();  // session state unknown
        if (!listed.ok()) throw_statement_error(listed, "list_stale");
        std::vector<StaleKey> out;
        const PGresult* r = listed.result.get();
        for (int row = 0; row < PQntuples(r); ++row) {
            Key key(std::string(pg::get_bytes(r, row, pg::kRecordColumns)),
                    std::string(pg::get_bytes(r, row, pg::kRecordColumns + 1)));
            // One row that cannot be decoded (written by a newer idem, or damaged) must not stop
            // every other stale key from being listed — and so resolved. It is left out and
            // reported with its key; its clients get corrupt_record from their own claims.
            try {
                Record record = parse_record(r, row);
                out.push_back(StaleKey{std::move(key), std::move(record)});
            } catch (const corrupt_record& e) {
                const std::string detail =
                    "list_stale: corrupt_record: " + std::string(detail::without_prefix(e.what())) +
                    " (left out of the listing)";
                emit(Event::reconcile_failed, &key, {}, 1, detail);
            }
        }
        return out;
    });
}

std::size_t PostgresStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    Impl& m = *impl_;
    if (batch_size == 0) throw config_error("idem: purge_expired batch_size must be at least 1");
    std::size_t total = 0;
    for (std::size_t batch = 0; batch < max_batches; ++batch) {
        // Each batch its own short transaction: locks are held for one batch only.
        const std::size_t deleted = m.with_connection("purge_expired", [&](pg::Connection& conn, int) {
            Params p;
            p.int8(static_cast<std::int64_t>(std::min<std::size_t>(batch_size, INT64_MAX)));
            const bool distributed = m.purge_distributed.load(std::memory_order_relaxed);
            auto res = m.run_one(conn, distributed ? pg::kPurgeDistributed : pg::kPurge, p);
            if (!distributed && res[0].failed && res[0].sqlstate() == "0A000") {
                // Citus refuses FOR UPDATE on a statement that spans shards: this table is
                // distributed. Its form without SKIP LOCKED, from now on (nothing was deleted).
                m.purge_distributed.store(true, std::memory_order_relaxed);
                res = m.run_one(conn, pg::kPurgeDistributed, p);
            }
            if (!res[0].ok()) throw_statement_error(res[0], "purge_expired");
            return static_cast<std::size_t>(std::strtoull(PQcmdTuples(res[0].result.get()), nullptr, 10));
        });
        total += deleted;
        if (deleted < batch_size) break;
    }
    if (total > 0) emit(Event::purged, nullptr, {}, total);
    return total;
}

PostgresStore::TransactionOutcome PostgresStore::run_in_transaction(
    const Key& key, const Fingerprint& fp, const ClaimOptions& options,
    const std::function<std::string(Transaction&)>& effect) {
    Impl& m = *impl_;
    // A lock wait the statement timeout cuts short would cancel the claim (57014) instead of
    // answering in_progress: refused before any I/O.
    if (options.transaction_lock_wait && *options.transaction_lock_wait >= m.options.statement_timeout) {
        throw config_error(
            "idem: ClaimOptions::transaction_lock_wait must be shorter than the store's statement_timeout");
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
    // transaction_lock_wait: the claim's INSERT alone runs under that lock_timeout (set_config,
    // local to the transaction), which is back to the session's before fn runs.
    static const pg::StatementDef set_lock_wait{"", "SELECT set_config('lock_timeout', $1, true)", {pg::oid::text}};
    static const pg::StatementDef reset_lock_wait{"", "SET LOCAL lock_timeout TO DEFAULT", {}};
    const auto& lock_wait = options.transaction_lock_wait;
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
                        throw_statement_error(*f, "claim (expired)");
                    }
                    won = r[1].rows() == 1;
                }
                if (!won) {
                    rollback();
                    if (record.expired) continue;  // someone else re-claimed it first: read again
                    const ClaimStatus status = classify(record, fp);
                    TransactionOutcome out{status, {}, {}};
                    if (status == ClaimStatus::completed) out.result = std::move(*record.result);
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
            throw response_too_large(
                "idem: result of " + std::to_string(bytes.size()) + " bytes exceeds max_result_bytes (rolled back)",
                std::move(bytes));
        }
        Params none, save;
        save.text(key.scope()).text(key.value()).int8(fence).bytes(bytes);
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

PoolStats PostgresStore::pool_stats() const { return impl_->pool->stats(); }

StoreStats PostgresStore::stats() const {
    StoreStats s;
    for (const auto& c : impl_->counter_shards) {
        s.round_trips += c.round_trips.load();
        s.claims += c.claims.load();
        s.claims_won += c.claims_won.load();
        s.saves += c.saves.load();
        s.releases += c.releases.load();
        s.reads += c.reads.load();
        s.retries += c.retries.load();
        s.connections_opened += c.opened.load();
        s.connections_discarded += c.discarded.load();
        s.claim_groups += c.claim_groups.load();
        s.grouped_claims += c.grouped_claims.load();
        s.save_groups += c.save_groups.load();
        s.grouped_saves += c.grouped_saves.load();
    }
    s.largest_claim_group = impl_->largest_claim_group.load();
    s.largest_save_group = impl_->largest_save_group.load();
    return s;
}

}  // namespace idem
