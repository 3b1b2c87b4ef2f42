// tests/batch/batch_semantics.hpp — what execute_batch promises, checked on any IdempotencyStore.
//
// Each check takes a store and a scope of its own; batch_test.cpp runs them on PostgresStore
// (claim_batch / save_batch pipelined), batch_memory_test.cpp on MemoryStore (the default
// claim_batch / save_batch of IdempotencyStore, one claim() / save() per key).
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "idem/idem.hpp"

namespace batch_test {

/// A result type whose codec refuses the stored bytes "poison" (as after a codec change, or a
/// corrupt row): decode throws corrupt_record; and refuses to encode the value "unencodable".
struct Strict {
    std::string value;
};

}  // namespace batch_test

template <>
struct idem::codec<batch_test::Strict> {
    static std::string encode(const batch_test::Strict& s) {
        if (s.value == "unencodable") throw std::invalid_argument("cannot encode this value");
        return s.value;
    }
    static batch_test::Strict decode(std::string_view bytes) {
        if (bytes == "poison") throw idem::corrupt_record("poisoned result");
        return batch_test::Strict{std::string(bytes)};
    }
};

namespace batch_test {

using idem::BatchOutcome;
using namespace std::string_literals;

/// An event: key = (scope, id), fingerprint over its id and content.
inline idem::Message message(const std::string& scope, const std::string& id, const std::string& body = "v1") {
    return idem::Message{idem::Key{scope, id}, idem::fingerprint("event"s, id, body)};
}

inline std::vector<idem::Message> messages(const std::string& scope, const std::vector<std::string>& ids) {
    std::vector<idem::Message> out;
    out.reserve(ids.size());
    for (const auto& id : ids) out.push_back(message(scope, id));
    return out;
}

template <class R>
std::vector<BatchOutcome> outcomes(const std::vector<idem::BatchEntry<R>>& results) {
    std::vector<BatchOutcome> out;
    out.reserve(results.size());
    for (const auto& r : results) out.push_back(r.outcome);
    return out;
}

/// The exception an entry carries, rethrown and caught as E; its what() (empty when not an E).
template <class E>
std::string error_as(const std::exception_ptr& error) {
    if (!error) return "<no error>";
    try {
        std::rethrow_exception(error);
    } catch (const E& e) {
        return std::string("E:") + e.what();
    } catch (...) {
        if constexpr (!std::is_same_v<E, std::exception>) {
            try {
                throw;
            } catch (const std::exception& e) {
                return std::string("other:") + e.what();
            } catch (...) {
            }
        }
        return "other:?";
    }
}

/// The effect of these checks: records which message ids it ran for, returns "done:<id>".
struct Effect {
    const std::vector<idem::Message>* batch = nullptr;
    std::vector<std::string> ran;
    std::string operator()(std::size_t i) {
        const std::string& id = (*batch)[i].key.value();
        ran.push_back(id);
        return "done:" + id;
    }
};

// --- the checks ------------------------------------------------------------------------------------

inline void check_empty_batch(idem::IdempotencyStore& store) {
    const std::vector<idem::Message> none;
    int calls = 0;
    auto results = idem::execute_batch(store, none, [&](std::size_t) {
        ++calls;
        return "x"s;
    });
    CHECK(results.empty());
    CHECK(calls == 0);
}

inline void check_fresh_then_replayed(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"e1", "e2", "e3", "e4", "e5"});
    Effect effect{&batch, {}};
    auto first = idem::execute_batch(store, batch, std::ref(effect));
    REQUIRE(first.size() == 5);
    for (std::size_t i = 0; i < first.size(); ++i) {
        CHECK(first[i].outcome == BatchOutcome::executed);
        REQUIRE(first[i].response);
        CHECK(*first[i].response == "done:" + batch[i].key.value());
        CHECK_FALSE(first[i].error);
    }
    CHECK(effect.ran == std::vector<std::string>{"e1", "e2", "e3", "e4", "e5"});  // batch order

    effect.ran.clear();
    auto again = idem::execute_batch(store, batch, std::ref(effect));
    REQUIRE(again.size() == 5);
    for (std::size_t i = 0; i < again.size(); ++i) {
        CHECK(again[i].outcome == BatchOutcome::replayed);
        REQUIRE(again[i].response);
        CHECK(*again[i].response == "done:" + batch[i].key.value());  // the stored result, byte for byte
    }
    CHECK(effect.ran.empty());

    // Every key is completed with the result the effect returned.
    for (const auto& m : batch) {
        auto record = store.read(m.key);
        REQUIRE(record);
        CHECK(record->state == idem::RecordState::completed);
        CHECK(record->result == "done:" + m.key.value());
    }
}

