#include "idem/reconciler.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "idem/errors.hpp"

namespace idem {

Reconciler::Reconciler(IdempotencyStore& store, Resolver resolver, ReconcilerOptions options)
    : store_(store), resolver_(std::move(resolver)), options_(std::move(options)) {
    if (!resolver_) throw config_error("idem: Reconciler needs a resolver");
    if (options_.batch == 0) throw config_error("idem: Reconciler batch must be at least 1");
}

Reconciler::Sweep Reconciler::run_once() {
    Sweep sweep;
    // Listing takes nothing (it works across Citus shards); take_over() on each key is the
    // router-level write that decides which reconciler handles it.
    for (const StaleKey& stale : store_.list_stale(options_.batch, options_.scopes)) {
        ++sweep.listed;
        const auto started = std::chrono::steady_clock::now();
        std::optional<Fence> fence;
        try {
            fence = store_.take_over(stale.key, stale.record.fence, options_.lease, false);
        } catch (const error&) {
            ++sweep.failed;
            continue;
        }
        if (!fence) continue;  // another reconciler, a resumed retry, or the late owner got there first
        ++sweep.taken;
        Reconciliation r(stale.key, stale.record, *fence);
        try {
            resolver_(r);
            switch (r.decision()) {
                case Reconciliation::Decision::save:
                    store_.save(stale.key, *fence, r.encoded_result());
                    ++sweep.saved;
                    break;
                case Reconciliation::Decision::release:
                    store_.release(stale.key, *fence);
                    ++sweep.released;
                    break;
                case Reconciliation::Decision::leave:
                    ++sweep.left;
                    continue;
            }
            store_.emit(Event::reconciled, &stale.key, std::chrono::steady_clock::now() - started);
        } catch (...) {
            // Left in progress; stale again when this reconciler's lease passes.
            ++sweep.failed;
        }
    }
    return sweep;
}

void Reconciler::run(std::stop_token stop, std::chrono::milliseconds interval) {
    std::mutex mutex;
    std::condition_variable_any wake;
    while (!stop.stop_requested()) {
        try {
            // A full batch means more may be waiting: sweep again at once.
            while (!stop.stop_requested() && run_once().listed >= options_.batch) {
            }
        } catch (const error&) {
            // The store is unreachable: try again next interval.
        }
        std::unique_lock lock(mutex);
        wake.wait_for(lock, stop, interval, [] { return false; });
    }
}

}  // namespace idem
