#include "idem/asio/store.hpp"

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <algorithm>
#include <atomic>
#include <future>
#include <limits>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "../common.hpp"
#include "../postgres/group_plan.hpp"
#include "../postgres/machine.hpp"
#include "../postgres/ops.hpp"
#include "../postgres/record.hpp"
#include "../postgres/rows.hpp"
#include "../postgres/sql.hpp"
#include "connection.hpp"

namespace idem::asio {

namespace net = boost::asio;
using detail::AsyncConnection;
using pg::Clock;
using pg::Params;
using pg::Step;

namespace {

// Waits the store does for itself (a retry's pause, a poll): never cut short by the caller's
// cancellation, which async_execute_once looks at between its steps.
net::awaitable<void> pause_for(std::chrono::milliseconds d) {
    net::steady_timer timer(co_await net::this_coro::executor, d);
    boost::system::error_code ec;
    co_await timer.async_wait(
        net::bind_cancellation_slot(net::cancellation_slot(), net::redirect_error(net::use_awaitable, ec)));
}

PostgresOptions blocking_options(PostgresOptions o) {
    o.pool_size = 2;
    o.group_commit = false;
    return o;
}

}  // namespace

struct AsyncPostgresStore::Impl {
    Impl(net::any_io_executor ex, std::string conninfo, PostgresOptions opts)
        : strand(net::make_strand(ex)),
          options(std::move(opts)),
          blocking(conninfo, blocking_options(options)),  // validates the options, connects lazily
          table(pg::TableName::parse(options.table)),
          defs(pg::statements(table)),
          settings{std::move(conninfo),       options.application_name, options.connect_timeout,
                   options.statement_timeout, options.lock_timeout,     options.prepared_statements,
                   options.session_options},
          connected(strand, Clock::time_point::max()) {}

    ~Impl() {
        // On the strand, where the connections live (a loop's last completion may still be due
        // there); if the io_context never runs again, the handlers, and the connections they
        // hold, go with it.
        for (auto& c : connections) {
            net::post(strand, [c] { c->close("idem: the store was destroyed"); });
        }
    }

    AsyncPostgresStore::executor_type strand;
    const AsyncPostgresStore* owner = nullptr;  // for its observer (emit)
    PostgresOptions options;
    PostgresStore blocking;
    pg::TableName table;
    std::vector<pg::StatementDef> defs;
    pg::ConnectSettings settings;

    std::vector<std::shared_ptr<AsyncConnection>> connections;  // open (or broken, dropped on the next acquire)
    std::size_t connecting = 0;
    net::steady_timer connected;  // cancelled whenever a connection attempt ends: wakes acquire()s

    struct Counters {
        std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0},
            retries{0}, opened{0}, discarded{0}, claim_groups{0}, grouped_claims{0}, largest_claim_group{0},
            save_groups{0}, grouped_saves{0}, largest_save_group{0};
    } counters;
    static void note_group(std::atomic<std::uint64_t>& groups, std::atomic<std::uint64_t>& members,
                           std::atomic<std::uint64_t>& largest, std::size_t n) noexcept {
        groups.fetch_add(1, std::memory_order_relaxed);
        members.fetch_add(n, std::memory_order_relaxed);
        if (n > largest.load(std::memory_order_relaxed)) largest.store(n, std::memory_order_relaxed);  // (one strand)
    }
    void count(std::atomic<std::uint64_t>& c) noexcept { c.fetch_add(1, std::memory_order_relaxed); }

    Clock::time_point deadline() const {
        return Clock::now() + options.statement_timeout + options.lock_timeout + std::chrono::seconds(1);
    }

