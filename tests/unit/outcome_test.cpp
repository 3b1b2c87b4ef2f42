// Result<T>: the value execute_once returns.
#include "idem/outcome.hpp"
#include "idem/errors.hpp"
#include "idem/response.hpp"

#include <catch2/catch.hpp>
#include <chrono>
#include <stdexcept>
#include <string>
#include <utility>

using namespace std::chrono_literals;

TEST_CASE("Result executed and replayed carry the response", "[outcome]") {
    const auto executed = idem::Result<idem::Response>::executed(idem::Response{201, "body", {}});
    CHECK(executed.outcome() == idem::Outcome::executed);
    CHECK(executed.has_response());
    CHECK_FALSE(executed.is_replay());
    CHECK(executed.response().status == 201);
    CHECK(executed.response().body == "body");

    auto replayed = idem::Result<std::string>::replayed("stored");
    CHECK(replayed.outcome() == idem::Outcome::replayed);
    CHECK(replayed.has_response());
    CHECK(replayed.is_replay());
    CHECK(replayed.response() == "stored");
    const std::string moved = std::move(replayed).response();
    CHECK(moved == "stored");
}

TEST_CASE("Result response() without a response throws std::logic_error", "[outcome]") {
    const auto in_progress = idem::Result<idem::Response>::in_progress(250ms);
    CHECK(in_progress.outcome() == idem::Outcome::in_progress);
    CHECK_FALSE(in_progress.has_response());
    CHECK_FALSE(in_progress.is_replay());
    CHECK(in_progress.retry_after() == 250ms);
    CHECK_THROWS_AS(in_progress.response(), std::logic_error);
    CHECK_THROWS_AS(idem::Result<idem::Response>::in_progress(1ms).response(),
                    std::logic_error);  // &&

    const auto mismatch = idem::Result<idem::Response>::mismatch();
    CHECK(mismatch.outcome() == idem::Outcome::mismatch);
    CHECK_FALSE(mismatch.has_response());
    CHECK_THROWS_AS(mismatch.response(), std::logic_error);
    CHECK_THROWS_AS(idem::Result<std::string>::mismatch().response(), std::logic_error);

    // a programming error, not an idem failure
    try {
        (void)mismatch.response();
    } catch (const idem::error&) {
        FAIL("response() threw an idem::error");
    } catch (const std::logic_error&) {
    }
}

TEST_CASE("to_string names every outcome", "[outcome]") {
    CHECK(idem::to_string(idem::Outcome::executed) == "executed");
    CHECK(idem::to_string(idem::Outcome::replayed) == "replayed");
    CHECK(idem::to_string(idem::Outcome::in_progress) == "in_progress");
    CHECK(idem::to_string(idem::Outcome::mismatch) == "mismatch");
}

TEST_CASE("error hierarchy: what derives from what", "[errors]") {
    CHECK_THROWS_AS(throw idem::pool_timeout("t"), idem::store_unavailable);
    CHECK_THROWS_AS(throw idem::response_too_large("t", "bytes"), idem::response_not_saved);
    CHECK_THROWS_AS(throw idem::response_not_saved("t", "bytes"), idem::outcome_unknown);
    CHECK_THROWS_AS(throw idem::lease_lost("t"), idem::error);
    CHECK_THROWS_AS(throw idem::database_error("t", "40001"), idem::error);
    try {
        throw idem::response_too_large("too large", std::string("enc\0oded", 8), "54000");
    } catch (const idem::response_not_saved& e) {
        CHECK(e.encoded_result() == std::string("enc\0oded", 8));
        CHECK(e.sqlstate() == "54000");
        CHECK(std::string(e.what()) == "too large");
    }
    // not_performed is the effect's signal, deliberately not an idem::error
    CHECK_THROWS_AS(throw idem::not_performed("declined before calling"), std::runtime_error);
    try {
        throw idem::not_performed("x");
    } catch (const idem::error&) {
        FAIL("not_performed must not be an idem::error");
    } catch (const idem::not_performed&) {
    }
}
