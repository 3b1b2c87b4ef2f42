// idem/reconciler.hpp — resolving keys stuck in progress (the default for stale keys).
//
// A key stays in_progress to clients when its attempt crashed, hung, or met an unknown outcome
// (a provider timeout). Nobody but the service can know what really happened — so a Reconciler
// counts the stale keys (lease passed: stale_keys(), a gauge of the backlog), lists them oldest
// first, takes each one (a new fence and a lease of its own: several reconcilers, on any number of
// instances, never handle the same key at once, and a late original attempt gets lease_lost) and
// hands it to the service's resolver, which asks the provider — with the same idempotency key — and
// then:
//
//   r.save(response)   the effect happened: store its real result; retries replay it
//   r.release()        the effect certainly did not happen: free the key; a retry runs it
//   (nothing)          not known yet: left in progress, listed again once this lease passes
//
//   idem::ReconcilerOptions options;
//   options.scopes = idem::ScopeFilter::prefix("acct:");   // or exact("acct_42"), or all()
//   options.log = [](std::string_view line) { std::clog << line << '\n'; };
//   idem::Reconciler reconciler(store, [&](idem::Reconciliation& r) {
//       if (auto charge = gateway.find(r.key().value())) r.save(idem::Response{201, charge->json()});
//       else if (gateway.certainly_absent(r.key().value())) r.release("no charge at the gateway");
//   }, options);
//   reconciler.run(stop_token, std::chrono::seconds(5));   // or run_once() from your scheduler
//
// release() lets a retry run the effect again, so "not found" is safe to release only when no call
// of the effect can still land: the claim's lease (ClaimOptions::lease, else the store's
// default_lease) must be longer than the effect's own deadline — the latest it starts its call plus
// a timeout the provider applies (a statement_timeout, a request expiry), e.g. a 10 s lease for a
// charge started within 2 s and bounded by a 3 s statement_timeout. A key reaches the resolver only
// after its lease has passed, by then every such call has ended, and "not found" means "never". A
// timeout on the caller's side alone is not such a deadline: leave those keys until the provider
// has surely given up.
//
// The record handed over carries the last recovery point (phase, phase_data) of the attempt.
//
// Failures are reported, never silent. A key that cannot be resolved — take_over failed, the
// resolver threw, or the store refused the save/release — stays in progress and is reported three
// times: in the sweep's `failures` (key, stage, error type, SQLSTATE, message), as an observer event
// (Event::reconcile_failed, with the key and "stage: type: message" as detail), and as a line to
// options.log. The sweep goes on with the next key. When the key is retried depends on whether the
// failure can repeat:
//
//   * Failures that will happen again with the same decision — the result is over the store's
//     max_result_bytes (response_too_large), the database refuses the save/release for the data
//     itself (database_error of SQLSTATE class 22 data, 23 constraint, 42 rule, 54 limit), or
//     refuses idem for good (config_error, e.g. 42501 a missing privilege) — back off: the reconciler extends its lease
//     on the key by `failure_backoff`, so no reconciler, in this process or another, hands the key to a resolver again
//     before then. The state lives in the row, not in the process: it survives restarts, needs no memory per key, and
//     the key leaves the head of the oldest-first listing instead of filling every batch (a reconciler that merely
//     skipped such keys would list them first forever and starve the others). After the backoff the key is tried once
//     more — a fix in the meantime (a larger max_result_bytes, a resolver that saves a summary) then resolves it — and
//     reported again if it still fails.
//   * Other failures may pass — the resolver threw (the provider is down), the store is
//     unavailable, a serialization or lock timeout, another owner took the key (lease_lost) — and
//     the key is retried once this reconciler's `lease` passes, as before, each failure reported.
//
// The log (ReconcilerOptions::log, like idem::http::Route::log): one line for each key saved,
// released or left (with the resolver's reason, when it gave one), each key that could not be
// resolved (stage, error, when it is tried again) and each sweep of run() that failed (an outage, a
// missing privilege: the error, and when it sweeps again; run_once() throws it to its caller
// instead). Lines name the key as Route's do:
//
//   idem::Reconciler: released: no charge at the gateway (key 'k-17' in scope 'acct:42')
//   idem::Reconciler: could not resolve: take_over: config_error 42501: idem: take_over failed:
//       ERROR:  permission denied for table idem_keys; not taken, listed again next sweep (key ...)
//   idem::Reconciler: sweep failed: store_unavailable: idem: cannot connect to PostgreSQL: ...;
//       sweeping again in 5000 ms
//
// Errors appear as in the observer's detail: the message's first line, at most 512 bytes (the lines
// after it may show a refused row's values).
//
// Thread-safety: run_once() may be called from several threads and processes at once; the log is
// then called from each of them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

