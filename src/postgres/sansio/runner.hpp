// The engine (internal): the loops that run the claim's machine and the single-key operations over
// a driver — once, for the blocking store and for idem::asio.
//
// An operation's decisions are I/O-free (ClaimMachine, the operations of ops.hpp); a driver knows
// how to send, wait and read, and nothing else. The runners here connect the two, written once as
// coroutine templates over the driver `D`: `D::Task<T>` is the driver's coroutine type —
// net::awaitable for idem::asio (a round trip suspends), pg::Immediate for the blocking store (it
// runs to completion when called). Each driver call below is co_awaited; it returns a value, or
// the driver's coroutine of it.
//
// A claim driver provides:
//   Task<std::optional<Next>> first_attempt(const ClaimCall&, ClaimMachine&)
//       the first attempt by the driver's own means (group commit, a connection taken before):
//       the machine's next step, or nullopt to send the round trip below.
//   Task<StepResults>         round_trip(const ClaimCall&)       [INSERT, SELECT], with retries
//   Op& (blocking) or Task<void>  drive(const char* what, Op&)    an operation of ops.hpp, with retries
//   Task<Next>                wait_for_save(const ClaimCall&, ClaimMachine&)   ClaimOptions::wait
//   Task<void>                pause(std::chrono::milliseconds)
//   void                      tally(Tally) and taken_over(const Key&)   counters and observer
// Thread-safety: one call runs one runner; the driver's own state says what may be shared.
#pragma once

#include <chrono>
#include <optional>

#include "idem/key.hpp"
#include "idem/store.hpp"
#include "machine.hpp"
#include "ops.hpp"
#include "params.hpp"
#include "result.hpp"

namespace idem::pg {

/// What one claim call asks for: the key, its (keyed) fingerprint, the fence of every attempt,
/// and the lease and retention of the row it writes. Refers to the caller's key and fingerprint.
struct ClaimCall {
    const Key& key;
    const Fingerprint& fp;
    Fence fence;
    std::chrono::milliseconds lease;
    std::chrono::seconds retention;
};

/// The counters a runner moves (StoreStats): a claim call, one that won its key, a retry.
enum class Tally { claim, claim_won, retry };

/// Runs one claim: asks `machine` what comes next, has the driver do it, feeds the answer back,
/// until done (the machine's Claim is then the answer). Throws what the machine or the driver
/// throws (the caller's error: store_unavailable, database_error, …).
template <class D>
typename D::template Task<void> run_claim(D& d, const ClaimCall& call, ClaimMachine& machine) {
    using Next = ClaimMachine::Next;
    d.tally(Tally::claim);
    const std::optional<Next> first = co_await d.first_attempt(call, machine);
    Next next = Next::round_trip;
    if (first) {
        next = *first;
    } else {
        StepResults res = co_await d.round_trip(call);
        next = machine.on_round_trip(res);
    }
    while (next != Next::done) {
        if (next == Next::round_trip && machine.retrying()) {
            d.tally(Tally::retry);
            if (machine.pause().count() > 0) co_await d.pause(machine.pause());
        }
        switch (next) {
            case Next::round_trip: {
                StepResults res = co_await d.round_trip(call);
                next = machine.on_round_trip(res);
                break;
            }
            case Next::reclaim_expired: {
                ReclaimExpiredOp op(call.key, call.fp, call.fence, call.lease, call.retention);
                co_await d.drive("claim (expired)", op);
                next = machine.on_reclaimed(op.answer());
                break;
            }
            case Next::take_over: {
                TakeOverOp op(call.key, machine.stale_fence(), call.fence, call.lease, /*new_attempt=*/true);
                co_await d.drive("take_over", op);
                if (op.taken()) d.taken_over(call.key);
                next = machine.on_taken_over(std::move(op.taken()));
                break;
            }
            case Next::wait: next = co_await d.wait_for_save(call, machine); break;
            case Next::done: break;
        }
    }
    if (machine.won()) d.tally(Tally::claim_won);
}

/// One attempt of an operation of ops.hpp on a connection the driver holds: its statements, one
/// at a time (`D::run_one(conn, stmt, params)` sends one and returns its answers).
template <class D, class Conn, class Op>
typename D::template Task<void> run_op(D& d, Conn& conn, Op& op, int attempt) {
    op.start(attempt);
    for (;;) {
        Params p;
        op.bind(p);
        StepResults res = co_await d.run_one(conn, op.statement(), p);
        if (op.feed(res)) co_return;
    }
}

}  // namespace idem::pg
