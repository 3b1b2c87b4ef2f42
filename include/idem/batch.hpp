// idem/batch.hpp — exactly-once effects for message consumers, a batch at a time.
//
// At-least-once delivery (Kafka, SQS, RabbitMQ, webhooks) hands consumers duplicates; the event id is
// the idempotency key. execute_batch claims every message of a batch in one round trip, runs the
// effect for the winners, and saves their results in one round trip:
//
//   std::vector<idem::Message> batch;   // {Key{"orders-consumer", event.id}, fingerprint(event.body)}
//   auto results = idem::execute_batch(store, batch, [&](std::size_t i) { return apply(events[i]); });
//   for (auto& r : results) if (r.outcome == idem::BatchOutcome::executed) ++applied;
//
// Per message (results[i] answers messages[i]):
//   executed   claimed here, fn ran, result saved
//   replayed   an earlier delivery completed it: fn did not run; response holds its stored result
//   duplicate  the same key, with the same fingerprint, appears earlier in this batch: fn did not
//              run for this copy (with another fingerprint the copy is a mismatch)
//   in_progress, mismatch   as for execute_once
//   released   fn threw not_performed: the claim was released (redelivery will run it); error holds it
//   failed     fn threw anything else (outcome unknown: the key stays in progress), its result
//              could not be saved (response_not_saved / lease_lost), or a stored result could not
//              be decoded (corrupt_record); error holds the exception
// Whole-batch failures of the claim (store unavailable) are thrown, with every claim the batch had
// already won released again: nothing is left in progress by an exception.
//
// fn is called as fn(index) or fn(message), on the calling thread, in batch order.
// Thread-safety: as thread-safe as the store.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/outcome.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"

