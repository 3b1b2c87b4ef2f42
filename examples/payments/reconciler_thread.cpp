#include "reconciler_thread.hpp"

#include "payment.hpp"
#include "server_log.hpp"

#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace payments {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

idem::ReconcilerOptions reconciler_options(milliseconds lease) {
    idem::ReconcilerOptions options;
    options.scopes = idem::ScopeFilter::prefix(std::string(payment_scope_prefix()));
    options.lease = lease;  // a key left undecided is looked at again after this (or sooner: leave())
    return options;
}

std::string ms(milliseconds d) { return std::to_string(d.count()) + " ms"; }

// An error's first line: PostgreSQL's DETAIL lines may show a refused row's values.
std::string_view first_line(std::string_view message) { return message.substr(0, message.find('\n')); }

// What a resolver step threw, said with what it was doing; still a failure of the resolver for
// idem::Reconciler (counted, reported to the observer, the key left for a lease).
[[noreturn]] void rethrow_while(const char* doing, const DbError& e) {
    throw DbError(std::string(doing) + " failed: " + std::string(first_line(e.what())));
}

}  // namespace

ReconcilerThread::ReconcilerThread(idem::IdempotencyStore& store, FakeGateway& gateway, DatabaseClock& clock,
                                   RateLimiter* limiter, milliseconds every, milliseconds lease,
                                   milliseconds release_after)
    : store_(store),
      gateway_(gateway),
      clock_(clock),
      limiter_(limiter),
      every_(every),
      lease_(lease),
      release_after_(release_after),
      reconciler_(
          store, [this](idem::Reconciliation& r) { resolve(r); }, reconciler_options(lease)) {}

void ReconcilerThread::start() {
    thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
}

void ReconcilerThread::stop() {
    thread_.request_stop();
    if (thread_.joinable()) thread_.join();
}

void ReconcilerThread::resolve(idem::Reconciliation& r) const {
    const auto account = account_of_scope(r.key().scope());
    if (!account) {
        log("reconciler: key '", r.key().value(), "' in scope '", r.key().scope(),
            "': left: not a payment scope; stale again in ", ms(lease_));
        return;
    }
    // The age first, then the ledger: once the claim is old enough by the database's clock, no
    // charge can start any more (gateway_charge refuses it), so a ledger read after that, with
    // no charge in flight, is final however long this thread stalls in between. (Aged by the
    // database's clock, which stamped created_at: a server whose clock runs ahead would
    // release a key whose charge may still be in flight — a double charge.)
    milliseconds age{0};
    try {
        age = gateway_.age_by_database_clock(r.record().created_at);
    } catch (const DbError& e) {
        rethrow_while("reading the key's age", e);
    }
    const bool too_late = age > release_after_;
    // Read only when no charge for the key is in flight: a charge whose commit is still under
    // way would otherwise look like none (and the key be released for a second one).
    std::optional<std::vector<Charge>> settled;
    try {
        settled = gateway_.settled(r.key().value(), *account);
    } catch (const DbError& e) {
        rethrow_while("reading the ledger", e);
    }
    const std::string aged = "key " + ms(age) + " old, released from " + ms(release_after_);
    if (!settled) {
        leave(r, *account, age, "a charge is in flight (its ledger lock is held), " + aged);
        return;
    }
    const std::vector<Charge>& charges = *settled;
    if (!charges.empty()) {
        if (charges.size() > 1) {
            log("reconciler: ALERT: ", charges.size(), " gateway charges for key '", r.key().value(), "' of account ",
                *account);
        }
        const idem::Response response = charge_response(charges.front());
        log("reconciler: key '", r.key().value(), "' of account ", *account, ": charged (pay_", charges.front().id,
            "), key ", ms(age), " old: saving ", response.status);
        r.save(response);
    } else if (too_late) {
        log("reconciler: key '", r.key().value(), "' of account ", *account, ": never charged, ", aged, ": releasing");
        r.release();
    } else {
        leave(r, *account, age, "no charge yet, " + aged);
    }
}

