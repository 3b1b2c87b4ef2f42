// AsyncPostgresStore's state and its driver (internal): the non-blocking connections, the retry
// loop that runs the operations of src/postgres/sansio/ops.hpp on them, and the group commit queue's
// state. Shared by store.cpp (the public calls and the single-key operations) and group_commit.cpp
// (the queue). Everything runs on the store's strand.
#pragma once

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
#include <deque>
#include <future>
#include <limits>
#include <optional>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "../postgres/counters.hpp"
#include "../postgres/sansio/group_plan.hpp"
#include "../postgres/sansio/machine.hpp"
#include "../postgres/sansio/ops.hpp"
#include "../postgres/sansio/record.hpp"
#include "../postgres/sansio/rows.hpp"
#include "../postgres/sansio/runner.hpp"
#include "../postgres/sansio/sql.hpp"
#include "../process.hpp"
#include "../replay_rules.hpp"
#include "../sealed_results.hpp"
#include "../store_rules.hpp"
#include "connection.hpp"

namespace idem::asio {

namespace net = boost::asio;
using detail::AsyncConnection;
using pg::Clock;
using pg::Params;
using pg::Step;

namespace detail {

// Waits the store does for itself (a retry's pause, a poll): never cut short by the caller's
// cancellation, which async_execute_once looks at between its steps.
inline net::awaitable<void> pause_for(std::chrono::milliseconds d) {
    net::steady_timer timer(co_await net::this_coro::executor, d);
    boost::system::error_code ec;
    co_await timer.async_wait(
        net::bind_cancellation_slot(net::cancellation_slot(), net::redirect_error(net::use_awaitable, ec)));
}

// The options of the blocking store inside (blocking(): the schema, list_stale, purge_expired).
inline PostgresOptions blocking_options(PostgresOptions o) {
    o.pool_size = 2;
    o.group_commit = false;
    return o;
}

}  // namespace detail

using detail::blocking_options;
using detail::pause_for;

struct AsyncPostgresStore::Impl : std::enable_shared_from_this<AsyncPostgresStore::Impl> {
    // The coroutine type of the engine's runners (pg::run_claim, pg::run_op) on this store.
    template <class T>
    using Task = net::awaitable<T>;

    Impl(net::any_io_executor ex, std::string conninfo, PostgresOptions opts)
        : strand(net::make_strand(ex)),
          options(std::move(opts)),
          blocking(conninfo, blocking_options(options)),  // validates the options, connects lazily
          table(pg::TableName::parse(options.table)),
          defs(pg::statements(table, pg::generation_of(options))),
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
    // pool_stats(), read from any thread (pool_gauges.hpp); the connections keep their share.
    std::shared_ptr<detail::PoolGauges> gauges = std::make_shared<detail::PoolGauges>();
    // The requests group commit queues, for the waiters gauge: after each change to the queues.
    void publish_queued() noexcept;

    // set_replay_cache(): set from any thread, read once by each claim (atomic).
    std::atomic<std::shared_ptr<ReplayCache>> replay_cache;

    pg::Counters counters;  // (counters.hpp)
    pg::LargestGroups largest;
    static void count(std::atomic<std::uint64_t>& c) noexcept { pg::bump(c); }

    Clock::time_point deadline() const {
        return Clock::now() + idem::detail::answer_wait(options.statement_timeout, options.lock_timeout);
    }

