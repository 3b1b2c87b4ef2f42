// idem/asio/execute_once.hpp — execute_once for event loops: Asio completion tokens, coroutines.
//
//   // C++20 coroutine, effect awaiting a provider's HTTP call:
//   idem::Result<idem::Response> r = co_await idem::asio::async_execute_once(
//       store, key, fp, [&]() -> boost::asio::awaitable<idem::Response> { co_return co_await charge(); },
//       boost::asio::use_awaitable);
//   // a callback, or a future:
//   idem::asio::async_execute_once(store, key, fp, effect, [](std::exception_ptr e, idem::Result<idem::Response> r)
//   {...}); auto f = idem::asio::async_execute_once(store, key, fp, effect, boost::asio::use_future);
//
// The same call as idem::execute_once (execute_once.hpp), outcome for outcome and error for error —
// the steps that decide are the same code (idem::detail::lost_claim, encode_result,
// rethrow_save_failure): the claim is committed before the effect; a lost claim completes at once
// (replayed with the stored bytes, in_progress, mismatch); fn throwing not_performed releases the key
// and the exception is rethrown; anything else fn throws leaves the key in progress (outcome unknown)
// and reaches the caller unchanged; a failed save is response_not_saved or lease_lost.
//
// The effect fn is called on the store's executor (a strand), with no argument or an AsyncContext&.
// It returns the result (R), or a boost::asio::awaitable<R> that the call co_awaits: an effect that
// itself waits (a timer, an HTTP request) does not block the event loop. R needs an idem::codec.
// fn is taken by value (moved into the operation, alive until it completes); key and fingerprint
// are copied. Pass a lambda with by-reference captures, or std::ref, to avoid copying a big functor.
// GCC 12: a lambda with an init-capture of a class type (`[s = std::string(...)]`) written inside a
// co_await expression is destroyed twice by the compiler (a double free of the capture, which
// ASan reports). Name such a lambda first (`auto effect = [s = ...] {...};
// co_await async_execute_once(store, key, fp, effect, use_awaitable);`). By-reference captures and
// named lambdas are not affected.
//
// Completion signature: void(std::exception_ptr, idem::Result<R>). With an exception, the Result is a
// placeholder (in_progress, retry_after 0) and means nothing, as with Asio's own exception_ptr
// signatures: look at the exception first (use_awaitable and use_future do).
//
// Cancellation (Asio per-operation cancellation through the token's slot, any type; or
// AsyncOptions::deadline, measured from the start of the call):
//   * before the effect started: the claim in flight is awaited (a statement sent cannot be taken
//     back), a claim it won is released — fn certainly did not run — and the call completes with
//     call_cancelled. Nothing happened; the same key may run again. (A resume-mode takeover is not
//     released: the key holds the earlier attempt, whose outcome is unknown; it stays in progress
//     and is taken over again once the new lease passes.)
//   * once the effect has started: the cancellation reaches the effect's own asynchronous operations
//     (its awaitable runs in the call's coroutine). Whatever the effect then throws follows the
//     unknown-outcome rule: the key stays in progress for the reconciler. An effect that finishes
//     anyway is saved and the call completes as executed.
//   * the store's own statements (claim, save, release) are never interrupted by a cancellation:
//     each ends by its answer or its statement deadline.
//
// Thread-safety: may be started from any thread; the store serialises its work on its strand.
#pragma once

#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/asio/store.hpp"
#include "idem/attempt.hpp"
#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"

namespace idem::asio {

/// What an asynchronous effect may know about, and do with, the claim it runs under (the
/// counterpart of idem::Context, with awaitable writes).
class AsyncContext : public Attempt {
public:
    /// Made by async_execute_once for the effect; `taken_over` is the earlier attempt's record
    /// after a resume-mode takeover, else null.
    AsyncContext(AsyncPostgresStore& store, const Key& key, Fence fence, const Record* taken_over) noexcept
        : Attempt(key, fence, taken_over), store_(store) {}

