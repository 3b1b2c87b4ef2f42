// pg::ClaimMachine fed canned answers (no database): every decision of a claim, the one copy of the
// rules the blocking store, idem::asio, group commit and batches follow.
#include <catch2/catch.hpp>

#include <chrono>
#include <stdexcept>

#include "canned.hpp"
#include "idem/errors.hpp"
#include "postgres/sansio/machine.hpp"

using namespace std::chrono_literals;
using idem::ClaimStatus;
using idem::pg::ClaimMachine;
using idem::pg::ReclaimAnswer;
using Next = ClaimMachine::Next;

namespace {

// A clock the test moves by hand (the wait's end and its polls).
idem::pg::Clock::time_point fake_now{};
idem::pg::Clock::time_point now() noexcept { return fake_now; }

constexpr idem::Fence kOurs = 41;
constexpr int kAttempts = 3;
constexpr auto kMaxRetryAfter = 5000ms;

struct Fixture {
    idem::Claim out;
    idem::Fingerprint fp = idem::fingerprint(std::string_view("request"));
    idem::ClaimOptions options;
    Fixture() { fake_now = idem::pg::Clock::time_point{} + 1000s; }
    ClaimMachine machine() { return ClaimMachine(out, kOurs, fp, options, kAttempts, kMaxRetryAfter, &now); }
};

// [INSERT, SELECT]: the INSERT inserted (its RETURNING row) or not, and what the SELECT read.
idem::pg::StepResults inserted() { return canned::answers(canned::ran(1, {{canned::int8(kOurs)}}), canned::none(14)); }
idem::pg::StepResults read(const canned::Row& row) { return canned::answers(canned::none(), canned::found(row)); }

}  // namespace

TEST_CASE("a claim whose INSERT inserted has won the key with its fence") {
    Fixture f;
    auto m = f.machine();
    auto res = inserted();
    CHECK(m.on_round_trip(res) == Next::done);
    CHECK(m.won());
    CHECK(f.out.status == ClaimStatus::claimed);
    CHECK(f.out.fence == kOurs);
    CHECK_FALSE(f.out.existing);
    CHECK(f.out.taken_over_fence == 0);
}

TEST_CASE("a claim that finds a record decides by its state and fingerprint") {
    Fixture f;
    canned::Row row;
    row.fingerprint = f.fp;

    SECTION("completed, same request: a replay of the stored bytes") {
        row.state = "completed", row.result = "stored bytes";
        auto m = f.machine();
        auto res = read(row);
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(f.out.status == ClaimStatus::completed);
        CHECK(f.out.fence == 0);
        REQUIRE(f.out.existing);
        CHECK(f.out.existing->result == "stored bytes");
        CHECK_FALSE(m.won());
    }
    SECTION("completed, another request: a mismatch") {
        row.state = "completed", row.result = "stored bytes";
        row.fingerprint = idem::fingerprint(std::string_view("another request"));
        auto m = f.machine();
        auto res = read(row);
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(f.out.status == ClaimStatus::mismatch);
    }
    SECTION("in progress under another fence: in_progress, with a retry-after within the bound") {
        row.fence = kOurs + 1;
        row.lease_until = std::chrono::system_clock::now() + 2s;
        auto m = f.machine();
        auto res = read(row);
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(f.out.status == ClaimStatus::in_progress);
        CHECK(f.out.retry_after > 0ms);
        CHECK(f.out.retry_after <= kMaxRetryAfter);
    }
    SECTION("in progress under our own fence: ours, from an attempt whose answer was lost") {
        row.fence = kOurs;
        auto m = f.machine();
        auto res = read(row);
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(m.won());
        CHECK(f.out.fence == kOurs);
        CHECK_FALSE(f.out.existing);
    }
    SECTION("completed under our own fence is no claim of ours") {
        row.fence = kOurs, row.state = "completed", row.result = "bytes";
        auto m = f.machine();
        auto res = read(row);
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(f.out.status == ClaimStatus::completed);
    }
}