namespace idem {

/// One message of a batch: its idempotency key (e.g. the event id) and the fingerprint of its body.
struct Message {
    /// The key, e.g. Key{"orders-consumer", event.id}.
    Key key;
    /// The fingerprint of the message's content.
    Fingerprint fingerprint;
};

/// What execute_batch did with one message (see the top of this header).
enum class BatchOutcome { executed, replayed, duplicate, in_progress, mismatch, released, failed };

/// The outcome's name, e.g. "duplicate".
[[nodiscard]] constexpr std::string_view to_string(BatchOutcome o) noexcept {
    constexpr std::string_view names[] = {"executed", "replayed", "duplicate", "in_progress",
                                          "mismatch", "released", "failed"};
    return names[static_cast<std::size_t>(o)];
}

template <class R>
/// The answer for one message of a batch: results[i] answers messages[i].
struct BatchEntry {
    /// What happened to the message.
    BatchOutcome outcome = BatchOutcome::failed;
    std::optional<R> response{};               ///< executed, replayed
    std::exception_ptr error{};                ///< released, failed
    std::chrono::milliseconds retry_after{0};  ///< in_progress
};

namespace detail {
/// The batch's name for an outcome of a claim that was not won (detail::lost_claim).
[[nodiscard]] constexpr BatchOutcome batch_outcome(Outcome o) noexcept {
    switch (o) {
        case Outcome::replayed: return BatchOutcome::replayed;
        case Outcome::in_progress: return BatchOutcome::in_progress;
        case Outcome::mismatch: return BatchOutcome::mismatch;
        case Outcome::executed: break;
    }
    return BatchOutcome::executed;
}

template <class F>
decltype(auto) invoke_message(F& fn, std::size_t index, const Message& message) {
    if constexpr (std::is_invocable_v<F&, std::size_t>) {
        return std::invoke(fn, index);
    } else {
        return std::invoke(fn, message);
    }
}
}  // namespace detail

template <class F>
/// Runs `fn` once per distinct, unclaimed message of `messages`: claims them in one call
/// (claim_batch), calls fn(index) or fn(message) for the winners in order, saves their results in
/// one call (save_batch). Returns one BatchEntry per message. Throws store_unavailable /
/// database_error when the claim of the whole batch fails (nothing is left claimed).
[[nodiscard]] auto execute_batch(IdempotencyStore& store, std::span<const Message> messages, F&& fn,
                                 const ClaimOptions& options = {}) {
    using R = std::remove_cvref_t<decltype(detail::invoke_message(fn, std::size_t{}, messages[0]))>;
    std::vector<BatchEntry<R>> out(messages.size());

    // Distinct keys, first occurrence wins; later copies are duplicates of this batch.
    std::vector<std::size_t> first;  // message index of each distinct key
    std::map<const Key*, std::size_t, decltype([](const Key* a, const Key* b) { return *a < *b; })> seen;
    for (std::size_t i = 0; i < messages.size(); ++i) {
        auto [it, fresh] = seen.emplace(&messages[i].key, i);
        if (fresh) {
            first.push_back(i);
        } else {
            // Same key, different content: the same answer it would get in a later batch.
            const bool same = messages[it->second].fingerprint == messages[i].fingerprint;
            out[i].outcome = same ? BatchOutcome::duplicate : BatchOutcome::mismatch;
            if (!same) store.emit(Event::mismatch, &messages[i].key);
        }
    }
    std::vector<Key> keys;
    std::vector<Fingerprint> fps;
    keys.reserve(first.size());
    fps.reserve(first.size());
    for (std::size_t i : first) {
        keys.push_back(messages[i].key);
        fps.push_back(messages[i].fingerprint);
    }
    std::vector<Claim> claims = store.claim_batch(keys, fps, options);

    std::vector<std::string> encoded(first.size());
    std::vector<SaveRequest> saves;
    std::vector<std::size_t> saved_slot;  // saves[j] belongs to first[saved_slot[j]]
    for (std::size_t k = 0; k < first.size(); ++k) {
        const std::size_t i = first[k];
        BatchEntry<R>& entry = out[i];
        Claim& claim = claims[k];
        // A message's events are counted, not timed: the batch's round trips are shared.
        const auto report = [&store, &key = messages[i].key](Event event) { store.emit(event, &key); };
        try {
            if (auto settled = detail::lost_claim<R>(claim, report)) {
                entry.outcome = detail::batch_outcome(settled->outcome());
                if (settled->has_response()) entry.response.emplace(std::move(*settled).response());
                entry.retry_after = settled->retry_after();
                continue;
            }
        } catch (...) {
            entry.outcome = BatchOutcome::failed;  // a stored result that does not decode: this message only
            entry.error = std::current_exception();
            continue;
        }
        try {
            entry.response.emplace(detail::invoke_message(fn, i, messages[i]));
        } catch (const not_performed&) {
            entry.error = std::current_exception();
            entry.response.reset();
            try {
                store.release(messages[i].key, claim.fence);
                entry.outcome = BatchOutcome::released;
                report(Event::released);
            } catch (...) {
                entry.outcome = BatchOutcome::failed;  // still in progress: safe, never runs twice
                entry.error = std::current_exception();
            }
            continue;
        } catch (...) {
            entry.outcome = BatchOutcome::failed;  // outcome unknown: the claim stays in progress
            entry.error = std::current_exception();
            entry.response.reset();
            report(Event::unknown);
            continue;
        }
        try {
            encoded[k] = detail::encode_result(*entry.response, report);
        } catch (...) {
            entry.outcome = BatchOutcome::failed;  // response_not_saved: the effect ran, the key stays in progress
            entry.error = std::current_exception();
            entry.response.reset();
            continue;
        }
        saves.push_back(SaveRequest{messages[i].key, claim.fence, encoded[k]});
        saved_slot.push_back(k);
    }
    if (saves.empty()) return out;

    std::vector<SaveStatus> statuses;
    try {
        statuses = store.save_batch(saves);
    } catch (const error& e) {
        for (std::size_t j = 0; j < saves.size(); ++j) {
            BatchEntry<R>& entry = out[first[saved_slot[j]]];
            entry.outcome = BatchOutcome::failed;
            entry.error = std::make_exception_ptr(
                response_not_saved(std::string("idem: the effect ran but the batch save failed: ") +
                                       std::string(detail::without_prefix(e.what())),
                                   std::string(saves[j].result), e.sqlstate()));
            store.emit(Event::unknown, &saves[j].key);
        }
        return out;
    }
    for (std::size_t j = 0; j < saves.size(); ++j) {
        BatchEntry<R>& entry = out[first[saved_slot[j]]];
        switch (statuses[j]) {
            case SaveStatus::saved:
                entry.outcome = BatchOutcome::executed;
                store.emit(Event::executed, &saves[j].key);
                break;
            case SaveStatus::lease_lost:
                entry.outcome = BatchOutcome::failed;
                entry.error = std::make_exception_ptr(lease_lost("idem: batch save refused: the fence lost the key"));
                store.emit(Event::unknown, &saves[j].key);
                break;
            case SaveStatus::too_large:
                entry.outcome = BatchOutcome::failed;
                entry.error = std::make_exception_ptr(
                    detail::result_too_large(std::string(saves[j].result), store.max_result_bytes()));
                store.emit(Event::unknown, &saves[j].key);
                break;
        }
    }
    return out;
}

/// Overload for a vector or an initializer of messages.
template <class F>
[[nodiscard]] auto execute_batch(IdempotencyStore& store, const std::vector<Message>& messages, F&& fn,
                                 const ClaimOptions& options = {}) {
    return execute_batch(store, std::span<const Message>(messages), std::forward<F>(fn), options);
}

}  // namespace idem