    // The open connection with the fewest requests in flight; a new one while there is room and
    // every open one is busy (so load spreads over pool_size connections, each pipelining).
    net::awaitable<std::shared_ptr<AsyncConnection>> acquire() {
        for (;;) {
            const auto end =
                std::remove_if(connections.begin(), connections.end(), [](const auto& c) { return c->broken(); });
            counters.discarded.fetch_add(static_cast<std::uint64_t>(connections.end() - end),
                                         std::memory_order_relaxed);
            connections.erase(end, connections.end());
            std::shared_ptr<AsyncConnection> best;
            for (const auto& c : connections) {
                if (!best || c->pending() < best->pending()) best = c;
            }
            const bool room = connections.size() + connecting < options.pool_size;
            if (best && (best->pending() == 0 || !room)) co_return best;
            if (room) {
                ++connecting;
                auto fresh = std::make_shared<AsyncConnection>(strand, settings, defs);
                std::exception_ptr failure;
                try {
                    co_await fresh->open();
                } catch (...) {
                    failure = std::current_exception();
                }
                --connecting;
                connected.cancel();
                if (failure) {
                    if (best && !best->broken()) co_return best;
                    std::rethrow_exception(failure);
                }
                count(counters.opened);
                connections.push_back(fresh);
                co_return fresh;
            }
            // Every slot is connecting and none is open yet: wait for one of them.
            boost::system::error_code ec;
            co_await connected.async_wait(
                net::bind_cancellation_slot(net::cancellation_slot(), net::redirect_error(net::use_awaitable, ec)));
        }
    }

    // A connection broke: the server may have restarted, and then every idle connection is dead
    // too, without knowing it (nothing arrives on an idle socket). Close them, so that the retry
    // opens a fresh one instead of meeting the next dead one (PostgresStore: Pool::suspect_idle).
    // Connections with requests in flight learn their fate from their own answers.
    void suspect_idle() noexcept {
        for (const auto& c : connections) {
            if (!c->broken() && c->pending() == 0) c->close("idem: closed after another connection of the store broke");
        }
    }

    net::awaitable<pg::StepResults> run(AsyncConnection& conn, std::span<const Step> steps) {
        count(counters.round_trips);
        co_return co_await conn.run(steps, deadline());
    }

    // The claim's round trip: [INSERT, SELECT | Sync], one implicit transaction. Where Citus is
    // installed, [BEGIN, INSERT, SELECT, COMMIT | Sync] as the blocking store does (Citus does not
    // take a pipeline's implicit transaction for a block), then [ROLLBACK | Sync]: requests of
    // other callers follow on this connection, and a failed block must not be left open for them
    // (outside a block the ROLLBACK is a warning, nothing more).
    net::awaitable<pg::StepResults> claim_round_trip(AsyncConnection& conn, const Key& key, const Fingerprint& fp,
                                                     Fence fence, std::chrono::milliseconds lease,
                                                     std::chrono::seconds retention) {
        Params ins;
        pg::add_claim_params(ins, key, fp, fence, lease, retention);
        Params sel;
        sel.text(key.scope()).text(key.value());
        if (!conn.citus()) {
            const Step steps[] = {{&defs[pg::kClaimInsert], &ins, false}, {&defs[pg::kSelect], &sel}};
            co_return co_await run(conn, steps);
        }
        Params none;
        const Step steps[] = {{&defs[pg::kBegin], &none, false},
                              {&defs[pg::kClaimInsert], &ins, false},
                              {&defs[pg::kSelect], &sel, false},
                              {&defs[pg::kCommit], &none, true},
                              {&defs[pg::kRollback], &none, true}};
        pg::StepResults all = co_await run(conn, steps);
        if (!all[4].ok() || PQtransactionStatus(conn.native()) == PQTRANS_INERROR) {
            // The block may still be open: the requests behind ours would run in it (25P02).
            conn.close("idem: a failed transaction block could not be rolled back");
        }
        pg::StepResults two(2);
        two[0] = std::move(all[0].failed ? all[0] : all[1]);
        two[1] = std::move(all[3].failed ? all[3] : all[2]);
        co_return two;
    }

    net::awaitable<pg::StepResults> run_one(AsyncConnection& conn, pg::Stmt stmt, Params& params) {
        const Step step{&defs[stmt], &params};
        co_return co_await run(conn, std::span(&step, 1));
    }

    // Runs one attempt of an operation of ops.hpp on `conn`: its statements, one at a time.
    template <class Op>
    net::awaitable<void> run_op(AsyncConnection& conn, Op& op, int attempt) {
        op.start(attempt);
        for (;;) {
            Params p;
            op.bind(p);
            if (op.feed(co_await run_one(conn, op.statement(), p))) co_return;
        }
    }