void ReconcilerThread::leave(idem::Reconciliation& r, std::string_view account, milliseconds age,
                             std::string why) const {
    // The key was taken with a lease of lease_. Left at an age just short of release_after_, it
    // would wait that whole lease before the look that releases it: the lease is cut to end when
    // the key is old enough (1 ms past it: the age is read in whole milliseconds, floored, and a
    // key is released only once it is strictly older than release_after_).
    milliseconds stale_in = lease_;
    const milliseconds until_old_enough = release_after_ - age + 1ms;
    if (age <= release_after_ && until_old_enough < lease_) {
        try {
            store_.extend_lease(r.key(), r.fence(), until_old_enough);
            stale_in = until_old_enough;
        } catch (const std::exception& e) {
            why += "; its lease could not be cut (" + std::string(first_line(e.what())) + ")";
        }
    }
    log("reconciler: key '", r.key().value(), "' of account ", account, ": left: ", why, "; stale again in ",
        ms(stale_in));
    r.leave(std::move(why));
}

void ReconcilerThread::log_failures(const idem::Reconciler::Sweep& sweep) const {
    for (const idem::Reconciler::Failure& f : sweep.failures) {
        std::string then;
        if (f.stage == idem::Reconciler::Stage::take_over) {
            then = "not taken, listed again next sweep";
        } else if (f.backed_off) {
            then = "left alone for the reconciler's failure backoff";
        } else if (f.error_type == "lease_lost") {
            then = "another owner has the key";
        } else {
            then = "stale again in " + ms(lease_);
        }
        const auto account = account_of_scope(f.key.scope());
        log("reconciler: key '", f.key.value(), "' of account ", account ? *account : f.key.scope(),
            ": left: could not settle (", idem::to_string(f.stage), ": ", f.error_type, f.sqlstate.empty() ? "" : " ",
            f.sqlstate, ": ", first_line(f.message), "); ", then);
    }
}

void ReconcilerThread::run(const std::stop_token& stop) {
    std::mutex mutex;
    std::condition_variable_any wake;
    auto next_purge = Clock::now();
    auto next_clock = Clock::now() + 5s;
    auto previous_sweep = Clock::now();
    while (!stop.stop_requested()) {
        if (Clock::now() >= next_clock) {
            next_clock = Clock::now() + 5s;
            try {
                const auto moved = gateway_.sample_clock(clock_);
                if (moved && (*moved > 1s || *moved < -1s)) {
                    log("reconciler: the database's clock moved by ",
                        std::chrono::duration_cast<milliseconds>(*moved).count(),
                        " ms against this machine's; charge deadlines follow it");
                }
            } catch (const std::exception& e) {
                log("reconciler: reading the database's clock: ", e.what());
            }
        }
        // (How late a sweep comes under load: the gap to the previous one's start is every_ plus
        // that sweep's own time, plus what the thread waited for a core.)
        const auto began = Clock::now();
        const auto since_previous = std::chrono::duration_cast<milliseconds>(began - previous_sweep);
        previous_sweep = began;
        try {
            const auto sweep = reconciler_.run_once();
            log_failures(sweep);
            if (sweep.stale > 0) {
                log("reconciler: sweep: ", sweep.stale, " stale, ", sweep.taken, " taken: ", sweep.saved, " saved, ",
                    sweep.released, " released, ", sweep.left, " left, ", sweep.failed, " failed; started ",
                    ms(since_previous), " after the previous one, took ",
                    ms(std::chrono::duration_cast<milliseconds>(Clock::now() - began)));
            }
        } catch (const std::exception& e) {
            log("reconciler: sweep failed after ", ms(std::chrono::duration_cast<milliseconds>(Clock::now() - began)),
                ": ", first_line(e.what()), "; sweeping again in ", ms(every_));
        }
        if (limiter_ != nullptr && Clock::now() >= next_purge) {
            next_purge = Clock::now() + 10s;
            try {
                limiter_->purge();
            } catch (const std::exception& e) {
                log("reconciler: rate-limit purge: ", e.what());
            }
        }
        std::unique_lock lock(mutex);
        wake.wait_for(lock, stop, every_, [] { return false; });
    }
}

}  // namespace payments