inline void check_duplicates_in_batch(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"a", "b", "a", "c", "a", "b"});
    Effect effect{&batch, {}};
    auto results = idem::execute_batch(store, batch, std::ref(effect));
    CHECK(outcomes(results) == std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::executed,
                                                         BatchOutcome::duplicate, BatchOutcome::executed,
                                                         BatchOutcome::duplicate, BatchOutcome::duplicate});
    CHECK(effect.ran == std::vector<std::string>{"a", "b", "c"});  // once per key, first copy
    CHECK_FALSE(results[2].response);
    CHECK_FALSE(results[2].error);

    // Redelivered, across batches: the first copy replays, later copies are still duplicates.
    effect.ran.clear();
    const auto redelivered = messages(scope, {"a", "a", "c"});
    effect.batch = &redelivered;
    auto again = idem::execute_batch(store, redelivered, std::ref(effect));
    CHECK(outcomes(again) ==
          std::vector<BatchOutcome>{BatchOutcome::replayed, BatchOutcome::duplicate, BatchOutcome::replayed});
    CHECK(effect.ran.empty());
}

inline void check_mismatch_across_batches(idem::IdempotencyStore& store, const std::string& scope) {
    const std::vector<idem::Message> first{message(scope, "k", "amount=100")};
    Effect effect{&first, {}};
    REQUIRE(outcomes(idem::execute_batch(store, first, std::ref(effect))) ==
            std::vector<BatchOutcome>{BatchOutcome::executed});

    // Same id, different content, next batch (with a fresh message beside it).
    const std::vector<idem::Message> second{message(scope, "k", "amount=999"), message(scope, "j")};
    effect.batch = &second;
    effect.ran.clear();
    auto results = idem::execute_batch(store, second, std::ref(effect));
    CHECK(outcomes(results) == std::vector<BatchOutcome>{BatchOutcome::mismatch, BatchOutcome::executed});
    CHECK_FALSE(results[0].response);
    CHECK(effect.ran == std::vector<std::string>{"j"});

    // The original content still replays; the stored result is untouched.
    effect.batch = &first;
    effect.ran.clear();
    auto replay = idem::execute_batch(store, first, std::ref(effect));
    CHECK(outcomes(replay) == std::vector<BatchOutcome>{BatchOutcome::replayed});
    CHECK(replay[0].response == "done:k"s);
    CHECK(effect.ran.empty());
}

/// Inside ONE batch, a second copy of an id with different content. execute_once and a later batch
/// answer mismatch for it; a batch should not silently call it a duplicate.
inline void check_mismatch_inside_batch(idem::IdempotencyStore& store, const std::string& scope) {
    const std::vector<idem::Message> batch{message(scope, "k", "amount=100"), message(scope, "k", "amount=999")};
    Effect effect{&batch, {}};
    auto results = idem::execute_batch(store, batch, std::ref(effect));
    CHECK(effect.ran == std::vector<std::string>{"k"});
    CHECK(results[0].outcome == BatchOutcome::executed);
    CHECK(results[1].outcome == BatchOutcome::mismatch);
}