    // Runs an operation with the store's retries (with_connection); `op` is done after it.
    template <class Op>
    net::awaitable<void> drive(const char* what, Op& op, Clock::duration keep_trying = Clock::duration::zero()) {
        co_await with_connection<bool>(
            what,
            [&](AsyncConnection& conn, int attempt) -> net::awaitable<bool> {
                co_await run_op(conn, op, attempt);
                co_return true;
            },
            keep_trying);
    }

    // Runs f(conn, attempt) -> awaitable<T> on a connection; retried as PostgresStore's
    // with_connection is (pg::RetryPolicy, the same rules).
    template <class T, class F>
    net::awaitable<T> with_connection(const char* what, F f, Clock::duration keep_trying = Clock::duration::zero()) {
        pg::RetryPolicy retry(options.claim_attempts, keep_trying);
        for (;;) {
            std::exception_ptr failure;
            try {
                auto conn = co_await acquire();
                co_return co_await f(*conn, retry.attempt());
            } catch (const store_unavailable&) {
                failure = std::current_exception();
            } catch (const database_error&) {
                failure = std::current_exception();
            }
            try {
                std::rethrow_exception(failure);
            } catch (const pg::connection_broken&) {
                suspect_idle();  // before the verdict: also when this was the last attempt
            } catch (...) {
            }
            const auto next = retry.after_failure(failure, what);
            count(counters.retries);
            if (next.pause.count() > 0) co_await pause_for(next.pause);
        }
    }

    // ---- Group commit (docs/design.md, "The asynchronous path") ----
    //
    // Each request is its own transaction, and with synchronous_commit a backend waits for each
    // commit's flush before it reads the next request of its pipeline: pool_size connections give
    // at most pool_size commits per flush, however many requests wait behind them. So while
    // kInFlightPerConnection × pool_size claim transactions (and as many save transactions) are in
    // flight, further first attempts queue; each time one ends, the queue goes out as one
    // transaction (pg::ClaimRowsPlan / pg::SaveRowsPlan, the statements of PostgresStore's batches
    // and group commit), up to kLargestGroup rows. A lone request never waits: below the bound it
    // goes at once, alone, with exactly the single-key statements. Not on a Citus coordinator (the
    // table's layout is not asked here): there every request goes alone.
    static constexpr std::size_t kInFlightPerConnection = 2;
    static constexpr std::size_t kLargestGroup = 256;
    static constexpr std::size_t kLargestSaveGroupBytes = 4u << 20;
    // (in an optional, constructed in place: Boost 1.81's any_completion_handler move assignment
    // copies from an lvalue and recurses without end)
    using Wake = std::optional<net::any_completion_handler<void()>>;

    // A member: the plan's slot, and how to wake its call's coroutine.
    struct ClaimMember : pg::ClaimSlot {
        Wake wake;
    };
    struct SaveMember : pg::SaveSlot {
        Wake wake;
    };
    std::vector<ClaimMember*> claim_queue;
    std::vector<SaveMember*> save_queue;
    std::size_t claims_in_flight = 0, saves_in_flight = 0;
    bool citus_seen = false;  // a connection found Citus installed: no groups

    std::size_t in_flight_bound() const noexcept { return kInFlightPerConnection * options.pool_size; }

    template <class Member>
    net::awaitable<void> wait_in(std::vector<Member*>& queue, Member& me) {
        co_await net::async_initiate<decltype(net::use_awaitable), void()>(
            [&queue, &me](auto handler) {
                me.wake.emplace(std::move(handler));
                queue.push_back(&me);
            },
            net::use_awaitable);
    }

    template <class Member>
    void wake_all(std::vector<Member*>& group) {
        for (Member* m : group) {
            net::post(strand, [h = std::move(*m->wake)]() mutable { std::move(h)(); });
        }
    }

