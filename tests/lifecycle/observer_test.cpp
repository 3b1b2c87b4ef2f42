// Observer: a scripted sequence of outcomes is counted exactly, event by event.
#include <catch2/catch.hpp>

#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "idem/observer.hpp"
#include "idem/reconciler.hpp"
#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Event;
using idem::Outcome;
using idem::Response;

namespace {

struct Declined : idem::not_performed {
    Declined() : idem::not_performed("declined before charging") {}
};

}  // namespace

TEMPLATE_TEST_CASE("CountingObserver counts every outcome of a scripted sequence exactly", "[lifecycle][observer]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make();
    auto counts = std::make_shared<idem::CountingObserver>();
    store.set_observer(counts);
    const auto scope = fresh_scope("observer");
    const auto fp = idem::fingerprint("POST /observe"s);
    const auto other_fp = idem::fingerprint("POST /observe"s, 2);
    const auto key = [&](const std::string& v) { return idem::Key(scope, v); };
    const auto ok = [](const std::string& body) { return [body] { return Response{200, body}; }; };

    // Time moves by backend.advance only: leases of 30 s, retention of 60 s (p1, p2), then 70 s pass.
    // executed ×2 with a 60 s retention (purged at the end).
    CHECK(idem::execute_once(store, key("p1"), fp, ok("p1"), Opts().retain(60s)).outcome() == Outcome::executed);
    CHECK(idem::execute_once(store, key("p2"), fp, ok("p2"), Opts().retain(60s)).outcome() == Outcome::executed);
    // executed ×3, each with some work so its duration is measurable.
    for (const char* k : {"k1", "k2", "k3"}) {
        CHECK(idem::execute_once(store, key(k), fp, [] {
                  std::this_thread::sleep_for(2ms);
                  return Response{201, "done"};
              }).outcome() == Outcome::executed);
    }
    // replayed ×2, mismatch ×1.
    CHECK(idem::execute_once(store, key("k1"), fp, ok("x")).outcome() == Outcome::replayed);
    CHECK(idem::execute_once(store, key("k2"), fp, ok("x")).outcome() == Outcome::replayed);
    CHECK(idem::execute_once(store, key("k1"), other_fp, ok("x")).outcome() == Outcome::mismatch);
    // in_progress ×1 (the claim itself, made directly, is not an execute_once event).
    REQUIRE(store.claim(key("busy"), fp, Opts().lease_for(1h)).status == idem::ClaimStatus::claimed);
    CHECK(idem::execute_once(store, key("busy"), fp, ok("x")).outcome() == Outcome::in_progress);
    // released ×1.
    CHECK_THROWS_AS(idem::execute_once(store, key("declined"), fp, [&]() -> Response { throw Declined(); }), Declined);
    // unknown ×3 (lease 30 s).
    for (const char* k : {"u-resume", "u-save", "u-release"}) {
        CHECK_THROWS_AS(idem::execute_once(
                            store, key(k), fp, [&]() -> Response { throw std::runtime_error("provider timeout"); },
                            Opts().lease_for(30s)),
                        std::runtime_error);
    }
    backend.advance(70s);  // the u-* leases and p1/p2's retention have passed (not busy's: 1 h)
    // taken_over ×1 + executed ×1: resume mode.
    CHECK(idem::execute_once(store, key("u-resume"), fp, ok("resumed"), Opts().resume()).outcome() ==
          Outcome::executed);
    // taken_over ×2 + reconciled ×2: a reconciler saves one and releases the other.
    idem::Reconciler reconciler(
        store,
        [](idem::Reconciliation& r) {
            if (r.key().value() == "u-save") {
                r.save(Response{201, "reconciled"});
            } else {
                r.release();
            }
        },
        reconciler_options(100, 30s, idem::ScopeFilter::exact(scope)));
    const auto sweep = reconciler.run_once();
    CHECK(sweep.saved == 1);
    CHECK(sweep.released == 1);
    // purged 2 (p1, p2): their retention passed.
    CHECK(store.purge_expired() == 2);

    const auto s = counts->snapshot();
    CHECK(s.count(Event::executed) == 6);
    CHECK(s.count(Event::replayed) == 2);
    CHECK(s.count(Event::in_progress) == 1);
    CHECK(s.count(Event::mismatch) == 1);
    CHECK(s.count(Event::released) == 1);
    CHECK(s.count(Event::unknown) == 3);
    CHECK(s.count(Event::taken_over) == 3);
    CHECK(s.count(Event::reconciled) == 2);
    CHECK(s.count(Event::purged) == 2);
    CHECK(s.time(Event::executed) >= std::chrono::milliseconds(6));  // the three 2 ms effects at least
    CHECK(s.time(Event::replayed).count() > 0);
    CHECK(s.time(Event::unknown).count() > 0);
}