    // The open connection with the fewest requests in flight; a new one while there is room and
    // every open one is busy (so load spreads over pool_size connections, each pipelining). A wait
    // for a connection being opened by someone else ends at `until` (store_unavailable): a save
    // bounded by save_retry_window must not queue behind connect attempts, pool_size at a time.
    net::awaitable<std::shared_ptr<AsyncConnection>> acquire(Clock::time_point until = Clock::time_point::max()) {
        gauges->acquires.fetch_add(1, std::memory_order_relaxed);
        // The time this acquire spends waiting for a connection being opened, recorded once
        // however it ends.
        struct WaitRecord {
            detail::PoolGauges& gauges;
            Clock::duration total{0};
            bool waited = false;
            ~WaitRecord() {
                if (waited) gauges.waits.record(std::chrono::duration_cast<std::chrono::nanoseconds>(total));
            }
        } waiting{*gauges};
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
                auto fresh = std::make_shared<AsyncConnection>(strand, settings, defs, gauges);
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
            // Every slot is connecting and none is open yet: wait for one of them, or until `until`
            // (a timer that wakes every waiter then; the others look again and wait on).
            if (Clock::now() >= until) {
                throw store_unavailable(
                    "idem: no connection to PostgreSQL came free within save_retry_window (every one is still "
                    "connecting)");
            }
            std::optional<net::steady_timer> alarm;
            if (until != Clock::time_point::max()) {
                alarm.emplace(strand, until);
                alarm->async_wait([this](boost::system::error_code e) {
                    if (!e) connected.cancel();
                });
            }
            boost::system::error_code ec;
            const auto began = Clock::now();
            gauges->opening_waiters.fetch_add(1, std::memory_order_relaxed);
            co_await connected.async_wait(
                net::bind_cancellation_slot(net::cancellation_slot(), net::redirect_error(net::use_awaitable, ec)));
            gauges->opening_waiters.fetch_sub(1, std::memory_order_relaxed);
            if (alarm) alarm->cancel();
            waiting.waited = true;
            waiting.total += Clock::now() - began;
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

    // The claim's round trip (pg::ClaimRoundTrip): [INSERT, SELECT | Sync]; where Citus is installed, a
    // transaction block with its ROLLBACK in the same round trip (requests of other callers follow on
    // this connection, and a failed block must not be left open for them).
    net::awaitable<pg::StepResults> claim_round_trip(AsyncConnection& conn, const Key& key, const Fingerprint& fp,
                                                     Fence fence, std::chrono::milliseconds lease,
                                                     std::chrono::seconds retention) {
        using Shape = pg::ClaimRoundTrip::Shape;
        const bool block = conn.citus();
        const pg::ClaimRoundTrip trip(defs, block ? Shape::block_then_rollback : Shape::pipeline, key, fp, fence, lease,
                                      retention);
        pg::StepResults all = co_await run(conn, trip.steps());
        if (block && (!pg::ClaimRoundTrip::rolled_back(all) || PQtransactionStatus(conn.native()) == PQTRANS_INERROR)) {
            // The block may still be open: the requests behind ours would run in it (25P02).
            conn.close("idem: a failed transaction block could not be rolled back");
        }
        co_return trip.answers(std::move(all));
    }

    net::awaitable<pg::StepResults> run_one(AsyncConnection& conn, pg::Stmt stmt, Params& params) {
        const Step step{&defs[stmt], &params};
        co_return co_await run(conn, std::span(&step, 1));
    }

    // Runs one attempt of an operation of ops.hpp on `conn`: its statements, one at a time.
    template <class Op>
    net::awaitable<void> run_op(AsyncConnection& conn, Op& op, int attempt) {
        return pg::run_op(*this, conn, op, attempt);
    }

    // Runs an operation with the store's retries (with_connection); `op` is done after it.
    template <class Op>
    // `until`: no wait for a connection lasts past it (a save's window; see acquire()).
    net::awaitable<void> drive(const char* what, Op& op, Clock::duration keep_trying = Clock::duration::zero(),
                               Clock::time_point until = Clock::time_point::max()) {
        co_await with_connection<bool>(
            what,
            [&](AsyncConnection& conn, int attempt) -> net::awaitable<bool> {
                co_await run_op(conn, op, attempt);
                co_return true;
            },
            keep_trying, until);
    }

    // Runs f(conn, attempt) -> awaitable<T> on a connection; retried as PostgresStore's
    // with_connection is (pg::Retrier, the same rules).
    // Within keep_trying, every wait for a connection ends with it too (or at `until`, if sooner).
    template <class T, class F>
    net::awaitable<T> with_connection(const char* what, F f, Clock::duration keep_trying = Clock::duration::zero(),
                                      Clock::time_point until = Clock::time_point::max()) {
        pg::Retrier retry(options.claim_attempts, keep_trying);
        if (keep_trying > Clock::duration::zero()) until = std::min(until, Clock::now() + keep_trying);
        for (;;) {
            std::exception_ptr failure;
            try {
                auto conn = co_await acquire(until);
                co_return co_await f(*conn, retry.attempt());
            } catch (const store_unavailable&) {
                failure = std::current_exception();
            } catch (const database_error&) {
                failure = std::current_exception();
            }
            const auto next = retry.after_failure(failure, what, [this] { suspect_idle(); });
            count(counters.retries);
            if (next.pause.count() > 0) co_await pause_for(next.pause);
        }
    }

    // ---- Group commit (docs/design.md, "The asynchronous path") ----
    //
    // Each request is its own transaction, and with synchronous_commit a backend waits for each
    // commit's flush before it reads the next request of its pipeline: a second transaction
    // pipelined behind a first on one connection only waits for that flush, then pays for its own.
    // And each transaction costs the server and the client a round trip and a commit whatever its
    // size. So the store grows the group it will send next rather than spreading requests over
    // transactions. While a transaction is in flight, first attempts queue (a further transaction
    // goes out only with a full group: kLargestGroup rows, or kLargestSaveGroupBytes of results;
    // none while pool_size transactions are in flight). When nothing is in flight — after the calls the last
    // transaction answered have run on, so that their next requests join — each queue goes out
    // as one transaction, claims and saves at once so that their commits share a flush
    // (pg::ClaimRowsPlan / pg::SaveRowsPlan, the statements of PostgresStore's batches and group
    // commit). The calls then move in rounds, as perfect grouping does; two transactions of
    // different phase would each wait for a flush of their own with half the rows. A transaction
    // slow for a reason of its own (a claim waiting on a row lock) holds the queues until it ends. A lone request
    // never waits: while no transaction is in flight, nothing queues and no launch is due, it goes
    // at once, alone, with exactly the single-key statements. With PostgresOptions::group_commit
    // off, at most pool_size transactions are in flight and the queue's first member goes alone
    // when one ends (give_turn). Not on a Citus coordinator (the table's layout is not asked
    // here): there every request goes alone.
    static constexpr std::size_t kLargestGroup = 256;
    static constexpr std::size_t kLargestSaveGroupBytes = 4u << 20;
    // (in an optional, constructed in place: Boost 1.81's any_completion_handler move assignment
    // copies from an lvalue and recurses without end)
    using Wake = std::optional<net::any_completion_handler<void()>>;

    // A member: the plan's slot, how to wake its call's coroutine, and whether it was woken to go
    // alone in a transaction slot counted for it (group commit off: give_turn).
    struct ClaimMember : pg::ClaimSlot {
        Wake wake;
        bool turn = false;
    };
    struct SaveMember : pg::SaveSlot {
        Wake wake;
        bool turn = false;
    };
    std::deque<ClaimMember*> claim_queue;
    std::deque<SaveMember*> save_queue;
    std::size_t claims_in_flight = 0, saves_in_flight = 0;
    bool citus_seen = false;  // a connection found Citus installed: no groups

    bool launch_pending = false;  // a launch_groups() is posted (schedule_launch)
    bool claims_next = false;     // a save group just ended: queued claims go before saves

    bool transaction_slot_free() const noexcept { return claims_in_flight + saves_in_flight < options.pool_size; }
    /// Group commit on: whether a request may go at once, alone (no transaction in flight, none
    /// queued, no launch due: the calls a transaction just answered join the next group); off: whether a transaction
    /// slot is free and nobody queues for it.
    bool may_go_alone(bool claim) const noexcept {
        if (!options.group_commit)
            return transaction_slot_free() && (!claim || claim_queue.empty()) && save_queue.empty();
        return claims_in_flight + saves_in_flight == 0 && claim_queue.empty() && save_queue.empty() && !launch_pending;
    }
    /// Whether the next group of `queue` may go out now (see "Group commit" above).
    template <class Member>
    bool may_launch(const std::deque<Member*>& queue, std::size_t in_flight) const noexcept;
    /// Runs launch_groups() once the handlers already due on the strand have run: the calls a
    /// transaction just answered (or that just started) queue their next requests first, and go
    /// out together.
    void schedule_launch();

    /// A claim's first round trip: alone at once when may_go_alone(), else in the next group
    /// (group commit off: alone, when its turn comes).
    net::awaitable<void> claim_first(ClaimMember& me);
    /// A save's first attempt: alone at once when may_go_alone() (the caller saves by itself),
    /// else in the next group (group commit off: alone, when its turn comes, `turn`). Returns
    /// false for "alone".
    net::awaitable<bool> save_first(SaveMember& me);
    /// Sends the queued members as groups when nothing is in flight, and full groups at any time,
    /// within pool_size transactions; group commit off: wakes them one at a time to go alone
    /// (give_turn).
    void launch_groups();
    template <class Member>
    void give_turn(std::deque<Member*>& queue);
    // Never throw: every member leaves with an answer, an error, or "alone" (its own call then
    // sends its own statements, with its fence, and recognises whatever the group committed).
    net::awaitable<void> run_claim_group(std::vector<ClaimMember*> group);
    net::awaitable<void> run_save_group(std::vector<SaveMember*> group);
    template <class Member>
    net::awaitable<void> wait_in(std::deque<Member*>& queue, Member& me);
    template <class Member>
    void wake_all(std::vector<Member*>& group);
    template <class Member>
    static std::size_t group_size(const std::deque<Member*>& queue) noexcept;
    template <class Member>
    static std::vector<Member*> next_group(std::deque<Member*>& queue);

    // ---- The operations (store.cpp): coroutines on the strand, behind the public co_ calls ----
    // pg::run_claim's driver on this store.
    struct ClaimDriver;
    net::awaitable<Claim> claim_on_strand(const Key& key, const Fingerprint& fp, const ClaimOptions& options_);
    net::awaitable<std::optional<Record>> take_over_on_strand(const Key& key, Fence stale, Fence fresh,
                                                              std::chrono::milliseconds lease, bool new_attempt);
    net::awaitable<void> save_on_strand(const Key& key, Fence fence, std::string_view result);
    /// A save by itself: [UPDATE | Sync], retried until `until` — the save's start plus
    /// save_retry_window — (outside the transaction bound after its first attempt failed to reach
    /// the server); no wait for a connection lasts past it. `resent`: a group's statement may
    /// already have committed it. `counted`: its transaction slot is counted already (its turn
    /// came: give_turn). Returns whether someone waits for the key.
    net::awaitable<bool> save_alone(const Key& key, Fence fence, std::string_view result, bool resent, bool counted,
                                    Clock::time_point until);
    /// A blocking store's caller waits for this key (ClaimOptions::wait): NOTIFY it. Best effort —
    /// a waiter also wakes at its deadline and re-reads.
    net::awaitable<void> notify_waiters(const Key& key);
    net::awaitable<void> release_on_strand(const Key& key, Fence fence);
    net::awaitable<void> owned_write(pg::OwnedWriteOp op) { co_await drive(op.what(), op); }
};

}  // namespace idem::asio