    // The next group: up to kLargestGroup members, and for saves up to kLargestSaveGroupBytes of
    // results (one statement of tens of megabytes would run into its own deadline); at least one.
    template <class Member>
    static std::vector<Member*> next_group(std::vector<Member*>& queue) {
        std::size_t n = std::min(queue.size(), kLargestGroup);
        if constexpr (std::is_same_v<Member, SaveMember>) {
            std::size_t bytes = 0;
            for (std::size_t i = 0; i < n; ++i) {
                bytes += queue[i]->result.size();
                if (i > 0 && bytes > kLargestSaveGroupBytes) {
                    n = i;
                    break;
                }
            }
        }
        std::vector<Member*> group(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
        queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
        return group;
    }

    void launch_groups() {
        while (claims_in_flight < in_flight_bound() && !claim_queue.empty()) {
            ++claims_in_flight;
            net::co_spawn(strand, run_claim_group(next_group(claim_queue)), net::detached);
        }
        while (saves_in_flight < in_flight_bound() && !save_queue.empty()) {
            ++saves_in_flight;
            net::co_spawn(strand, run_save_group(next_group(save_queue)), net::detached);
        }
    }

    // A claim's first round trip: alone at once while below the bound, else in the next group.
    net::awaitable<void> claim_first(ClaimMember& me) {
        if (citus_seen || (claims_in_flight < in_flight_bound() && claim_queue.empty())) {
            ++claims_in_flight;
            try {
                me.plain = co_await with_connection<pg::StepResults>("claim", [&](AsyncConnection& conn, int) {
                    return claim_round_trip(conn, *me.key, *me.fp, me.fence, me.lease, me.retention);
                });
                me.got = ClaimMember::Got::plain;
            } catch (...) {
                me.got = ClaimMember::Got::error, me.error = std::current_exception();
            }
            --claims_in_flight;
            launch_groups();
            co_return;
        }
        co_await wait_in(claim_queue, me);
    }

    static void all_alone(const std::optional<pg::ClaimGroupPlan>& plan, std::span<pg::ClaimSlot* const> slots) {
        if (plan) {
            plan->all_alone();
        } else {
            pg::answer_all(slots, pg::ClaimSlot::Got::alone);
        }
    }

    template <class Slot, class Member>
    static std::vector<Slot*> slots_of(const std::vector<Member*>& group) {
        return std::vector<Slot*>(group.begin(), group.end());
    }

    // Never throws: every member leaves with an answer, an error, or "alone" (its own call then
    // sends its own statements, with its fence, and recognises whatever the group committed).
    net::awaitable<void> run_claim_group(std::vector<ClaimMember*> group) {
        for (ClaimMember* c : group) c->got = ClaimMember::Got::alone;
        std::shared_ptr<AsyncConnection> conn;
        std::exception_ptr unreachable;
        try {
            conn = co_await acquire();
        } catch (...) {
            unreachable = std::current_exception();  // nothing sent: each gets what its own call would
        }
        const std::vector<pg::ClaimSlot*> slots = slots_of<pg::ClaimSlot>(group);
        if (unreachable) {
            pg::answer_all(slots, ClaimMember::Got::error, unreachable);
        } else if (conn->citus()) {
            citus_seen = true;  // each goes alone: the single-key statements know Citus
        } else {
            std::optional<pg::ClaimGroupPlan> plan;
            try {
                plan.emplace(defs, pg::Layout::plain, slots);
                note_group(counters.claim_groups, counters.grouped_claims, counters.largest_claim_group, group.size());
                count(counters.round_trips);
                plan->read(co_await conn->run(plan->steps(), deadline()));
            } catch (const pg::connection_broken&) {
                // The group may have committed before its answer was lost: each goes alone with its
                // fence and recognises its row.
                suspect_idle();
                all_alone(plan, slots);
            } catch (...) {
                all_alone(plan, slots);
            }
            // (a member going alone after the group's statement makes a second attempt: a retry)
            for (const ClaimMember* c : group) {
                if (c->got == ClaimMember::Got::alone) count(counters.retries);
            }
        }
        --claims_in_flight;
        wake_all(group);
        launch_groups();
    }

    // A save's first attempt: alone at once while below the bound (the caller saves by itself), else
    // in the next group. Returns false for "alone".
    net::awaitable<bool> save_first(SaveMember& me) {
        if (citus_seen || (saves_in_flight < in_flight_bound() && save_queue.empty())) co_return false;
        co_await wait_in(save_queue, me);
        co_return me.got != SaveMember::Got::alone;
    }

    net::awaitable<void> run_save_group(std::vector<SaveMember*> group) {
        for (SaveMember* m : group) m->got = SaveMember::Got::alone;
        std::shared_ptr<AsyncConnection> conn;
        bool reached = true;
        try {
            conn = co_await acquire();
        } catch (...) {
            reached = false;  // nothing sent: each goes alone (and keeps trying for its save_retry_window)
        }
        if (reached && conn->citus()) {
            citus_seen = true;
        } else if (reached) {
            std::optional<pg::SaveGroupPlan> plan;
            try {
                plan.emplace(defs, pg::Layout::plain, slots_of<pg::SaveSlot>(group));
                note_group(counters.save_groups, counters.grouped_saves, counters.largest_save_group,
                           plan->sent().size());
                count(counters.round_trips);
                plan->read(co_await conn->run(plan->steps(), deadline()));
            } catch (const pg::connection_broken&) {
                suspect_idle();
                if (plan) plan->all_alone();
            } catch (...) {
                if (plan) plan->all_alone();
            }
            if (plan) {
                for (const pg::SaveSlot* m : plan->sent()) {
                    if (m->got == SaveMember::Got::alone) count(counters.retries);
                }
            }
        }
        --saves_in_flight;
        wake_all(group);
        launch_groups();
    }

    net::awaitable<Claim> claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options_) {
        count(counters.claims);
        // One fence for every attempt: after a broken connection, the retry recognises its own claim.
        const Fence fence = idem::detail::new_fence();
        const auto lease = options_.lease.value_or(options.default_lease);
        const auto retention = options_.retention.value_or(options.default_retention);
        Claim out;
        pg::ClaimMachine machine(out, fence, fp, options_, options.claim_attempts, options.max_retry_after);
        bool first = true;
        using Next = pg::ClaimMachine::Next;
        for (Next next = Next::round_trip; next != Next::done;) {
            switch (next) {
                case Next::round_trip: {
                    if (first) {
                        // The first attempt may share a transaction with concurrent claims.
                        first = false;
                        ClaimMember me;
                        me.key = &key, me.fp = &fp, me.fence = fence, me.lease = lease, me.retention = retention;
                        me.out = &out;
                        co_await claim_first(me);
                        if (auto after = pg::after_group(machine, me)) {
                            next = *after;
                            break;
                        }
                    }
                    auto res = co_await with_connection<pg::StepResults>("claim", [&](AsyncConnection& conn, int) {
                        return claim_round_trip(conn, key, fp, fence, lease, retention);
                    });
                    next = machine.on_round_trip(res);
                    break;
                }
                case Next::reclaim_expired: {
                    const bool won = co_await with_connection<bool>(
                        "claim (expired)", [&](AsyncConnection& conn, int) -> net::awaitable<bool> {
                            Params p;
                            pg::add_claim_params(p, key, fp, fence, lease, retention);
                            auto r = co_await run_one(conn, pg::kReclaimExpired, p);
                            if (!r[0].ok()) pg::throw_statement_error(r[0], "claim (expired)");
                            co_return r[0].rows() == 1;
                        });
                    next = machine.on_reclaimed(won);
                    break;
                }
                case Next::take_over: {
                    auto taken = co_await take_over(key, machine.stale_fence(), fence, lease, true);
                    if (taken) owner->emit(Event::taken_over, &key);
                    next = machine.on_taken_over(std::move(taken));
                    break;
                }
                case Next::wait: {
                    // No LISTEN here (it would hold a connection per waiter): poll the key, 20 ms
                    // at first, then up to 200 ms apart, until the wait's end (the machine's
                    // schedule, as PostgresStore's wait_strategy poll).
                    const auto left = machine.wait_until() - Clock::now();
                    // The call's cancellation (or deadline) ends the wait: in_progress now.
                    const auto state = co_await net::this_coro::cancellation_state;
                    if (left <= Clock::duration::zero() || state.cancelled() != net::cancellation_type::none) {
                        next = machine.on_waited(false);
                        break;
                    }
                    // (rounded up: a poll due at the deadline reads after it, and so answers)
                    co_await pause_for(
                        std::chrono::ceil<std::chrono::milliseconds>(machine.next_poll() - Clock::now()));
                    next = machine.on_waited(true);
                    break;
                }
                case Next::done: break;
            }
            if (next == Next::round_trip && machine.retrying()) {
                count(counters.retries);
                if (machine.pause().count() > 0) co_await pause_for(machine.pause());
            }
        }
        if (machine.won()) count(counters.claims_won);
        co_return out;
    }

