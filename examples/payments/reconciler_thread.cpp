#include "reconciler_thread.hpp"

#include "payment.hpp"
#include "server_log.hpp"

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

namespace payments {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

idem::ReconcilerOptions reconciler_options(milliseconds lease) {
    idem::ReconcilerOptions options;
    options.scopes = idem::ScopeFilter::prefix(std::string(payment_scope_prefix()));
    options.lease = lease;  // a key left undecided is looked at again after this
    return options;
}

}  // namespace

ReconcilerThread::ReconcilerThread(idem::IdempotencyStore& store, FakeGateway& gateway, DatabaseClock& clock,
                                   RateLimiter* limiter, milliseconds every, milliseconds lease,
                                   milliseconds release_after)
    : gateway_(gateway),
      clock_(clock),
      limiter_(limiter),
      every_(every),
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
    if (!account) return;
    // The age first, then the ledger: once the claim is old enough by the database's clock, no
    // charge can start any more (gateway_charge refuses it), so a ledger read after that, with
    // no charge in flight, is final however long this thread stalls in between. (Aged by the
    // database's clock, which stamped created_at: a server whose clock runs ahead would
    // release a key whose charge may still be in flight — a double charge.)
    const bool too_late = gateway_.age_by_database_clock(r.record().created_at) > release_after_;
    // Read only when no charge for the key is in flight: a charge whose commit is still under
    // way would otherwise look like none (and the key be released for a second one).
    const auto settled = gateway_.settled(r.key().value(), *account);  // throws: left for later
    if (!settled) return;                                              // a charge in flight: looked at again later
    const std::vector<Charge>& charges = *settled;
    if (!charges.empty()) {
        if (charges.size() > 1) {
            log("reconciler: ALERT: ", charges.size(), " gateway charges for key '", r.key().value(), "' of account ",
                *account);
        }
        const idem::Response response = charge_response(charges.front());
        log("reconciler: key '", r.key().value(), "' of account ", *account, " was charged: saving ", response.status,
            " (pay_", charges.front().id, ")");
        r.save(response);
    } else if (too_late) {
        log("reconciler: key '", r.key().value(), "' of account ", *account, " was never charged: releasing");
        r.release();
    }
}

void ReconcilerThread::run(const std::stop_token& stop) {
    std::mutex mutex;
    std::condition_variable_any wake;
    auto next_purge = Clock::now();
    auto next_clock = Clock::now() + 5s;
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
        try {
            const auto sweep = reconciler_.run_once();
            if (sweep.failed > 0) log("reconciler: ", sweep.failed, " key(s) could not be settled this time");
        } catch (const std::exception& e) {
            log("reconciler: ", e.what());
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
