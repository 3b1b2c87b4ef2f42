// The engine's runners (pg::run_claim, pg::run_op) over a driver that answers from a script (no
// database), and pg::Immediate, the blocking store's coroutine type: the order of the steps a
// claim takes, what it counts and announces, and how errors leave it.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "canned.hpp"
#include "idem/errors.hpp"
#include "postgres/immediate.hpp"
#include "postgres/sansio/runner.hpp"
#include "postgres/sansio/sql.hpp"

using namespace std::chrono_literals;
using idem::ClaimStatus;
using idem::pg::ClaimMachine;
using idem::pg::Immediate;
using idem::pg::Tally;
using Next = ClaimMachine::Next;

namespace {

constexpr idem::Fence kOurs = 41;

// A driver whose every answer comes from the test: the round trips' and the statements' in order.
// It writes down what the runner asked of it.
struct Scripted {
    template <class T>
    using Task = Immediate<T>;
    struct Conn {};

    std::optional<Next> first;                  // first_attempt's answer
    std::deque<idem::pg::StepResults> answers;  // round trips and statements, in order
    std::vector<std::string> log;
    int claims = 0, won = 0, retries = 0, taken_over_events = 0;
    std::vector<std::chrono::milliseconds> pauses;
    Next after_wait = Next::done;

    idem::pg::StepResults next_answer() {
        if (answers.empty()) throw std::logic_error("the runner asked for more than the script has");
        auto res = std::move(answers.front());
        answers.pop_front();
        return res;
    }
    std::optional<Next> first_attempt(const idem::pg::ClaimCall&, ClaimMachine&) {
        log.emplace_back("first");
        return first;
    }
    idem::pg::StepResults round_trip(const idem::pg::ClaimCall&) {
        log.emplace_back("round trip");
        return next_answer();
    }
    idem::pg::StepResults run_one(Conn&, idem::pg::Stmt stmt, idem::pg::Params&) {
        log.emplace_back("statement " + std::to_string(static_cast<int>(stmt)));
        return next_answer();
    }
    template <class Op>
    Immediate<void> drive(const char* what, Op& op) {
        log.emplace_back(what);
        Conn conn;
        return idem::pg::run_op(*this, conn, op, 1);
    }
    Next wait_for_save(const idem::pg::ClaimCall&, ClaimMachine&) {
        log.emplace_back("wait");
        return after_wait;
    }
    idem::pg::Done pause(std::chrono::milliseconds d) {
        pauses.push_back(d);
        return {};
    }
    void tally(Tally t) { (t == Tally::claim ? claims : t == Tally::claim_won ? won : retries) += 1; }
    void taken_over(const idem::Key&) { ++taken_over_events; }
};

struct Fixture {
    idem::Key key{"tenant", "k1"};
    idem::Fingerprint fp = idem::fingerprint(std::string_view("request"));
    idem::ClaimOptions options;
    idem::Claim out;
    Scripted driver;
    void run() {
        const idem::pg::ClaimCall call{key, fp, kOurs, 30s, 3600s};
        ClaimMachine machine(out, kOurs, fp, options, 3, 5000ms);
        idem::pg::run_claim(driver, call, machine).get();
    }
};

idem::pg::StepResults inserted() { return canned::answers(canned::ran(1, {{canned::int8(kOurs)}}), canned::none(14)); }
idem::pg::StepResults busy() { return canned::answers(canned::failed("55P03"), canned::aborted()); }
idem::pg::StepResults read(const canned::Row& row) { return canned::answers(canned::none(), canned::found(row)); }

}  // namespace

TEST_CASE("a claim that the first attempt leaves undecided sends its round trip, once") {
    Fixture f;
    f.driver.answers.push_back(inserted());
    f.run();
    CHECK(f.out.status == ClaimStatus::claimed);
    CHECK(f.driver.log == std::vector<std::string>{"first", "round trip"});
    CHECK(f.driver.claims == 1);
    CHECK(f.driver.won == 1);
    CHECK(f.driver.retries == 0);
    CHECK(f.driver.pauses.empty());
}

TEST_CASE("a claim the first attempt decided sends nothing more") {
    Fixture f;
    f.driver.first = Next::done;
    f.run();
    CHECK(f.driver.log == std::vector<std::string>{"first"});
    CHECK(f.driver.claims == 1);
    CHECK(f.driver.won == 0);  // the machine was told nothing: not won
}

TEST_CASE("a busy key is tried again after a pause, each retry counted") {
    Fixture f;
    f.driver.answers.push_back(busy());
    f.driver.answers.push_back(busy());
    f.driver.answers.push_back(inserted());
    f.run();
    CHECK(f.out.status == ClaimStatus::claimed);
    CHECK(f.driver.log == std::vector<std::string>{"first", "round trip", "round trip", "round trip"});
    CHECK(f.driver.retries == 2);
    REQUIRE(f.driver.pauses.size() == 2);
    CHECK(f.driver.pauses[0] > 0ms);
    CHECK(f.driver.won == 1);
}

TEST_CASE("a retry the group's answer asked for pauses before its round trip") {
    Fixture f;
    f.driver.first = Next::round_trip;  // e.g. a group that found nothing after a conflict
    f.driver.answers.push_back(inserted());
    f.run();
    CHECK(f.driver.log == std::vector<std::string>{"first", "round trip"});
    CHECK(f.out.status == ClaimStatus::claimed);
}