    net::awaitable<std::optional<Record>> take_over(const Key& key, Fence stale, Fence fresh,
                                                    std::chrono::milliseconds lease, bool new_attempt) {
        pg::TakeOverOp op(key, stale, fresh, lease, new_attempt);
        co_await drive("take_over", op);
        co_return std::move(op.taken());
    }

    net::awaitable<void> save(const Key& key, Fence fence, std::string_view result) {
        if (result.size() > options.max_result_bytes) {
            throw response_too_large("idem: result of " + std::to_string(result.size()) +
                                         " bytes exceeds max_result_bytes " + std::to_string(options.max_result_bytes),
                                     std::string(result));
        }
        count(counters.saves);
        SaveMember me;
        me.key = &key, me.fence = fence, me.result = result;
        bool waiters = false;
        if (co_await save_first(me) && pg::saved_by_group(me)) {
            waiters = me.waiters;
        } else {
            waiters = co_await save_alone(key, fence, result, me.sent);
        }
        if (waiters) co_await notify_waiters(key);
    }

    // A save by itself: [UPDATE | Sync], retried for save_retry_window. `resent`: a group's
    // statement may already have committed it.
    net::awaitable<bool> save_alone(const Key& key, Fence fence, std::string_view result, bool resent) {
        ++saves_in_flight;
        struct Done {
            Impl& m;
            ~Done() {
                --m.saves_in_flight;
                m.launch_groups();
            }
        } done{*this};
        pg::SaveOp op(key, fence, result, resent);
        co_await drive("save", op, options.save_retry_window);
        co_return op.waiters();
    }