inline void check_not_performed(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"a", "b", "c"});
    std::vector<std::string> ran;
    auto fn = [&](std::size_t i) -> std::string {
        const std::string& id = batch[i].key.value();
        ran.push_back(id);
        if (id == "b") throw idem::not_performed("rate limited");
        return "done:" + id;
    };
    auto results = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(results) ==
          std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::released, BatchOutcome::executed});
    CHECK_FALSE(results[1].response);
    CHECK(error_as<idem::not_performed>(results[1].error) == "E:rate limited");
    CHECK_FALSE(store.read(batch[1].key));  // released: the key is free again
    CHECK(ran == std::vector<std::string>{"a", "b", "c"});

    // Redelivery runs it (and only it).
    ran.clear();
    auto fine = [&](std::size_t i) {
        ran.push_back(batch[i].key.value());
        return "done:" + batch[i].key.value();
    };
    auto again = idem::execute_batch(store, batch, fine);
    CHECK(outcomes(again) ==
          std::vector<BatchOutcome>{BatchOutcome::replayed, BatchOutcome::executed, BatchOutcome::replayed});
    CHECK(ran == std::vector<std::string>{"b"});
    CHECK(again[1].response == "done:b"s);
}

inline void check_failed(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"a", "b", "c"});
    std::vector<std::string> ran;
    auto fn = [&](std::size_t i) -> std::string {
        const std::string& id = batch[i].key.value();
        ran.push_back(id);
        if (id == "b") throw std::runtime_error("provider timed out");
        return "done:" + id;
    };
    auto results = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(results) ==
          std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::failed, BatchOutcome::executed});
    CHECK_FALSE(results[1].response);
    CHECK(error_as<std::runtime_error>(results[1].error) == "E:provider timed out");
    CHECK(ran == std::vector<std::string>{"a", "b", "c"});
    // Outcome unknown: the key stays in progress, never released.
    auto record = store.read(batch[1].key);
    REQUIRE(record);
    CHECK(record->state == idem::RecordState::in_progress);

    // Redelivery: b is in progress (awaits reconciliation), the effect does not run again.
    ran.clear();
    auto again = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(again) ==
          std::vector<BatchOutcome>{BatchOutcome::replayed, BatchOutcome::in_progress, BatchOutcome::replayed});
    CHECK(again[1].retry_after > std::chrono::milliseconds(0));
    CHECK(ran.empty());
}

inline void check_result_too_large(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"small", "big", "small2"});
    const std::size_t limit = store.max_result_bytes();
    auto fn = [&](std::size_t i) -> std::string {
        return batch[i].key.value() == "big" ? std::string(limit + 1, 'x') : "ok"s;
    };
    auto results = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(results) ==
          std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::failed, BatchOutcome::executed});
    CHECK(error_as<idem::response_too_large>(results[1].error).starts_with("E:"));
    auto record = store.read(batch[1].key);
    REQUIRE(record);
    CHECK(record->state == idem::RecordState::in_progress);  // the effect ran: outcome unknown
}

inline void check_fn_by_message_and_response(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"m1", "m2"});
    std::vector<std::string> seen;
    auto fn = [&](const idem::Message& m) {
        seen.push_back(m.key.value());
        return idem::Response{201, "body:" + m.key.value(), {{"X-Event", m.key.value()}}};
    };
    auto first = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(first) == std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::executed});
    auto again = idem::execute_batch(store, batch, fn);
    REQUIRE(outcomes(again) == std::vector<BatchOutcome>{BatchOutcome::replayed, BatchOutcome::replayed});
    CHECK(*again[1].response == idem::Response{201, "body:m2", {{"X-Event", "m2"}}});
    CHECK(seen == std::vector<std::string>{"m1", "m2"});
}