TEST_CASE("an expired record is claimed again by its own statement") {
    Fixture f;
    canned::Row row;
    row.expired = true, row.state = "completed", row.result = "old", row.fingerprint = f.fp;
    f.driver.answers.push_back(read(row));
    SECTION("won") {
        f.driver.answers.push_back(canned::answers(canned::ran(1, {{canned::int8(kOurs)}})));
        f.run();
        CHECK(f.out.status == ClaimStatus::claimed);
        CHECK(f.driver.won == 1);
    }
    SECTION("lost to another re-claimer: read again, and replay or wait as the row says") {
        f.driver.answers.push_back(canned::answers(canned::none()));
        canned::Row theirs;
        theirs.fence = 5, theirs.fingerprint = f.fp;
        f.driver.answers.push_back(read(theirs));
        f.run();
        CHECK(f.out.status == ClaimStatus::in_progress);
        CHECK(f.driver.won == 0);
    }
    const std::string reclaim = "statement " + std::to_string(static_cast<int>(idem::pg::kReclaimExpired));
    REQUIRE(f.driver.log.size() >= 4);
    CHECK(f.driver.log[2] == "claim (expired)");
    CHECK(f.driver.log[3] == reclaim);
}

TEST_CASE("resume mode takes a stale claim over, and says so once") {
    Fixture f;
    f.options.resume_stale = true;
    canned::Row stale;
    stale.fence = 99, stale.lease_expired = true, stale.fingerprint = f.fp;
    f.driver.answers.push_back(read(stale));
    canned::Row taken = stale;
    taken.fence = kOurs, taken.attempt = 2, taken.lease_expired = false;
    f.driver.answers.push_back(canned::answers(canned::found(taken)));
    f.run();
    CHECK(f.out.status == ClaimStatus::claimed);
    CHECK(f.out.taken_over_fence == 99);
    CHECK(f.driver.taken_over_events == 1);
    CHECK(f.driver.won == 1);
    CHECK(f.driver.log[2] == "take_over");
}

TEST_CASE("a claim that may wait hands the wait to the driver and goes on as it answers") {
    Fixture f;
    f.options.wait = 1000ms;
    canned::Row running;
    running.fence = 99, running.fingerprint = f.fp;
    f.driver.answers.push_back(read(running));
    f.driver.after_wait = Next::round_trip;  // the owner saved: read it
    canned::Row saved = running;
    saved.state = "completed", saved.result = "stored bytes";
    f.driver.answers.push_back(read(saved));
    f.run();
    CHECK(f.driver.log == std::vector<std::string>{"first", "round trip", "wait", "round trip"});
    CHECK(f.out.status == ClaimStatus::completed);
}

TEST_CASE("an error leaves the runner as the caller's exception") {
    Fixture f;
    SECTION("from the machine: a missing table is config_error") {
        f.driver.answers.push_back(canned::answers(canned::failed("42P01"), canned::aborted()));
        CHECK_THROWS_AS(f.run(), idem::config_error);
    }
    SECTION("from the driver") {
        CHECK_THROWS_AS(f.run(), std::logic_error);  // the script is empty
    }
    CHECK(f.driver.won == 0);
}

namespace {
Immediate<int> forty_two() { co_return 42; }
Immediate<int> add_one(int (*source)()) { co_return co_await source() + 1; }
Immediate<int> nested() {
    const int v = co_await forty_two();
    co_return v * 2;
}
Immediate<void> throws() {
    co_await idem::pg::Done{};
    throw idem::store_unavailable("away");
}
Immediate<std::string> by_reference(std::string& s) {
    std::string& same = co_await s;
    same += "!";
    co_return same;
}
}  // namespace

TEST_CASE("an Immediate runs to completion when called") {
    CHECK(forty_two().get() == 42);
    CHECK(add_one([] { return 1; }).get() == 2);
    CHECK(nested().get() == 84);
    CHECK_THROWS_AS(throws().get(), idem::store_unavailable);
    std::string s = "x";
    CHECK(by_reference(s).get() == "x!");
    CHECK(s == "x!");  // an lvalue is awaited by reference
}

namespace {
// Runs an Immediate from a thread_local destructor that runs after the thread's frame cache is
// gone (made before the cache, so destroyed after it): the frame comes from the heap.
struct LateCaller {
    bool armed = false;
    ~LateCaller() {
        if (armed) late_value = forty_two().get();
    }
    static inline std::atomic<int> late_value{0};
};
}  // namespace

TEST_CASE("an Immediate called after its thread's frame cache is destroyed uses the heap") {
    LateCaller::late_value = 0;
    int first = 0;
    std::thread t([&first] {
        thread_local LateCaller late;  // before the cache: destroyed after it
        late.armed = true;
        first = nested().get();  // makes the cache, and leaves frames in it
    });
    t.join();
    CHECK(first == 84);
    CHECK(LateCaller::late_value == 42);
}

TEST_CASE("a re-claim of an expired key that meets a newer claim in its generation reads again") {
    // With generations the re-claim moves the row into the current generation: a claim written
    // there meanwhile (its lookup no longer saw the expired row, whose generation was being
    // retired) makes it a unique_violation. That claim won; the re-claimer reads the key again.
    idem::Key key{"tenant", "k1"};
    const auto fp = idem::fingerprint(std::string_view("request"));
    idem::pg::ReclaimExpiredOp op(key, fp, kOurs, 30s, 3600s);
    op.start(1);
    CHECK(op.feed(canned::answers(canned::failed("23505"))));
    CHECK(op.answer() == idem::pg::ReclaimAnswer::lost);
    op.start(1);
    CHECK(op.feed(canned::answers(canned::failed("55P03"))));
    CHECK(op.answer() == idem::pg::ReclaimAnswer::busy);
    op.start(1);
    CHECK_THROWS_AS(op.feed(canned::answers(canned::failed("42501"))), idem::config_error);
}