/// Settings of a Reconciler.
struct ReconcilerOptions {
    /// Stale keys taken per sweep.
    std::size_t batch = 100;
    /// How long a reconciler owns a key it took; if it has not resolved it by then, it is stale again.
    std::chrono::milliseconds lease{std::chrono::seconds(30)};
    /// The scopes this reconciler handles (your service's scopes in a shared table). Say which:
    /// ScopeFilter::exact(scope), ScopeFilter::prefix(p) (also matches longer scopes), or all().
    ScopeFilter scopes = ScopeFilter::all();
    /// How long a key whose save/release failed in a way that will repeat (see above) is left
    /// alone before it is tried again. Zero: retried when `lease` passes, like any other failure.
    /// At most max_failure_backoff.
    std::chrono::milliseconds failure_backoff{std::chrono::minutes(15)};
    /// Told one line for each key saved, released or left, each key that could not be resolved, and
    /// each failed sweep of run() (see the top of this header). Empty (the default): no lines — the
    /// observer's events and the Sweep still report everything. Called on the thread that sweeps,
    /// never with a lock of idem's held; an exception it throws is ignored (the sweep goes on).
    std::function<void(std::string_view)> log{};
};

/// The longest ReconcilerOptions::failure_backoff (100 years): what every store can add to its clock.
inline constexpr std::chrono::milliseconds max_failure_backoff = std::chrono::hours(24 * 365 * 100);

/// One stale key handed to the resolver: read key() and record(), then decide with save(),
/// release() or leave() (the default).
class Reconciliation {
public:
    /// What the resolver decided: leave it in progress, save a result, or release the key.
    enum class Decision { leave, save, release };

    /// Made by the Reconciler for each key it took (`fence` is the reconciler's own).
    Reconciliation(const Key& key, const Record& record, Fence fence) noexcept
        : key_(key), record_(record), fence_(fence) {}

    /// The stale key: ask the provider about it (with the same idempotency key).
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
    /// save(), with why for ReconcilerOptions::log (e.g. "charge ch_81 found").
    template <class T>
    void save(const T& result, std::string why) {
        save(result);
        reason_ = std::move(why);
    }
    /// save() with bytes already encoded (e.g. by codec<Response>::encode).
    void save_encoded(std::string bytes) {
        decision_ = Decision::save;
        bytes_ = std::move(bytes);
        reason_.clear();
    }
    /// The effect certainly did not happen: release the key so a retry runs it.
    void release() noexcept {
        decision_ = Decision::release;
        reason_.clear();
    }
    /// release(), with why for ReconcilerOptions::log (e.g. "no charge, and its deadline passed").
    void release(std::string why) noexcept {
        release();
        reason_ = std::move(why);
    }
    /// Not known yet: leave the key in progress (the default); it is listed again once the lease
    /// passes.
    void leave() noexcept {
        decision_ = Decision::leave;
        reason_.clear();
    }
    /// leave(), with why for ReconcilerOptions::log (e.g. "the gateway says pending").
    void leave(std::string why) noexcept {
        leave();
        reason_ = std::move(why);
    }

    /// What was decided so far.
    [[nodiscard]] Decision decision() const noexcept { return decision_; }
    /// The bytes save() will store (Decision::save).
    [[nodiscard]] const std::string& encoded_result() const noexcept { return bytes_; }
    /// The reason given with the decision (the overloads with `why`), or empty.
    [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

private:
    const Key& key_;
    const Record& record_;
    Fence fence_;
    Decision decision_ = Decision::leave;
    std::string bytes_;
    std::string reason_;
};

/// Resolves stale in-progress keys through the service's resolver (see the top of this header).
class Reconciler {
public:
    /// The service's decision for one stale key.
    using Resolver = std::function<void(Reconciliation&)>;

    /// Where handling a key failed.
    enum class Stage : std::uint8_t {
        take_over,  ///< taking the stale key (the store failed; the key is not held)
        resolver,   ///< the resolver threw
        save,       ///< the store refused the resolver's save
        release,    ///< the store refused the resolver's release
    };

