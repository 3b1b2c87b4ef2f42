// Leases and fencing: take_over after the lease passes fences the old owner out; a heartbeat
// (Context::extend_lease) keeps the key; every write with a stale fence is refused (lease_lost).
#include <catch2/catch.hpp>

#include <atomic>
#include <optional>
#include <string>

#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;

TEMPLATE_TEST_CASE("take_over fences the old owner out; the new owner's save is what replays", "[lifecycle][lease]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& owner = backend.make();
    auto& other = backend.make();  // another party (another instance for PostgreSQL)
    const idem::Key key(fresh_scope("lease"), "k1");
    const auto fp = idem::fingerprint("POST /charges"s, 100);

    const auto claim = owner.claim(key, fp, Opts().lease_for(30s));
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const idem::Fence old_fence = claim.fence;

    // Before the lease passes (20 s of it, so 10 s are left): nobody can take it.
    backend.advance(20s);
    CHECK_FALSE(owner.read(key)->lease_expired);
    CHECK_FALSE(other.take_over(key, old_fence, 30s, false));
    CHECK(owner.read(key)->fence == old_fence);

    backend.advance(11s);
    REQUIRE(owner.read(key)->lease_expired);
    const auto new_fence = other.take_over(key, old_fence, 30s, false);
    REQUIRE(new_fence);
    CHECK(*new_fence != old_fence);
    // A second taker naming the old fence loses.
    CHECK_FALSE(owner.take_over(key, old_fence, 30s, false));

    // The old owner's writes are refused and change nothing.
    const std::string old_bytes = encode(Response{201, "old owner"});
    CHECK_THROWS_AS(owner.save(key, old_fence, old_bytes), idem::lease_lost);
    CHECK_THROWS_AS(owner.record_phase(key, old_fence, "late-phase", "late"), idem::lease_lost);
    CHECK_THROWS_AS(owner.extend_lease(key, old_fence, 60s), idem::lease_lost);
    CHECK_THROWS_AS(owner.release(key, old_fence), idem::lease_lost);
    auto rec = owner.read(key);
    REQUIRE(rec);
    CHECK(rec->state == idem::RecordState::in_progress);
    CHECK(rec->fence == *new_fence);
    CHECK(rec->attempt == 1);  // a reconciler-style takeover is not a new attempt
    CHECK_FALSE(rec->result);
    CHECK_FALSE(rec->phase);
    CHECK_FALSE(rec->lease_expired);  // the new owner's lease (30 s) is running

    // The new owner's save wins and is replayed byte for byte.
    const Response winner{201, "new owner \0\xff bytes"s, {{"X-Fence", "new"}, {"X-Empty", ""}}};
    const std::string new_bytes = encode(winner);
    REQUIRE_NOTHROW(other.save(key, *new_fence, new_bytes));
    CHECK_THROWS_AS(owner.save(key, old_fence, old_bytes), idem::lease_lost);
    CHECK_THROWS_AS(other.release(key, *new_fence), idem::lease_lost);  // completed: no more release
    CHECK_THROWS_AS(other.record_phase(key, *new_fence, "after", "x"), idem::lease_lost);
    CHECK_THROWS_AS(other.extend_lease(key, *new_fence, 60s), idem::lease_lost);
    std::atomic<int> runs{0};
    const auto replay = idem::execute_once(owner, key, fp, [&] {
        ++runs;
        return Response{500, "must not run"};
    });
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(runs == 0);
    CHECK(replay.response() == winner);
    CHECK(encode(replay.response()) == new_bytes);
    CHECK(*owner.read(key)->result == new_bytes);
}

TEMPLATE_TEST_CASE("a heartbeat (Context::extend_lease) keeps the key; without it take_over wins", "[lifecycle][lease]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make();
    auto& taker = backend.make();
    const auto fp = idem::fingerprint("long effect"s);

    // Lease 30 s. While the effect runs, time moves in steps (backend.advance) and after each step
    // the other party tries take_over: a lease with 10 s left cannot pass early, however slow the
    // machine, and one that has passed is taken at the first try.

    SECTION("a heartbeat after every 20 s step: never taken over, though 100 s pass") {
        const idem::Key key(fresh_scope("heartbeat"), "hb");
        int tries = 0;
        int taken = 0;
        const auto result = idem::execute_once(
            store, key, fp,
            [&](idem::Context& ctx) {
                for (int step = 0; step < 5; ++step) {
                    backend.advance(20s);
                    ctx.extend_lease(30s);
                    ++tries;
                    if (taker.take_over(key, ctx.fence(), 30s, false)) ++taken;
                }
                return Response{200, "kept"};
            },
            Opts().lease_for(30s));
        CHECK(result.outcome() == Outcome::executed);
        CHECK(tries == 5);
        CHECK(taken == 0);
        CHECK(store.read(key)->state == idem::RecordState::completed);
    }

    SECTION("no heartbeat: taken over once the lease passes; the old attempt's extend and save are refused") {
        const idem::Key key(fresh_scope("no-heartbeat"), "nhb");
        std::optional<idem::Fence> taken_early, taken;
        bool extend_refused = false;
        bool save_refused = false;
        try {
            (void)idem::execute_once(
                store, key, fp,
                [&](idem::Context& ctx) {
                    backend.advance(20s);
                    taken_early = taker.take_over(key, ctx.fence(), 30s, false);  // 10 s of the lease left
                    backend.advance(11s);
                    taken = taker.take_over(key, ctx.fence(), 30s, false);  // passed 1 s ago
                    try {
                        ctx.extend_lease(30s);
                    } catch (const idem::lease_lost&) {
                        extend_refused = true;
                    }
                    return Response{200, "too late"};
                },
                Opts().lease_for(30s));
        } catch (const idem::lease_lost&) {
            save_refused = true;
        }
        CHECK_FALSE(taken_early);
        REQUIRE(taken);
        CHECK(extend_refused);
        CHECK(save_refused);
        auto rec = store.read(key);
        REQUIRE(rec);
        CHECK(rec->state == idem::RecordState::in_progress);
        CHECK(rec->fence == *taken);
        CHECK_FALSE(rec->result);
    }
}

TEMPLATE_TEST_CASE("a second save by the same fence on a completed key is refused and changes nothing",
                   "[lifecycle][lease][save_twice]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(fresh_scope("save-twice"), "k");
    const auto fp = idem::fingerprint("save twice"s);
    const auto claim = store.claim(key, fp);
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const std::string first = encode(Response{201, "first"});
    const std::string second = encode(Response{500, "second"});
    REQUIRE_NOTHROW(store.save(key, claim.fence, first));
    // store.hpp: "A write whose fence no longer owns the key throws lease_lost and changes nothing";
    // a completed key is owned by nobody (MemoryStore refuses it). Accepting it silently would tell
    // the caller `second` is stored when `first` is.
    CHECK_THROWS_AS(store.save(key, claim.fence, second), idem::lease_lost);
    CHECK(*store.read(key)->result == first);
}
