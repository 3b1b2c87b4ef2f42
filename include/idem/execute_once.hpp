// idem/execute_once.hpp — run a side effect at most once per idempotency key.
//
//   auto r = idem::execute_once(store, key, fp, [&] { return idem::Response{201, charge()}; });
//
// The sequence (docs/design.md explains each step):
//   1. claim: the store inserts the key as in_progress and commits, before the effect runs. Nothing
//      stays open while fn runs. A lost claim returns at once: replayed / in_progress / mismatch.
//   2. effect: fn() runs. It may take an idem::Context& to learn its key, fence, attempt and the
//      last recovery point, to record recovery points, and to extend its lease (heartbeat).
//   3. fn returns a value → it is encoded with codec<R> and saved with the key → executed.
//      Business errors (a 402 decline) are ordinary returns: saved and replayed like any result.
//   4. fn throws idem::not_performed (or a subclass) → the effect certainly did not happen: the claim
//      is released and the exception rethrown; the same key may run again.
//   5. fn throws anything else → the outcome is unknown. The claim is NOT released and the exception
//      reaches the caller unchanged: the key stays in_progress until reconciliation learns what
//      happened. Releasing after, say, a provider timeout would let the retry charge a second time.
//   6. saving fails after fn returned → response_not_saved (an outcome_unknown): same as 5, the key
//      stays in_progress; the exception carries the encoded result.
//
// Writing fn: give it a deadline the provider enforces (the latest it starts its call, plus a
// timeout the server applies to it) shorter than the claim's lease, so that a stale key has no call
// still to land and a reconciler that finds nothing may release it (reconciler.hpp). Check its own
// connections before use — after a database restart an idle kept connection is dead, and a call
// sent on it is an unknown outcome — and throw not_performed for failures before the request left.
//
// Errors: invalid keys never get here (Key's constructor throws). store_unavailable from the claim
// means fn was not called. lease_lost from save/release means another attempt owns the key now.
//
// Thread-safety: as thread-safe as the store (all idem stores are); fn runs on the calling thread.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/attempt.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

/// What the effect may know about (Attempt: key, fence, attempt, phase), and do with, the claim it
/// runs under.
class Context : public Attempt {
public:
    /// Made by execute_once for the effect; `taken_over` is the earlier attempt's record after a
    /// resume-mode takeover, else null.
    Context(IdempotencyStore& store, const Key& key, Fence fence, const Record* taken_over) noexcept
        : Attempt(key, fence, taken_over), store_(store) {}

    /// Records a recovery point ("charge_created", provider id). Durable when it returns.
    /// Throws lease_lost if this attempt no longer owns the key: stop, someone else took over.
    void record_phase(std::string_view phase, std::string_view data = {}) {
        store_.record_phase(key(), fence(), phase, data);
    }
    /// Heartbeat for long effects: this attempt keeps the key for `lease` from now. Throws lease_lost.
    void extend_lease(std::chrono::milliseconds lease) { store_.extend_lease(key(), fence(), lease); }

private:
    IdempotencyStore& store_;
};

