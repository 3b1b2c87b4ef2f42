// tests/support/store_env.hpp — store options the test run chooses through the environment.
//
// IDEM_TEST_GROUP_COMMIT=1 turns PostgresOptions::group_commit on, =0 off; unset keeps the default
// (off). CTest registers the contract, concurrency, atomicity and fault suites a second time with
// group commit on (tests/CMakeLists.txt, suffix _gc_on), so every guarantee is shown both ways.
#pragma once

#include <cstdlib>
#include <string_view>

#include "idem/postgres_store.hpp"

namespace idem_test {

/// `options` with the environment's choices applied (helper processes inherit the environment).
[[nodiscard]] inline idem::PostgresOptions env_options(idem::PostgresOptions options) {
    if (const char* v = std::getenv("IDEM_TEST_GROUP_COMMIT")) options.group_commit = std::string_view(v) != "0";
    return options;
}

} // namespace idem_test
