// execute_batch over MemoryStore: the default IdempotencyStore::claim_batch / save_batch (one
// claim() / save() per key) give the same answers as PostgresStore's pipelined ones. No database.
#include <catch2/catch.hpp>

#include "batch_semantics.hpp"
#include "idem/memory_store.hpp"

using namespace batch_test;

TEST_CASE("memory: an empty batch does nothing", "[batch][memory]") {
    idem::MemoryStore store;
    check_empty_batch(store);
    CHECK(store.stats().claims == 0);
}

TEST_CASE("memory: fresh messages execute once, redelivered ones replay", "[batch][memory]") {
    idem::MemoryStore store;
    check_fresh_then_replayed(store, "orders");
    CHECK(store.size() == 5);
}

TEST_CASE("memory: duplicates inside one batch run once", "[batch][memory]") {
    idem::MemoryStore store;
    check_duplicates_in_batch(store, "orders");
}

TEST_CASE("memory: same id with other content in a later batch is a mismatch", "[batch][memory]") {
    idem::MemoryStore store;
    check_mismatch_across_batches(store, "orders");
}

// Inside one batch, a second copy with other content is a mismatch, as it would be in a later batch.
TEST_CASE("memory: same id with other content inside one batch is a mismatch", "[batch][memory]") {
    idem::MemoryStore store;
    check_mismatch_inside_batch(store, "orders");
}

TEST_CASE("memory: not_performed releases that message only", "[batch][memory]") {
    idem::MemoryStore store;
    check_not_performed(store, "orders");
}

TEST_CASE("memory: an unknown failure leaves that message in progress only", "[batch][memory]") {
    idem::MemoryStore store;
    check_failed(store, "orders");
}

TEST_CASE("memory: a result over max_result_bytes fails that message only", "[batch][memory]") {
    idem::MemoryStore store(idem::MemoryStoreOptions{.max_result_bytes = 64});
    check_result_too_large(store, "orders");
}

TEST_CASE("memory: fn(message) and Response results", "[batch][memory]") {
    idem::MemoryStore store;
    check_fn_by_message_and_response(store, "orders");
}

TEST_CASE("memory: a mixed batch", "[batch][memory]") {
    idem::MemoryStore store;
    check_mixed_batch(store, "orders");
}

// An undecodable replay fails that message alone; the rest of the batch is executed and saved.
TEST_CASE("memory: an undecodable replay fails alone", "[batch][memory]") {
    idem::MemoryStore store;
    check_undecodable_replay(store, "orders");
}

// A result that cannot be encoded fails that message alone (response_not_saved, left in progress).
TEST_CASE("memory: an unencodable result fails alone, in progress", "[batch][memory]") {
    idem::MemoryStore store;
    check_unencodable_result(store, "orders");
}