    // A blocking store's caller waits for this key (ClaimOptions::wait): NOTIFY it. Best effort — a
    // waiter also wakes at its deadline and re-reads.
    net::awaitable<void> notify_waiters(const Key& key) {
        try {
            pg::NotifyOp op(table, key);
            co_await drive("notify", op);
        } catch (const error&) {
        }
    }

    net::awaitable<void> release(const Key& key, Fence fence) {
        count(counters.releases);
        pg::ReleaseOp op(key, fence);
        co_await drive("release", op);
    }

    net::awaitable<void> owned_write(pg::OwnedWriteOp op) { co_await drive(op.what(), op); }
};

// ---- AsyncPostgresStore ---------------------------------------------------------------------------------

AsyncPostgresStore::AsyncPostgresStore(net::any_io_executor executor, std::string conninfo, PostgresOptions options)
    : impl_(std::make_shared<Impl>(std::move(executor), std::move(conninfo), std::move(options))) {
    impl_->owner = this;
}

AsyncPostgresStore::~AsyncPostgresStore() = default;

AsyncPostgresStore::executor_type AsyncPostgresStore::get_executor() const noexcept { return impl_->strand; }
const PostgresOptions& AsyncPostgresStore::options() const noexcept { return impl_->options; }
PostgresStore& AsyncPostgresStore::blocking() { return impl_->blocking; }
std::size_t AsyncPostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

// Each coroutine keeps the Impl alive while it runs (a copy of impl_ in its frame).
net::awaitable<Claim> AsyncPostgresStore::co_claim(Key key, Fingerprint fp, ClaimOptions options) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_return co_await impl->claim(key, fp, options);
}

net::awaitable<void> AsyncPostgresStore::co_save(Key key, Fence fence, std::string result) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->save(key, fence, result);
}

