// The retry schedule (detail::RetryPolicy) and how PostgreSQL's failures are sorted into its kinds
// (pg::Retrier), with a clock moved by hand: no database, no sleeping.
#include <catch2/catch.hpp>

#include <chrono>
#include <exception>
#include <stdexcept>

#include "idem/errors.hpp"
#include "postgres/sansio/machine.hpp"
#include "retry_policy.hpp"

using namespace std::chrono_literals;
using idem::detail::RetryPolicy;
using Failure = RetryPolicy::Failure;

namespace {

RetryPolicy::Clock::time_point fake_now = RetryPolicy::Clock::time_point{} + 1000s;
RetryPolicy::Clock::time_point now() noexcept { return fake_now; }

template <class E>
std::exception_ptr failure(const char* sqlstate) {
    return std::make_exception_ptr(E("idem: it failed", sqlstate));
}

}  // namespace

TEST_CASE("a broken connection: retried at once, then backing off, attempts in all") {
    RetryPolicy p(4, 0s, &now);
    CHECK(p.attempt() == 1);
    CHECK(p.after(Failure::broken) == 0ms);
    CHECK(p.attempt() == 2);
    CHECK(p.after(Failure::broken) == 25ms);
    CHECK(p.after(Failure::broken) == 50ms);
    CHECK_FALSE(p.after(Failure::broken));
}

TEST_CASE("an unreachable server is retried only within keep_trying, backing off to 1 s") {
    SECTION("no window: the caller hears it at once") {
        RetryPolicy p(4, 0s, &now);
        CHECK_FALSE(p.after(Failure::unreachable));
    }
    SECTION("a window: retried until it passes, whatever the attempts") {
        RetryPolicy p(1, 10s, &now);
        const std::chrono::milliseconds expected[] = {25ms, 50ms, 100ms, 200ms, 400ms, 800ms, 1000ms, 1000ms};
        for (auto pause : expected) CHECK(p.after(Failure::unreachable) == pause);
        fake_now += 10s;
        CHECK_FALSE(p.after(Failure::unreachable));
        fake_now -= 10s;
    }
}

TEST_CASE("a conflict is retried after a jittered pause, attempts in all or within the window") {
    RetryPolicy p(3, 0s, &now);
    for (int i = 1; i < 3; ++i) {
        const auto pause = p.after(Failure::conflict);
        REQUIRE(pause);
        CHECK(*pause >= 1ms);
        CHECK(*pause <= std::chrono::milliseconds(5 * i));
    }
    CHECK_FALSE(p.after(Failure::conflict));
    RetryPolicy window(1, 5s, &now);
    CHECK(window.after(Failure::conflict));
    CHECK(window.after(Failure::conflict));
}

TEST_CASE("pg::Retrier sorts PostgreSQL's failures") {
    idem::pg::Retrier retry(2, 0s, &now);
    SECTION("a broken connection: suspect the idle ones, retry on a fresh one, then store_unavailable") {
        int suspected = 0;
        const auto next =
            retry.after_failure(failure<idem::pg::connection_broken>("08006"), "save", [&] { ++suspected; });
        CHECK(next.broken);
        CHECK(next.pause == 0ms);
        CHECK(suspected == 1);
        try {
            (void)retry.after_failure(failure<idem::pg::connection_broken>("08006"), "save", [&] { ++suspected; });
            FAIL("not given up");
        } catch (const idem::store_unavailable& e) {
            CHECK(std::string(e.what()).rfind("idem: save: ", 0) == 0);
            CHECK(e.sqlstate() == "08006");
        }
        CHECK(suspected == 2);  // also before giving up: the next call must not pick an idle one
    }
    SECTION("a failed connect is not retried without a window") {
        CHECK_THROWS_AS(retry.after_failure(failure<idem::store_unavailable>("08001"), "claim"),
                        idem::store_unavailable);
    }
    SECTION("a serialization failure or deadlock is retried, then rethrown as it was") {
        const auto next = retry.after_failure(failure<idem::database_error>("40001"), "save");
        CHECK_FALSE(next.broken);
        CHECK_THROWS_AS(retry.after_failure(failure<idem::database_error>("40P01"), "save"), idem::database_error);
    }
    SECTION("any other error goes to the caller as it is, at once") {
        CHECK_THROWS_AS(retry.after_failure(failure<idem::database_error>("23505"), "save"), idem::database_error);
        CHECK_THROWS_AS(retry.after_failure(failure<idem::config_error>("42501"), "save"), idem::config_error);
        CHECK_THROWS_AS(retry.after_failure(std::make_exception_ptr(idem::pool_timeout("idem: pool")), "save"),
                        idem::pool_timeout);
        CHECK_THROWS_AS(retry.after_failure(std::make_exception_ptr(std::runtime_error("x")), "save"),
                        std::runtime_error);
    }
}