/// A batch mixing every answer: fresh, completed, held by someone else, and a reused id.
inline void check_mixed_batch(idem::IdempotencyStore& store, const std::string& scope) {
    // done: completed earlier; held: claimed by another consumer that has not finished.
    REQUIRE(idem::execute_batch(store, messages(scope, {"done"}), [](std::size_t) { return "old"s; })[0].outcome ==
            BatchOutcome::executed);
    const auto held_msg = message(scope, "held");
    const idem::Claim held = store.claim(held_msg.key, held_msg.fingerprint);
    REQUIRE(held.status == idem::ClaimStatus::claimed);

    const std::vector<idem::Message> batch{message(scope, "new"), message(scope, "done"), held_msg,
                                           message(scope, "done"), message(scope, "new")};
    int calls = 0;
    auto results = idem::execute_batch(store, batch, [&](std::size_t) {
        ++calls;
        return "fresh"s;
    });
    CHECK(outcomes(results) == std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::replayed,
                                                         BatchOutcome::in_progress, BatchOutcome::duplicate,
                                                         BatchOutcome::duplicate});
    CHECK(calls == 1);
    CHECK(results[1].response == "old"s);

    // The holder finishes; the next delivery replays its result.
    store.save(held_msg.key, held.fence, "held-result");
    auto later = idem::execute_batch(store, std::vector<idem::Message>{held_msg}, [&](std::size_t) {
        ++calls;
        return "never"s;
    });
    CHECK(outcomes(later) == std::vector<BatchOutcome>{BatchOutcome::replayed});
    CHECK(later[0].response == "held-result"s);
    CHECK(calls == 1);
}

/// One replay whose stored result cannot be decoded, in a batch with fresh messages: it fails alone
/// (corrupt_record); the fresh messages are executed and saved.
inline void check_undecodable_replay(idem::IdempotencyStore& store, const std::string& scope) {
    const idem::Message poisoned = message(scope, "p");
    const idem::Claim held = store.claim(poisoned.key, poisoned.fingerprint);
    REQUIRE(held.status == idem::ClaimStatus::claimed);
    store.save(poisoned.key, held.fence, "poison");

    const std::vector<idem::Message> batch{message(scope, "b"), poisoned, message(scope, "c")};
    std::vector<std::string> ran;
    std::string thrown;
    std::vector<BatchOutcome> got;
    try {
        auto results = idem::execute_batch(store, batch, [&](std::size_t i) {
            ran.push_back(batch[i].key.value());
            return Strict{"ok"};
        });
        got = outcomes(results);
        if (results[1].error) thrown = "entry: " + error_as<idem::corrupt_record>(results[1].error);
    } catch (const std::exception& e) {
        thrown = std::string("execute_batch threw: ") + e.what();
    }
    INFO(thrown);
    CHECK(got == std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::failed, BatchOutcome::executed});
    CHECK(ran == std::vector<std::string>{"b", "c"});
    for (const char* id : {"b", "c"}) {
        auto record = store.read(idem::Key{scope, id});
        INFO("key " << id);
        CHECK((record && record->state == idem::RecordState::completed));
    }
}

/// An effect whose result cannot be encoded, in a batch with others: it ran, so its outcome is
/// unknown — failed with response_not_saved (as execute_once answers), the key left in progress and
/// never run again; the others are executed and saved.
inline void check_unencodable_result(idem::IdempotencyStore& store, const std::string& scope) {
    const auto batch = messages(scope, {"a", "x", "c"});
    std::vector<std::string> ran;
    auto fn = [&](std::size_t i) {
        const std::string& id = batch[i].key.value();
        ran.push_back(id);
        return Strict{id == "x" ? "unencodable" : "done:" + id};
    };
    auto results = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(results) ==
          std::vector<BatchOutcome>{BatchOutcome::executed, BatchOutcome::failed, BatchOutcome::executed});
    CHECK_FALSE(results[1].response);
    CHECK(error_as<idem::response_not_saved>(results[1].error) ==
          "E:idem: encoding the result failed: cannot encode this value");
    CHECK(ran == std::vector<std::string>{"a", "x", "c"});
    auto record = store.read(batch[1].key);
    REQUIRE(record);
    CHECK(record->state == idem::RecordState::in_progress);
    ran.clear();
    auto again = idem::execute_batch(store, batch, fn);
    CHECK(outcomes(again) ==
          std::vector<BatchOutcome>{BatchOutcome::replayed, BatchOutcome::in_progress, BatchOutcome::replayed});
    CHECK(ran.empty());
}

}  // namespace batch_test