    /// A recovery point, durable when the awaitable completes. Throws lease_lost if this attempt no
    /// longer owns the key.
    boost::asio::awaitable<void> record_phase(std::string phase, std::string data = {}) {
        return store_.co_record_phase(key(), fence(), std::move(phase), std::move(data));
    }
    /// Heartbeat: this attempt keeps the key for `lease` from now. Throws lease_lost.
    boost::asio::awaitable<void> extend_lease(std::chrono::milliseconds lease) {
        return store_.co_extend_lease(key(), fence(), lease);
    }

private:
    AsyncPostgresStore& store_;
};

/// Per-call settings of async_execute_once.
struct AsyncOptions {
    ClaimOptions claim{};  ///< lease, retention, resume mode, waiting: as for execute_once
    /// The whole call's deadline from its start; zero: none. Passing it cancels the call (see the
    /// header comment: call_cancelled before the effect, the effect's own error after).
    std::chrono::milliseconds deadline{0};
};

namespace detail {

template <class T>
struct awaitable_value {
    static constexpr bool awaitable = false;
    using type = T;
};
template <class T, class Executor>
struct awaitable_value<boost::asio::awaitable<T, Executor>> {
    static constexpr bool awaitable = true;
    using type = T;
};

template <class F>
decltype(auto) invoke_async_effect(F& fn, AsyncContext& context) {
    if constexpr (std::is_invocable_v<F&, AsyncContext&>) {
        return std::invoke(fn, context);
    } else {
        return std::invoke(fn);
    }
}

template <class F>
struct async_effect {
    using returned =
        std::remove_cvref_t<decltype(invoke_async_effect(std::declval<F&>(), std::declval<AsyncContext&>()))>;
    static constexpr bool awaitable = awaitable_value<returned>::awaitable;
    using type = typename awaitable_value<returned>::type;
};

template <class R, class F>
boost::asio::awaitable<std::optional<Result<R>>> execute(AsyncPostgresStore& store, Key key, Fingerprint fp, F fn,
                                                         ClaimOptions options) {
    // A cancellation is looked at between the steps, never thrown from inside one (a claim that
    // committed must be seen, to be released).
    co_await boost::asio::this_coro::throw_if_cancelled(false);
    const auto cancelled = [](const boost::asio::cancellation_state& state) {
        return state.cancelled() != boost::asio::cancellation_type::none;
    };
    const idem::detail::CallReport report(store, key);
    Claim claim = co_await store.co_claim(key, fp, options);
    if (cancelled(co_await boost::asio::this_coro::cancellation_state)) {
        // A fresh claim is released: nothing ran. A resume-mode takeover is not: the record holds
        // the earlier attempt, whose outcome is unknown (its phase too) — deleting it would let the
        // next call start afresh and charge again. It stays in progress and goes stale again.
        if (claim.status == ClaimStatus::claimed && !claim.existing) {
            co_await store.co_release(key, claim.fence);
            report(Event::released);
        }
        throw call_cancelled("idem: the call was cancelled before its effect started (the effect did not run)");
    }
    if (auto settled = idem::detail::lost_claim<R>(claim, report)) co_return std::move(settled);

    AsyncContext context(store, key, claim.fence, claim.existing ? &*claim.existing : nullptr);
    std::optional<R> value;
    std::exception_ptr failure;
    bool performed = true;
    try {
        if constexpr (async_effect<F>::awaitable) {
            value.emplace(co_await invoke_async_effect(fn, context));
        } else {
            value.emplace(invoke_async_effect(fn, context));
        }
    } catch (const not_performed&) {
        failure = std::current_exception(), performed = false;
    } catch (...) {
        failure = std::current_exception();
    }
    if (failure) {
        if (!performed) {
            // Certainly not done: free the key (a failed release keeps it in progress: safe).
            co_await store.co_release(key, claim.fence);
            report(Event::released);
        } else {
            report(Event::unknown);  // outcome unknown: the claim stays in progress
        }
        std::rethrow_exception(failure);
    }

    std::string bytes = idem::detail::encode_result(*value, report);
    std::exception_ptr save_failure;
    try {
        co_await store.co_save(key, claim.fence, bytes);
    } catch (...) {
        save_failure = std::current_exception();
    }
    if (save_failure) {
        try {
            std::rethrow_exception(save_failure);
        } catch (...) {
            idem::detail::rethrow_save_failure(std::move(bytes), report);
        }
    }
    report(Event::executed);
    co_return Result<R>::executed(std::move(*value));
}

// Owns what a cancellable call needs besides its coroutine: the signal its coroutine listens to
// (fed by the caller's slot and by the deadline's timer), and that timer when there is a deadline.
struct CallCancellation {
    boost::asio::cancellation_signal signal;
    std::optional<boost::asio::steady_timer> timer;
};

/// The read an asynchronous adapter makes before it answers `failure`: after a lease_lost, the
/// key's record, with co_read (a blocking read on the store's own executor would wait for itself).
/// The reader returned (for idem::detail::stored_after_lease_lost) gives that record, or rethrows
/// what the read threw; after any other failure nothing is read and it gives nullopt.
inline boost::asio::awaitable<idem::detail::RecordReader> read_after_lease_lost(AsyncPostgresStore& store,
                                                                                const Key& key,
                                                                                std::exception_ptr failure) {
    bool lost = false;
    try {
        if (failure) std::rethrow_exception(failure);
    } catch (const lease_lost&) {
        lost = true;
    } catch (...) {
    }
    std::optional<Record> record;
    std::exception_ptr read_failure;
    if (lost) {
        try {
            record = co_await store.co_read(key);
        } catch (...) {
            read_failure = std::current_exception();
        }
    }
    idem::detail::RecordReader read = [record, read_failure](const Key&) -> std::optional<Record> {
        if (read_failure) std::rethrow_exception(read_failure);
        return record;
    };
    co_return read;
}

// Completes the caller's handler with execute()'s outcome.
template <class R, class Handler>
void complete_call(Handler& handler, std::exception_ptr e, std::optional<Result<R>> result) {
    if (e || !result) {
        std::move(handler)(e ? e : std::make_exception_ptr(std::logic_error("idem: no result")),
                           Result<R>::in_progress(std::chrono::milliseconds(0)));
    } else {
        std::move(handler)(nullptr, std::move(*result));
    }
}

}  // namespace detail

/// The value type async_execute_once completes with for an effect F (its awaitable's value type
/// when it returns one).
template <class F>
using async_effect_result_t = typename detail::async_effect<std::decay_t<F>>::type;

template <class F, class Token>
/// execute_once on an event loop: completes `token` with void(std::exception_ptr, Result<R>), the
/// same outcomes and errors as execute_once, plus call_cancelled (see the top of this header).
auto async_execute_once(AsyncPostgresStore& store, Key key, Fingerprint fp, F fn, AsyncOptions options, Token&& token) {
    using Fn = F;
    using R = async_effect_result_t<F>;
    static_assert(!std::is_void_v<R>, "idem::asio::async_execute_once: the effect must return the result to store");
    static_assert(std::is_same_v<decltype(codec<R>::encode(std::declval<const R&>())), std::string>,
                  "idem::asio::async_execute_once: specialise idem::codec<R> for the effect's result type");
    using Signature = void(std::exception_ptr, Result<R>);
    auto initiation = [&store](auto handler, Key k, Fingerprint f, Fn effect, AsyncOptions o) {
        auto ex = store.get_executor();
        auto slot = boost::asio::get_associated_cancellation_slot(handler);
        auto handler_ex = boost::asio::get_associated_executor(handler, ex);
        if (!slot.is_connected() && o.deadline.count() <= 0) {
            // Nothing can cancel this call: no signal to listen to, no timer.
            auto done = [handler = std::move(handler)](std::exception_ptr e, std::optional<Result<R>> result) mutable {
                detail::complete_call<R>(handler, e, std::move(result));
            };
            boost::asio::co_spawn(ex,
                                  detail::execute<R, Fn>(store, std::move(k), std::move(f), std::move(effect), o.claim),
                                  boost::asio::bind_executor(handler_ex, std::move(done)));
            return;
        }
        auto cancel = std::make_shared<detail::CallCancellation>();
        // The caller's cancellation, whatever its type, cancels the call (see the header comment).
        if (slot.is_connected()) {
            slot.assign([weak = std::weak_ptr<detail::CallCancellation>(cancel), ex](boost::asio::cancellation_type) {
                boost::asio::dispatch(ex, [weak] {
                    if (auto c = weak.lock()) c->signal.emit(boost::asio::cancellation_type::terminal);
                });
            });
        }
        if (o.deadline.count() > 0) {
            cancel->timer.emplace(ex, o.deadline);
            cancel->timer->async_wait(
                [weak = std::weak_ptr<detail::CallCancellation>(cancel)](const boost::system::error_code& ec) {
                    if (auto c = weak.lock(); c && !ec) c->signal.emit(boost::asio::cancellation_type::terminal);
                });
        }
        auto done = [handler = std::move(handler), cancel, slot](std::exception_ptr e,
                                                                 std::optional<Result<R>> result) mutable {
            if (cancel->timer) cancel->timer->cancel();
            if (slot.is_connected()) slot.clear();
            detail::complete_call<R>(handler, e, std::move(result));
        };
        boost::asio::co_spawn(ex, detail::execute<R, Fn>(store, std::move(k), std::move(f), std::move(effect), o.claim),
                              boost::asio::bind_cancellation_slot(
                                  cancel->signal.slot(), boost::asio::bind_executor(handler_ex, std::move(done))));
    };
    return boost::asio::async_initiate<Token, Signature>(std::move(initiation), token, std::move(key), std::move(fp),
                                                         std::move(fn), options);
}

template <class F, class Token>
/// async_execute_once with default AsyncOptions.
auto async_execute_once(AsyncPostgresStore& store, Key key, Fingerprint fp, F fn, Token&& token) {
    return async_execute_once(store, std::move(key), std::move(fp), std::move(fn), AsyncOptions{},
                              std::forward<Token>(token));
}

}  // namespace idem::asio
