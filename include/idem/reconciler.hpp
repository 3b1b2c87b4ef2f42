// idem/reconciler.hpp — resolving keys stuck in progress (the default for stale keys).
//
// A key stays in_progress to clients when its attempt crashed, hung, or met an unknown outcome
// (a provider timeout). Nobody but the service can know what really happened — so a Reconciler
// lists stale keys (lease passed), oldest first, takes each one (a new fence and a lease of its own:
// several reconcilers, on any number of instances, never handle the same key at once, and a late
// original attempt gets lease_lost) and hands it to the service's resolver, which asks the
// provider — with the same idempotency key — and then:
//
//   r.save(response)   the effect happened: store its real result; retries replay it
//   r.release()        the effect certainly did not happen: free the key; a retry runs it
//   (nothing)          not known yet: left in progress, listed again once this lease passes
//
//   idem::ReconcilerOptions options;
//   options.scopes = idem::ScopeFilter::prefix("acct:");   // or exact("acct_42"), or all()
//   idem::Reconciler reconciler(store, [&](idem::Reconciliation& r) {
//       if (auto charge = gateway.find(r.key().value())) r.save(idem::Response{201, charge->json()});
//       else if (gateway.certainly_absent(r.key().value())) r.release();
//   }, options);
//   reconciler.run(stop_token, std::chrono::seconds(5));   // or run_once() from your scheduler
//
// The record handed over carries the last recovery point (phase, phase_data) of the attempt.
// A resolver that throws leaves the key for later (counted as failed) and the sweep goes on.
// Thread-safety: run_once() may be called from several threads and processes at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>

#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

struct ReconcilerOptions {
    /// Stale keys taken per sweep.
    std::size_t batch = 100;
    /// How long a reconciler owns a key it took; if it has not resolved it by then, it is stale again.
    std::chrono::milliseconds lease{std::chrono::seconds(30)};
    /// The scopes this reconciler handles (your service's scopes in a shared table). Say which:
    /// ScopeFilter::exact(scope), ScopeFilter::prefix(p) (also matches longer scopes), or all().
    ScopeFilter scopes = ScopeFilter::all();
};

class Reconciliation {
public:
    enum class Decision { leave, save, release };

    Reconciliation(const Key& key, const Record& record, Fence fence) noexcept
        : key_(key), record_(record), fence_(fence) {}

    [[nodiscard]] const Key& key() const noexcept { return key_; }
    /// The stale record (fingerprint, attempt, phase and phase_data of the attempt, times).
    [[nodiscard]] const Record& record() const noexcept { return record_; }
    /// The fence this reconciler holds.
    [[nodiscard]] Fence fence() const noexcept { return fence_; }

    /// The effect happened: store `result` (encoded with codec<T>) as the key's response.
    template <class T>
    void save(const T& result) {
        save_encoded(codec<T>::encode(result));
    }
    void save_encoded(std::string bytes) {
        decision_ = Decision::save;
        bytes_ = std::move(bytes);
    }
    /// The effect certainly did not happen: release the key so a retry runs it.
    void release() noexcept { decision_ = Decision::release; }
    void leave() noexcept { decision_ = Decision::leave; }

    [[nodiscard]] Decision decision() const noexcept { return decision_; }
    [[nodiscard]] const std::string& encoded_result() const noexcept { return bytes_; }

private:
    const Key& key_;
    const Record& record_;
    Fence fence_;
    Decision decision_ = Decision::leave;
    std::string bytes_;
};

class Reconciler {
public:
    using Resolver = std::function<void(Reconciliation&)>;

    struct Sweep {
        std::size_t listed = 0;    ///< stale keys seen
        std::size_t taken = 0;     ///< taken by this reconciler (others were taken by someone else)
        std::size_t saved = 0;
        std::size_t released = 0;
        std::size_t left = 0;
        std::size_t failed = 0;    ///< the resolver threw, or the store refused the decision
    };

    Reconciler(IdempotencyStore& store, Resolver resolver, ReconcilerOptions options = {});

    /// One sweep over at most options.batch stale keys. Store errors while listing propagate.
    Sweep run_once();

    /// Sweeps every `interval` until `stop` is requested. Store errors are swallowed (and counted
    /// in the next sweeps' failures) so a database restart does not end the loop.
    void run(std::stop_token stop, std::chrono::milliseconds interval);

private:
    IdempotencyStore& store_;
    Resolver resolver_;
    ReconcilerOptions options_;
};

}  // namespace idem
