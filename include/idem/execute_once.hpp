// idem/execute_once.hpp — run a side effect at most once per idempotency key.
//
//   auto r = idem::execute_once(store, key, fp, [&] { return idem::Response{201, charge()}; });
//
// The sequence (docs/design.md explains each step):
//   1. claim: the store inserts the key as in_progress and commits, before the effect runs. Nothing
//      stays open while fn runs. A lost claim returns at once: replayed / in_progress / mismatch.
//   2. effect: fn() runs. It may take an idem::Context& to learn its key, fence and attempt.
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
// Errors: invalid keys never get here (Key's constructor throws). store_unavailable from the claim
// means fn was not called. lease_lost from save/release means another attempt owns the key now.
//
// Thread-safety: as thread-safe as the store (all idem stores are); fn runs on the calling thread.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

/// What the effect may know about the claim it runs under.
class Context {
public:
    Context(const Key& key, Fence fence, int attempt) noexcept
        : key_(key), fence_(fence), attempt_(attempt) {}

    [[nodiscard]] const Key& key() const noexcept { return key_; }
    /// The fence token of this claim (pass it on if a downstream write should be fenced too).
    [[nodiscard]] Fence fence() const noexcept { return fence_; }
    /// 1 for the first attempt at this key.
    [[nodiscard]] int attempt() const noexcept { return attempt_; }

private:
    const Key& key_;
    Fence fence_;
    int attempt_;
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

}  // namespace detail

/// The value type execute_once returns for an effect F.
template <class F>
using effect_result_t = typename detail::effect_result<F>::type;

template <class F>
[[nodiscard]] Result<effect_result_t<F>> execute_once(IdempotencyStore& store, const Key& key,
                                                     const Fingerprint& fp, F&& fn,
                                                     const ClaimOptions& options = {}) {
    using R = effect_result_t<F>;
    static_assert(!std::is_void_v<R>, "idem::execute_once: the effect must return the result to store");
    static_assert(std::is_same_v<decltype(codec<R>::encode(std::declval<const R&>())), std::string>,
                  "idem::execute_once: specialise idem::codec<R> for the effect's result type");

    Claim claim = store.claim(key, fp, options);
    switch (claim.status) {
        case ClaimStatus::mismatch: return Result<R>::mismatch();
        case ClaimStatus::in_progress: return Result<R>::in_progress(claim.retry_after);
        case ClaimStatus::completed:
            return Result<R>::replayed(codec<R>::decode(*claim.existing->result));
        case ClaimStatus::claimed: break;
    }

    const int attempt = claim.existing ? claim.existing->attempt : 1;
    Context context(key, claim.fence, attempt);
    std::optional<R> value;
    try {
        value.emplace(detail::invoke_effect(fn, context));
    } catch (const not_performed&) {
        // Certainly not done: free the key. If the release itself fails the key stays in progress
        // (safe: nothing runs twice) and the release error, not the signal, reaches the caller.
        store.release(key, claim.fence);
        throw;
    }
    // Any other exception propagates: outcome unknown, the claim stays (see step 5 above).

    std::string bytes;
    try {
        bytes = codec<R>::encode(*value);
    } catch (const std::exception& e) {
        throw response_not_saved(std::string("idem: encoding the result failed: ") + e.what(), {});
    }
    try {
        store.save(key, claim.fence, bytes);
    } catch (const response_not_saved&) {
        throw;
    } catch (const lease_lost&) {
        throw;
    } catch (const error& e) {
        throw response_not_saved(std::string("idem: the effect ran but its result was not saved: ") +
                                     e.what(),
                                 std::move(bytes), e.sqlstate());
    }
    return Result<R>::executed(std::move(*value));
}

}  // namespace idem