TEST_CASE("a record past its retention is claimed again, with one winner") {
    Fixture f;
    canned::Row row;
    row.fence = kOurs + 1, row.state = "completed", row.result = "old", row.expired = true;
    auto m = f.machine();
    auto res = read(row);
    REQUIRE(m.on_round_trip(res) == Next::reclaim_expired);

    SECTION("won: claimed, nothing of the old record kept") {
        CHECK(m.on_reclaimed(ReclaimAnswer::won) == Next::done);
        CHECK(m.won());
        CHECK(f.out.fence == kOurs);
        CHECK_FALSE(f.out.existing);
    }
    SECTION("lost to another re-claimer: read again at once") {
        CHECK(m.on_reclaimed(ReclaimAnswer::lost) == Next::round_trip);
        CHECK_FALSE(m.retrying());
        CHECK_FALSE(f.out.existing);
    }
    SECTION("busy (a concurrent re-claimer holds the row): a retry after a pause, then in_progress") {
        CHECK(m.on_reclaimed(ReclaimAnswer::busy) == Next::round_trip);
        CHECK(m.retrying());
        CHECK(m.pause() > 0ms);
        CHECK(m.on_reclaimed(ReclaimAnswer::busy) == Next::round_trip);
        CHECK(m.on_reclaimed(ReclaimAnswer::busy) == Next::done);  // kAttempts in all
        CHECK(f.out.status == ClaimStatus::in_progress);
        CHECK(f.out.retry_after == kMaxRetryAfter);
        CHECK_FALSE(f.out.existing);
    }
}

TEST_CASE("a claim that reads nothing tries again, then answers in_progress") {
    Fixture f;
    auto m = f.machine();
    // The conflicting claim was released or rolled back between the INSERT and the SELECT.
    auto nothing = canned::answers(canned::none(), canned::none(14));
    CHECK(m.on_round_trip(nothing) == Next::round_trip);
    CHECK(m.retrying());
    CHECK(m.pause() == 0ms);  // nothing failed: at once
    nothing = canned::answers(canned::none(), canned::none(14));
    CHECK(m.on_round_trip(nothing) == Next::round_trip);
    nothing = canned::answers(canned::none(), canned::none(14));
    CHECK(m.on_round_trip(nothing) == Next::done);
    CHECK(f.out.status == ClaimStatus::in_progress);
    CHECK(f.out.retry_after == kMaxRetryAfter);
}

TEST_CASE("a claim's failed statement: retried when the key was busy, the caller's error otherwise") {
    Fixture f;
    SECTION("40001, 40P01, 55P03: busy, retried after a pause, then in_progress") {
        const char* state = GENERATE("40001", "40P01", "55P03");
        auto m = f.machine();
        for (int i = 1; i < kAttempts; ++i) {
            auto res = canned::answers(canned::failed(state), canned::aborted());
            CHECK(m.on_round_trip(res) == Next::round_trip);
            CHECK(m.retrying());
            CHECK(m.pause() > 0ms);
        }
        auto res = canned::answers(canned::failed(state), canned::aborted());
        CHECK(m.on_round_trip(res) == Next::done);
        CHECK(f.out.status == ClaimStatus::in_progress);
    }
    SECTION("a missing privilege or table: config_error, nothing claimed") {
        const char* state = GENERATE("42501", "42P01", "28P01", "3D000");
        auto m = f.machine();
        auto res = canned::answers(canned::failed(state), canned::aborted());
        CHECK_THROWS_AS(m.on_round_trip(res), idem::config_error);
        CHECK(f.out.status != ClaimStatus::claimed);
    }
    SECTION("a cancel, a timeout, a shortage: store_unavailable") {
        const char* state = GENERATE("57014", "53300", "08006", "57P01");
        auto m = f.machine();
        auto res = canned::answers(canned::failed(state), canned::aborted());
        CHECK_THROWS_AS(m.on_round_trip(res), idem::store_unavailable);
    }
    SECTION("an INSERT whose read failed after it was rolled back with it: never a claim") {
        auto m = f.machine();
        idem::pg::StepResult insert = canned::ran(1, {{canned::int8(kOurs)}});
        insert.rolled_back = true;
        auto res = canned::answers(std::move(insert), canned::failed("57014"));
        CHECK_THROWS_AS(m.on_round_trip(res), idem::store_unavailable);
        CHECK_FALSE(m.won());
    }
}

