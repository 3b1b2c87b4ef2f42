// tests/support/store_env.hpp — store options the test run chooses through the environment.
//
// IDEM_TEST_GROUP_COMMIT=1 turns PostgresOptions::group_commit on, =0 off; unset keeps the default
// (on). IDEM_TEST_STATEMENT_SHAPE=per_scope|per_key|arrays forces PostgresOptions::statement_shape:
// the Citus statements on one node, where the fault-injecting suites can run (_per_scope,
// _per_key). CTest registers the contract, concurrency, atomicity and fault suites a second time
// with group commit off (tests/CMakeLists.txt, suffix _gc_off), so every guarantee is shown both
// ways. IDEM_TEST_SEALED=1 turns sealed responses on (SealingOptions with a fixed test keyring;
// suffix _sealed): the contract holds with every result stored sealed. IDEM_TEST_GENERATIONS=<ms>
// makes the table generational (PostgresOptions::generations, that length; suffix _gen): the
// suites' guarantees hold on partitions by generation.
#pragma once

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "idem/postgres_store.hpp"
#include "idem/sealing.hpp"

namespace idem_test {

/// The sealing the environment asks for: off, or a fixed two-key test keyring (key 2 seals).
[[nodiscard]] inline idem::SealingOptions env_sealing() {
    idem::SealingOptions sealing;
    const char* v = std::getenv("IDEM_TEST_SEALED");
    if (v == nullptr || std::string_view(v) != "1") return sealing;
    auto ring = std::make_shared<idem::Keyring>();
    ring->add(1, std::string(32, 'a')).add(2, std::string(32, 'b'));
    sealing.keyring = std::move(ring);
    return sealing;
}

/// `options` with the environment's choices applied (helper processes inherit the environment).
[[nodiscard]] inline idem::PostgresOptions env_options(idem::PostgresOptions options) {
    if (const char* v = std::getenv("IDEM_TEST_GROUP_COMMIT")) options.group_commit = std::string_view(v) != "0";
    if (const char* v = std::getenv("IDEM_TEST_STATEMENT_SHAPE")) {
        using Shape = idem::PostgresOptions::StatementShape;
        const std::string_view shape(v);
        options.statement_shape = shape == "per_scope" ? Shape::per_scope
                                  : shape == "per_key" ? Shape::per_key
                                  : shape == "arrays"  ? Shape::arrays
                                                       : Shape::automatic;
    }
    options.sealing = env_sealing();
    if (const char* v = std::getenv("IDEM_TEST_GENERATIONS")) {
        options.generations = idem::PostgresOptions::Generations{std::chrono::milliseconds(std::atoll(v)), 2};
    }
    return options;
}

}  // namespace idem_test
