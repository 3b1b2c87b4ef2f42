// tests/support/store_env.hpp — store options the test run chooses through the environment.
//
// IDEM_TEST_GROUP_COMMIT=1 turns PostgresOptions::group_commit on, =0 off; unset keeps the default
// (on). IDEM_TEST_STATEMENT_SHAPE=per_scope|per_key|arrays forces PostgresOptions::statement_shape:
// the Citus statements on one node, where the fault-injecting suites can run (_per_scope,
// _per_key). CTest registers the contract, concurrency, atomicity and fault suites a second time
// with group commit off (tests/CMakeLists.txt, suffix _gc_off), so every guarantee is shown both
// ways.
#pragma once

#include <cstdlib>
#include <string_view>

#include "idem/postgres_store.hpp"

namespace idem_test {

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
    return options;
}

}  // namespace idem_test
