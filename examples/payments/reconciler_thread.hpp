// reconciler_thread.hpp — payments-server's reconciler: a thread of its own, with blocking
// connections, that settles keys left in progress by asking the fake gateway's ledger what happened.
#pragma once

#include "gateway.hpp"
#include "idem/reconciler.hpp"
#include "idem/store.hpp"

#include <chrono>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>

namespace payments {

// Settles keys left in progress: a claim whose lease passed belongs to a request that crashed, hung
// or met an unknown gateway outcome. idem::Reconciler lists them (this service's scope prefix only)
// and takes each one over with a fence of its own, so several instances never settle the same key
// at once and a late original attempt gets lease_lost. The gateway's ledger says what happened:
//   a charge for (account, key)  → save the response that charge deserves (201 or 402) — the same
//     bytes the request itself would have saved;
//   no charge, and too late for one to still appear (`release_after`: a request never starts a
//     charge later than its start budget after it arrived, the gateway refuses one that reaches it
//     later by the database's clock, and one in flight holds its key's lock until its commit has
//     ended: the ledger is read only while that lock is free, after the age) → release the key:
//     the client's retry runs the payment;
//   no charge yet, but one could still be on its way (none found, or one in flight) → leave it.
// A key left before it is `release_after` old is stale again the moment it reaches that age (its
// lease is cut to the time left, when that is shorter than `lease`), so the first look that can
// settle it is the next sweep after that moment, not a whole lease later. A key the ledger could
// not be read for, or whose save or release failed, waits `lease` (idem::Reconciler's rule).
// Every key it takes gets one log line per sweep: what it decided, or why it left the key (the
// key's age, the release age, the error) and when it is stale again. A sweep that found stale keys
// also logs its counts, how long after the previous sweep it started and how long it took.
// Every `every` it also samples the database's clock (every 5 s) and purges the rate limit's old
// windows (every 10 s, when `limiter` is not null). The references must outlive the thread.
class ReconcilerThread {
public:
    ReconcilerThread(idem::IdempotencyStore& store, FakeGateway& gateway, DatabaseClock& clock, RateLimiter* limiter,
                     std::chrono::milliseconds every, std::chrono::milliseconds lease,
                     std::chrono::milliseconds release_after);

    void start();
    /// Asks the thread to stop and joins it (a sweep under way ends first).
    void stop();

private:
    void resolve(idem::Reconciliation& r) const;
    // Leaves the key with `why`, first cutting its lease to the time left until it is
    // release_after old when that is shorter than lease_; logs one line.
    void leave(idem::Reconciliation& r, std::string_view account, std::chrono::milliseconds age, std::string why) const;
    void log_failures(const idem::Reconciler::Sweep& sweep) const;
    void run(const std::stop_token& stop);

    idem::IdempotencyStore& store_;
    FakeGateway& gateway_;
    DatabaseClock& clock_;
    RateLimiter* limiter_;
    std::chrono::milliseconds every_;
    std::chrono::milliseconds lease_;
    std::chrono::milliseconds release_after_;
    idem::Reconciler reconciler_;  // (after the members its resolver uses)
    std::jthread thread_;
};

}  // namespace payments