TEST_CASE("resume mode takes over a claim whose lease passed") {
    Fixture f;
    f.options.resume_stale = true;
    canned::Row row;
    row.fence = 99, row.lease_expired = true, row.fingerprint = f.fp;
    auto m = f.machine();
    auto res = read(row);
    REQUIRE(m.on_round_trip(res) == Next::take_over);
    CHECK(m.stale_fence() == 99);

    SECTION("taken: claimed, naming the fence taken over") {
        idem::Record taken;
        taken.fence = kOurs, taken.attempt = 2, taken.phase = "charged";
        CHECK(m.on_taken_over(taken) == Next::done);
        CHECK(m.won());
        CHECK(m.took_over());
        CHECK(f.out.taken_over_fence == 99);
        REQUIRE(f.out.existing);
        CHECK(f.out.existing->attempt == 2);
        CHECK(f.out.existing->phase == "charged");
    }
    SECTION("another taker won: read again") {
        CHECK(m.on_taken_over(std::nullopt) == Next::round_trip);
        CHECK_FALSE(m.took_over());
        CHECK_FALSE(f.out.existing);
    }
}

TEST_CASE("a lease that passed is not taken over without resume mode") {
    Fixture f;
    canned::Row row;
    row.fence = 99, row.lease_expired = true, row.fingerprint = f.fp;
    auto m = f.machine();
    auto res = read(row);
    CHECK(m.on_round_trip(res) == Next::done);
    CHECK(f.out.status == ClaimStatus::in_progress);
}

TEST_CASE("a claim that may wait waits for the owner's save, by the clock it is given") {
    Fixture f;
    f.options.wait = 1000ms;
    canned::Row row;
    row.fence = 99, row.fingerprint = f.fp;
    auto m = f.machine();
    CHECK(m.wait_until() == fake_now + 1000ms);
    auto res = read(row);
    REQUIRE(m.on_round_trip(res) == Next::wait);

    SECTION("polls 20 ms apart at first, then twice as far, at most 200 ms, never past the end") {
        const auto start = fake_now;
        CHECK(m.next_poll() == start + 20ms);
        CHECK(m.next_poll() == start + 40ms);
        CHECK(m.next_poll() == start + 80ms);
        CHECK(m.next_poll() == start + 160ms);
        CHECK(m.next_poll() == start + 200ms);
        CHECK(m.next_poll() == start + 200ms);
        fake_now = start + 900ms;
        CHECK(m.next_poll() == start + 1000ms);
    }
    SECTION("a poll that finds it still running waits on; past the end it answers in_progress") {
        auto still = canned::answers(canned::ran(1, {{canned::boolean(false)}}));
        CHECK(m.on_polled(still) == Next::wait);
        fake_now += 1000ms;
        still = canned::answers(canned::ran(1, {{canned::boolean(false)}}));
        CHECK(m.on_polled(still) == Next::done);
        CHECK(f.out.status == ClaimStatus::in_progress);
        CHECK(f.out.retry_after <= kMaxRetryAfter);
    }
    SECTION("a poll that finds the row changed (saved, released) reads again") {
        auto gone = canned::answers(canned::none());
        CHECK(m.on_polled(gone) == Next::round_trip);
        CHECK_FALSE(f.out.existing);
    }
    SECTION("a failed poll is the caller's error") {
        auto failed = canned::answers(canned::failed("57014"));
        CHECK_THROWS_AS(m.on_polled(failed), idem::store_unavailable);
    }
    SECTION("a notification reads again; a wait cut short answers in_progress") {
        CHECK(m.on_waited(true) == Next::round_trip);
        auto again = read(row);
        REQUIRE(m.on_round_trip(again) == Next::wait);
        CHECK(m.on_waited(false) == Next::done);
        CHECK(f.out.status == ClaimStatus::in_progress);
    }
    SECTION("past the wait's end, a record in progress is answered at once") {
        CHECK(m.on_waited(true) == Next::round_trip);
        fake_now += 1001ms;
        auto again = read(row);
        CHECK(m.on_round_trip(again) == Next::done);
        CHECK(f.out.status == ClaimStatus::in_progress);
    }
}