net::awaitable<void> AsyncPostgresStore::co_release(Key key, Fence fence) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->release(key, fence);
}

net::awaitable<void> AsyncPostgresStore::co_extend_lease(Key key, Fence fence, std::chrono::milliseconds lease) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->owned_write(pg::OwnedWriteOp::extend_lease(key, fence, lease));
}

net::awaitable<void> AsyncPostgresStore::co_record_phase(Key key, Fence fence, std::string phase, std::string data) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->owned_write(pg::OwnedWriteOp::record_phase(key, fence, phase, data));
}

net::awaitable<std::optional<Fence>> AsyncPostgresStore::co_take_over(Key key, Fence stale_fence,
                                                                      std::chrono::milliseconds lease,
                                                                      bool new_attempt) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    const Fence fence = idem::detail::new_fence();
    if (!co_await impl->take_over(key, stale_fence, fence, lease, new_attempt)) co_return std::nullopt;
    emit(Event::taken_over, &key);
    co_return fence;
}

net::awaitable<std::optional<Record>> AsyncPostgresStore::co_read(Key key) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    impl->count(impl->counters.reads);
    pg::ReadOp op(key);
    co_await impl->drive("read", op);
    co_return std::move(op.record());
}

namespace {
// The blocking interface runs the asynchronous operation and waits for it on the calling thread:
// never on the store's own strand, where the operation could not run while we wait.
void refuse_on_own_executor(const AsyncPostgresStore::executor_type& strand) {
    if (strand.running_in_this_thread()) {
        throw config_error(
            "idem: a blocking call of AsyncPostgresStore was made on the store's own executor, "
            "where it would wait for itself: co_await the co_ / async_ forms there");
    }
}
}  // namespace

Claim AsyncPostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    refuse_on_own_executor(impl_->strand);
    return async_claim(key, fp, options, net::use_future).get();
}

void AsyncPostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    refuse_on_own_executor(impl_->strand);
    async_save(key, fence, std::string(result), net::use_future).get();
}

void AsyncPostgresStore::release(const Key& key, Fence fence) {
    refuse_on_own_executor(impl_->strand);
    async_release(key, fence, net::use_future).get();
}

void AsyncPostgresStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    refuse_on_own_executor(impl_->strand);
    async_extend_lease(key, fence, lease, net::use_future).get();
}

void AsyncPostgresStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    refuse_on_own_executor(impl_->strand);
    async_record_phase(key, fence, std::string(phase), std::string(data), net::use_future).get();
}

std::optional<Fence> AsyncPostgresStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                   bool new_attempt) {
    refuse_on_own_executor(impl_->strand);
    return async_take_over(key, stale_fence, lease, new_attempt, net::use_future).get();
}

std::optional<Record> AsyncPostgresStore::read(const Key& key) {
    refuse_on_own_executor(impl_->strand);
    return async_read(key, net::use_future).get();
}

std::vector<StaleKey> AsyncPostgresStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    return impl_->blocking.list_stale(limit, scopes);
}

std::size_t AsyncPostgresStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    return impl_->blocking.purge_expired(batch_size, max_batches);
}

StoreStats AsyncPostgresStore::stats() const {
    StoreStats s = impl_->blocking.stats();
    const auto& c = impl_->counters;
    const auto get = [](const std::atomic<std::uint64_t>& v) { return v.load(std::memory_order_relaxed); };
    s.round_trips += get(c.round_trips);
    s.claims += get(c.claims);
    s.claims_won += get(c.claims_won);
    s.saves += get(c.saves);
    s.releases += get(c.releases);
    s.reads += get(c.reads);
    s.retries += get(c.retries);
    s.connections_opened += get(c.opened);
    s.connections_discarded += get(c.discarded);
    s.claim_groups += get(c.claim_groups);
    s.grouped_claims += get(c.grouped_claims);
    s.largest_claim_group = std::max(s.largest_claim_group, get(c.largest_claim_group));
    s.save_groups += get(c.save_groups);
    s.grouped_saves += get(c.grouped_saves);
    s.largest_save_group = std::max(s.largest_save_group, get(c.largest_save_group));
    return s;
}

}  // namespace idem::asio