namespace detail {

template <class F>
decltype(auto) invoke_effect(F& fn, Context& context) {
    if constexpr (std::is_invocable_v<F&, Context&>) {
        return std::invoke(fn, context);
    } else {
        return std::invoke(fn);
    }
}

template <class F>
struct effect_result {
    using type = std::remove_cvref_t<decltype(invoke_effect(std::declval<F&>(), std::declval<Context&>()))>;
};

/// The observer's view of one call: events with the time since the call began (timed only when
/// someone listens: a clock read is not free on every call).
class CallReport {
public:
    CallReport(const IdempotencyStore& store, const Key& key) noexcept
        : store_(store),
          key_(key),
          started_(store.observer() != nullptr ? std::chrono::steady_clock::now()
                                               : std::chrono::steady_clock::time_point{}) {}
    void operator()(Event event) const noexcept {
        if (store_.observer() != nullptr) store_.emit(event, &key_, std::chrono::steady_clock::now() - started_);
    }

private:
    const IdempotencyStore& store_;
    const Key& key_;
    std::chrono::steady_clock::time_point started_;
};

// The steps of execute_once that decide, shared by the blocking call, idem::asio's
// async_execute_once (which differ only in how they wait) and execute_batch: one copy of the rules.
// `report` is called with the events of the step: a CallReport for a call, an untimed emit for a
// message of a batch.

/// Step 1, a claim this call did not win: replayed (decoded from the stored bytes), in_progress or
/// mismatch. nullopt: claimed, run the effect. A stored result that does not decode throws the
/// codec's error (nothing is reported then).
template <class R, class Report>
[[nodiscard]] std::optional<Result<R>> lost_claim(const Claim& claim, const Report& report) {
    switch (claim.status) {
        case ClaimStatus::mismatch: report(Event::mismatch); return Result<R>::mismatch();
        case ClaimStatus::in_progress: report(Event::in_progress); return Result<R>::in_progress(claim.retry_after);
        case ClaimStatus::completed: {
            auto replay = Result<R>::replayed(codec<R>::decode(*claim.existing->result));
            report(Event::replayed);
            return replay;
        }
        case ClaimStatus::claimed: break;
    }
    return std::nullopt;
}

/// Step 3: the effect's value as the bytes to save. A codec that throws is response_not_saved
/// (the effect ran: the key stays in progress).
template <class R, class Report>
[[nodiscard]] std::string encode_result(const R& value, const Report& report) {
    try {
        return codec<R>::encode(value);
    } catch (const std::exception& e) {
        report(Event::unknown);
        throw response_not_saved(std::string("idem: encoding the result failed: ") + e.what(), {});
    }
}

/// Step 6, called in a catch block around save(): the effect ran, so every failure is an unknown
/// outcome. lease_lost and response_not_saved reach the caller unchanged, any other idem error as
/// response_not_saved carrying the encoded result; anything else unchanged.
[[noreturn]] inline void rethrow_save_failure(std::string&& bytes, const CallReport& report) {
    report(Event::unknown);
    try {
        throw;
    } catch (const response_not_saved&) {
        throw;
    } catch (const lease_lost&) {
        throw;
    } catch (const error& e) {
        throw response_not_saved(
            std::string("idem: the effect ran but its result was not saved: ") + std::string(without_prefix(e.what())),
            std::move(bytes), e.sqlstate());
    }
}

/// Reads a key's record after a lease_lost: IdempotencyStore::read, or the answer of a read an
/// asynchronous caller made already (idem::asio::detail::read_after_lease_lost). Throws what the
/// read threw.
using RecordReader = std::function<std::optional<Record>(const Key&)>;

/// The answer to a call that met lease_lost — another attempt owns `key` now — as every adapter
/// decides it: the result bytes that attempt stored, for the adapter to replay, when `read` finds
/// the record completed; nullopt, for the adapter to answer in progress, when it does not (in
/// progress, gone) or the read throws a std::exception. A failed read is reported as one line,
/// "read after lease_lost: <what()>", through `report` (the adapter's log adds its prefix and the
/// key).
[[nodiscard]] inline std::optional<std::string> stored_after_lease_lost(
    const RecordReader& read, const Key& key, const std::function<void(const std::string&)>& report) {
    std::optional<Record> record;
    try {
        record = read(key);
    } catch (const std::exception& e) {
        report(std::string("read after lease_lost: ") + e.what());
        return std::nullopt;
    }
    if (!record || record->state != RecordState::completed) return std::nullopt;
    return std::move(record->result);
}

}  // namespace detail

/// The value type execute_once returns for an effect F.
template <class F>
using effect_result_t = typename detail::effect_result<F>::type;

template <class F>
/// Runs `fn` at most once for `key`: claims the key, runs fn() or fn(Context&), saves its result
/// and returns executed; answers replayed, in_progress or mismatch without running fn when the
/// claim was lost (see the top of this header for every step and error).
[[nodiscard]] Result<effect_result_t<F>> execute_once(IdempotencyStore& store, const Key& key, const Fingerprint& fp,
                                                      F&& fn, const ClaimOptions& options = {}) {
    using R = effect_result_t<F>;
    static_assert(!std::is_void_v<R>, "idem::execute_once: the effect must return the result to store");
    static_assert(std::is_same_v<decltype(codec<R>::encode(std::declval<const R&>())), std::string>,
                  "idem::execute_once: specialise idem::codec<R> for the effect's result type");

    const detail::CallReport report(store, key);
    Claim claim = store.claim(key, fp, options);
    if (auto settled = detail::lost_claim<R>(claim, report)) return std::move(*settled);

    Context context(store, key, claim.fence, claim.existing ? &*claim.existing : nullptr);
    std::optional<R> value;
    try {
        value.emplace(detail::invoke_effect(fn, context));
    } catch (const not_performed&) {
        // Certainly not done: free the key. If the release itself fails the key stays in progress
        // (safe: nothing runs twice) and the release error, not the signal, reaches the caller.
        store.release(key, claim.fence);
        report(Event::released);
        throw;
    } catch (...) {
        // Outcome unknown: the claim stays in progress (see step 5 above).
        report(Event::unknown);
        throw;
    }

    std::string bytes = detail::encode_result(*value, report);
    try {
        store.save(key, claim.fence, bytes);
    } catch (...) {
        detail::rethrow_save_failure(std::move(bytes), report);
    }
    report(Event::executed);
    return Result<R>::executed(std::move(*value));
}

}  // namespace idem
