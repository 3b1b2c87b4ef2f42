// Wait instead of 409 (ClaimOptions::wait): a duplicate waits for the running attempt's save and
// replays it promptly; a wait that runs out answers in_progress.
//
// These waits are real (the point is how long a caller waits), so the bounds are wide enough for a
// busy 2-core machine and still far from what a broken wait would show: waits of 10 s, woken by
// the save in well under a second, or ending at the deadline.
#include <catch2/catch.hpp>

#include <atomic>
#include <future>
#include <latch>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;

TEMPLATE_TEST_CASE("wait: the duplicate replays the first attempt's result right after its save", "[lifecycle][wait]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store_a = backend.make(knobs(4));
    auto& store_b = backend.make(knobs(4));
    const auto scope = fresh_scope("wait");
    const auto fp = idem::fingerprint("POST /wait"s);

    // Warm both pools so connection set-up is not measured.
    (void)idem::execute_once(store_a, idem::Key(scope, "warm"), fp, [] { return Response{200, "w"}; });
    (void)idem::execute_once(store_b, idem::Key(scope, "warm"), fp, [] { return Response{200, "w"}; });

    constexpr int kRuns = 7;
    std::vector<double> delays;
    std::optional<idem_test::PgConn> watch;  // PostgresBackend: to see B's wait in the table
    if constexpr (TestType::is_postgres) watch.emplace(backend.conninfo());
    for (int i = 0; i < kRuns; ++i) {
        const idem::Key key(scope, "k" + std::to_string(i));
        std::promise<void> finish;
        auto finish_signal = finish.get_future();
        std::latch a_running(1);
        SteadyClock::time_point fn_returned_at;
        std::optional<idem::Result<Response>> a_result;
        std::thread a([&] {
            a_result.emplace(idem::execute_once(store_a, key, fp, [&] {
                a_running.count_down();
                finish_signal.wait();
                fn_returned_at = SteadyClock::now();
                return Response{201, "A's result #" + std::to_string(i) + "\0"s};
            }));
        });
        a_running.wait();
        const auto b_claims_before = store_b.stats().claims;
        std::atomic<bool> b_returned{false};
        SteadyClock::time_point b_returned_at;
        std::atomic<int> b_runs{0};
        std::optional<idem::Result<Response>> b_result;
        std::thread b([&] {
            b_result.emplace(idem::execute_once(
                store_b, key, fp,
                [&] {
                    ++b_runs;
                    return Response{500, "B ran"};
                },
                Opts().wait_up_to(10s)));
            b_returned_at = SteadyClock::now();
            b_returned = true;
        });
        // A's fn returns once B waits for the save: PostgresStore marks the row waited for once B
        // LISTENs; MemoryStore counts B's claim under the lock it then waits on (a save needs it).
        const auto b_waits = [&] {
            if constexpr (TestType::is_postgres) {
                return watch->scalar(
                           "SELECT count(*) FROM " + backend.table() + " WHERE scope = $1 AND key = $2 AND waiters",
                           {key.scope(), key.value()}) == 1;
            } else {
                return store_b.stats().claims > b_claims_before;
            }
        };
        const auto deadline = SteadyClock::now() + 30s;
        while (!b_waits() && !b_returned && SteadyClock::now() < deadline) std::this_thread::sleep_for(5ms);
        const bool b_was_waiting = !b_returned;
        finish.set_value();
        a.join();
        b.join();
        CHECK(b_was_waiting);
        REQUIRE(a_result);
        REQUIRE(b_result);
        CHECK(a_result->outcome() == Outcome::executed);
        CHECK(b_result->outcome() == Outcome::replayed);
        CHECK(b_runs == 0);
        CHECK(encode(b_result->response()) == encode(a_result->response()));
        CHECK(b_returned_at > fn_returned_at);
        delays.push_back(ms(b_returned_at - fn_returned_at));
    }
    std::string all;
    for (double d : delays) all += std::to_string(d) + " ";
    INFO("B's return after A's fn returned (ms): " << all);
    CHECK(median(delays) < 500.0);            // woken by the save, not polling
    CHECK(percentile(delays, 1.0) < 5000.0);  // and never only at the 10 s deadline
}

TEMPLATE_TEST_CASE("wait: a wait that runs out answers in_progress after the wait", "[lifecycle][wait]", MemoryBackend,
                   PostgresBackend) {
    TestType backend;
    auto& store = backend.make(knobs(4));
    const idem::Key key(fresh_scope("wait-timeout"), "slow");
    const auto fp = idem::fingerprint("POST /slow"s);
    std::promise<void> finish;
    auto finish_signal = finish.get_future();
    std::latch a_running(1);
    std::optional<idem::Result<Response>> a_result;
    std::thread a([&] {
        a_result.emplace(idem::execute_once(store, key, fp, [&] {
            a_running.count_down();
            finish_signal.wait();
            return Response{201, "slow"};
        }));
    });
    a_running.wait();
    std::atomic<int> runs{0};
    const auto t0 = SteadyClock::now();
    const auto r = idem::execute_once(
        store, key, fp,
        [&] {
            ++runs;
            return Response{500, "ran"};
        },
        Opts().wait_up_to(1s));
    const auto waited = ms(SteadyClock::now() - t0);
    finish.set_value();
    a.join();
    INFO("waited " << waited << " ms");
    CHECK(r.outcome() == Outcome::in_progress);
    CHECK(runs == 0);
    CHECK(waited >= 1000.0);
    CHECK(waited < 5000.0);
    REQUIRE(a_result);
    CHECK(a_result->outcome() == Outcome::executed);
    // Once saved, a waiting claim answers at once.
    const auto t1 = SteadyClock::now();
    CHECK(idem::execute_once(
              store, key, fp,
              [&] {
                  ++runs;
                  return Response{500, "ran"};
              },
              Opts().wait_up_to(10s))
              .outcome() == Outcome::replayed);
    CHECK(ms(SteadyClock::now() - t1) < 5000.0);
    CHECK(runs == 0);
}