TEST_CASE("a group's answers go through the same decisions") {
    Fixture f;
    SECTION("won") {
        auto m = f.machine();
        CHECK(m.on_won() == Next::done);
        CHECK(m.won());
        CHECK(f.out.fence == kOurs);
    }
    SECTION("found: the record decoded into the claim decides") {
        auto m = f.machine();
        idem::Record& r = f.out.existing.emplace();
        r.fence = kOurs, r.state = idem::RecordState::in_progress;
        CHECK(m.on_found() == Next::done);
        CHECK(m.won());  // ours, from a group whose answer was lost
    }
    SECTION("absent after a conflict: a retry after a pause") {
        auto m = f.machine();
        CHECK(m.on_absent(true) == Next::round_trip);
        CHECK(m.retrying());
        CHECK(m.pause() > 0ms);
    }
}

TEST_CASE("a caller that answers a busy key at once gets in_progress with the longest retry-after") {
    Fixture f;
    auto m = f.machine();
    CHECK(m.on_busy() == Next::done);
    CHECK(f.out.status == ClaimStatus::in_progress);
    CHECK(f.out.fence == 0);
    CHECK(f.out.retry_after == kMaxRetryAfter);
    CHECK_FALSE(m.won());
}

TEST_CASE("resume mode leaves a claim whose lease has not passed") {
    Fixture f;
    f.options.resume_stale = true;
    canned::Row row;
    row.fence = 99, row.fingerprint = f.fp;  // lease_expired false
    auto m = f.machine();
    auto res = read(row);
    CHECK(m.on_round_trip(res) == Next::done);
    CHECK(f.out.status == ClaimStatus::in_progress);
    CHECK_FALSE(m.took_over());
}

TEST_CASE("in_progress says to retry when the owner's lease ends") {
    Fixture f;
    canned::Row row;
    row.fence = 99, row.fingerprint = f.fp;
    row.lease_until = std::chrono::system_clock::now() + 2s;
    auto m = f.machine();
    auto res = read(row);
    REQUIRE(m.on_round_trip(res) == Next::done);
    CHECK(f.out.retry_after > 1000ms);
    CHECK(f.out.retry_after <= 2000ms);
}

TEST_CASE("a poll in resume mode that finds the lease passed reads again, to take it over") {
    Fixture f;
    f.options.resume_stale = true;
    f.options.wait = 1000ms;
    canned::Row row;
    row.fence = 99, row.fingerprint = f.fp;
    auto m = f.machine();
    auto res = read(row);
    REQUIRE(m.on_round_trip(res) == Next::wait);
    auto passed = canned::answers(canned::ran(1, {{canned::boolean(true)}}));
    CHECK(m.on_polled(passed) == Next::round_trip);
    row.lease_expired = true;
    auto again = read(row);
    CHECK(m.on_round_trip(again) == Next::take_over);
}

TEST_CASE("our own in-progress row is ours even past its retention") {
    // Ours is decided before expiry: re-claiming our own row would need a fence it already has.
    Fixture f;
    canned::Row row;
    row.fence = kOurs, row.expired = true;
    auto m = f.machine();
    auto res = read(row);
    CHECK(m.on_round_trip(res) == Next::done);
    CHECK(m.won());
}

TEST_CASE("a claim won after a busy attempt carries nothing of it") {
    Fixture f;
    f.out.retry_after = 123ms, f.out.taken_over_fence = 5;
    auto m = f.machine();
    CHECK(m.on_absent(true) == Next::round_trip);
    CHECK(m.pause() > 0ms);
    auto res = inserted();
    CHECK(m.on_round_trip(res) == Next::done);
    CHECK(m.pause() == 0ms);
    CHECK_FALSE(m.retrying());
    CHECK(f.out.retry_after == 0ms);
    CHECK(f.out.taken_over_fence == 0);
    CHECK(f.out.fence == kOurs);
}

TEST_CASE("a busy answer after a retry does not ask for another pause") {
    Fixture f;
    auto m = f.machine();
    CHECK(m.on_absent(true) == Next::round_trip);
    CHECK(m.on_busy() == Next::done);
    CHECK_FALSE(m.retrying());
    CHECK(m.pause() == 0ms);
}