    /// A key this sweep could not resolve. It stays in progress (clients still get in_progress)
    /// unless another owner resolves it (stage save/release, error_type "lease_lost").
    struct Failure {
        Key key;        ///< the key that failed
        Stage stage{};  ///< where it failed
        /// What was thrown: the idem::error class ("response_too_large", "lease_lost",
        /// "database_error", "store_unavailable", ...), "std::exception" or "unknown".
        std::string error_type{};
        /// PostgreSQL's SQLSTATE when the database produced the error, else empty.
        std::string sqlstate{};
        /// The exception's whole message. From PostgreSQL it may include the DETAIL line, which
        /// for a refused row shows its values (the start of the result): mind where you log it.
        std::string message{};
        /// The failure will repeat with the same decision, and the key's lease was extended by
        /// options.failure_backoff: it is not tried again before then.
        bool backed_off = false;
    };

    /// What one run_once() did.
    struct Sweep {
        std::size_t listed = 0;           ///< stale keys seen
        std::size_t taken = 0;            ///< taken by this reconciler (others were taken by someone else)
        std::size_t saved = 0;            ///< resolved with a saved result
        std::size_t released = 0;         ///< released (certainly not performed)
        std::size_t left = 0;             ///< left in progress by the resolver
        std::size_t failed = 0;           ///< failures.size()
        std::vector<Failure> failures{};  ///< in the order the keys were handled
        /// Stale keys in options.scopes when the sweep began, before it took any
        /// (IdempotencyStore::count_stale): the backlog it started from, batch or no batch.
        std::size_t stale = 0;
    };

    /// Throws config_error without a resolver or with batch 0, or a failure_backoff that is negative
    /// or over max_failure_backoff.
    Reconciler(IdempotencyStore& store, Resolver resolver, ReconcilerOptions options = {});

    /// One sweep: counts the stale keys in options.scopes (Sweep::stale, stale_keys()), then, if
    /// there are any, lists and handles at most options.batch of them. A failure on one key is
    /// recorded in the result (and reported to the observer) and the sweep goes on; an error while
    /// counting or listing the stale keys propagates.
    Sweep run_once();

    /// The stale keys in options.scopes (in progress, lease passed, held by no one) as the last
    /// sweep that counted them found them, before it took any; nullopt until a sweep has counted.
    /// For a gauge: PrometheusObserver::set_stale_source(). Lock-free; thread-safe.
    [[nodiscard]] std::optional<std::size_t> stale_keys() const noexcept;

    /// Sweeps every `interval` until `stop` is requested; at once again after a full batch that
    /// resolved (saved or released) a key and in which no take_over failed (the keys it left or
    /// failed on may be listed again at once: no spinning on them). An
    /// exception from a sweep (store errors while listing, std::bad_alloc, std::system_error, ...)
    /// does not end the loop: it is reported as Event::reconcile_failed with no key, and the loop
    /// sweeps again next interval — a database restart does not end it.
    void run(std::stop_token stop, std::chrono::milliseconds interval);

private:
    void record_failure(Sweep& sweep, const Key& key, Stage stage, std::exception_ptr thrown,
                        std::optional<Fence> held);
    // Gives options_.log the line `line()` makes, if there is a log; never throws.
    template <class Line>
    void tell(const Line& line) const noexcept;

    // The last count (stale_keys()); kUncounted until a sweep counts. Copied by value with the
    // Reconciler.
    struct Count {
        static constexpr std::uint64_t kUncounted = UINT64_MAX;
        std::atomic<std::uint64_t> value{kUncounted};
        Count() = default;
        Count(const Count& other) noexcept : value(other.value.load(std::memory_order_relaxed)) {}
        Count& operator=(const Count& other) noexcept {
            value.store(other.value.load(std::memory_order_relaxed), std::memory_order_relaxed);
            return *this;
        }
    };

    IdempotencyStore& store_;
    Resolver resolver_;
    ReconcilerOptions options_;
    Count stale_;
};

/// The stage's name, e.g. "take_over".
[[nodiscard]] constexpr std::string_view to_string(Reconciler::Stage stage) noexcept {
    switch (stage) {
        case Reconciler::Stage::take_over: return "take_over";
        case Reconciler::Stage::resolver: return "resolver";
        case Reconciler::Stage::save: return "save";
        case Reconciler::Stage::release: return "release";
    }
    return "unknown";
}

}  // namespace idem
