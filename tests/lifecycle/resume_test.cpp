// Resume mode (ClaimOptions::resume_stale): a stale key claimed again with the same fingerprint is
// taken over as attempt 2, which sees attempt 1's recovery point; the attempt-1 owner is fenced out.
#include <catch2/catch.hpp>

#include <atomic>
#include <optional>
#include <string>

#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;

TEMPLATE_TEST_CASE("resume_stale: attempt 2 takes over a stale key and sees attempt 1's phase", "[lifecycle][resume]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& first = backend.make();   // attempt 1's instance
    auto& second = backend.make();  // the retry's instance
    const idem::Key key(fresh_scope("resume"), "payment-7");
    const auto fp = idem::fingerprint("POST /payments"s, 700);
    const auto other_fp = idem::fingerprint("POST /payments"s, 701);

    // Attempt 1: claims, records a recovery point, then hangs (never saves).
    const auto claim1 = first.claim(key, fp, Opts().lease_for(30s));
    REQUIRE(claim1.status == idem::ClaimStatus::claimed);
    first.record_phase(key, claim1.fence, "charge_created", "ch_\0\x01"s);

    std::atomic<int> runs{0};
    const auto fn = [&](idem::Context&) {
        ++runs;
        return Response{200, "must not run"};
    };
    // Before the lease passes (10 s of it left), resume mode does not take over.
    backend.advance(20s);
    CHECK(idem::execute_once(second, key, fp, fn, Opts().resume()).outcome() == Outcome::in_progress);
    backend.advance(11s);
    REQUIRE(second.read(key)->lease_expired);

    // Without resume_stale: in progress. With a different fingerprint: mismatch, not taken over.
    CHECK(idem::execute_once(second, key, fp, fn).outcome() == Outcome::in_progress);
    CHECK(idem::execute_once(second, key, other_fp, fn, Opts().resume()).outcome() == Outcome::mismatch);
    CHECK(runs == 0);
    {
        auto rec = second.read(key);
        REQUIRE(rec);
        CHECK(rec->fence == claim1.fence);
        CHECK(rec->attempt == 1);
        CHECK(rec->state == idem::RecordState::in_progress);
    }

    // Attempt 2: same fingerprint, resume mode → taken over.
    int seen_attempt = 0;
    std::optional<std::string> seen_phase, seen_data;
    bool old_save_refused = false, old_phase_refused = false;
    idem::Fence fence2 = 0;
    const auto r = idem::execute_once(
        second, key, fp,
        [&](idem::Context& ctx) {
            ++runs;
            seen_attempt = ctx.attempt();
            seen_phase = ctx.phase();
            seen_data = ctx.phase_data();
            fence2 = ctx.fence();
            // Attempt 1 wakes up while attempt 2 runs: fenced out, nothing changes.
            try {
                first.save(key, claim1.fence, encode(Response{200, "attempt 1"}));
            } catch (const idem::lease_lost&) {
                old_save_refused = true;
            }
            try {
                first.record_phase(key, claim1.fence, "attempt1-late", "x");
            } catch (const idem::lease_lost&) {
                old_phase_refused = true;
            }
            ctx.record_phase("charge_confirmed", "ch_2");
            return Response{201, "attempt 2"};
        },
        Opts().lease_for(30s).resume());
    CHECK(r.outcome() == Outcome::executed);
    CHECK(runs == 1);
    CHECK(seen_attempt == 2);
    CHECK(seen_phase == "charge_created"s);
    CHECK(seen_data == "ch_\0\x01"s);
    CHECK(fence2 != claim1.fence);
    CHECK(old_save_refused);
    CHECK(old_phase_refused);

    auto rec = first.read(key);
    REQUIRE(rec);
    CHECK(rec->state == idem::RecordState::completed);
    CHECK(rec->attempt == 2);
    CHECK(rec->fence == fence2);
    CHECK(rec->phase == "charge_confirmed"s);
    CHECK(idem::codec<Response>::decode(*rec->result).body == "attempt 2");
    // Attempt 1's save after the fact: still refused; the replay is attempt 2's.
    CHECK_THROWS_AS(first.save(key, claim1.fence, encode(Response{200, "attempt 1"})), idem::lease_lost);
    const auto replay = idem::execute_once(first, key, fp, fn, Opts().resume());
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response().body == "attempt 2");
    CHECK(runs == 1);
}

TEMPLATE_TEST_CASE("resume_stale: a takeover's claim names the fence it took over", "[lifecycle][resume]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& first = backend.make();
    auto& second = backend.make();
    const idem::Key key(fresh_scope("resume_fence"), "payment-8");
    const auto fp = idem::fingerprint("POST /payments"s, 800);
    const auto claim1 = first.claim(key, fp, Opts().lease_for(10s));
    REQUIRE(claim1.status == idem::ClaimStatus::claimed);
    CHECK(claim1.taken_over_fence == 0);  // a plain win takes nothing over
    backend.advance(11s);
    REQUIRE(second.read(key)->lease_expired);
    const auto claim2 = second.claim(key, fp, Opts().lease_for(10s).resume());
    REQUIRE(claim2.status == idem::ClaimStatus::claimed);
    CHECK(claim2.taken_over_fence == claim1.fence);
    CHECK(claim2.fence != claim1.fence);
    REQUIRE(claim2.existing);
    CHECK(claim2.existing->fence == claim2.fence);  // the record as the takeover left it
    CHECK(claim2.existing->attempt == 2);
}
