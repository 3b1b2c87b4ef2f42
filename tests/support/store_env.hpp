// tests/support/store_env.hpp — store options the test run chooses through the environment.
//
// IDEM_TEST_GROUP_COMMIT=0 turns PostgresOptions::group_commit off (anything else, or unset, keeps
// the default, on): CTest registers the contract, concurrency, atomicity and fault suites once with
// each value (tests/CMakeLists.txt, suffix _gc_off), so every guarantee is shown both ways.
#pragma once

#include <cstdlib>
#include <string_view>

#include "idem/postgres_store.hpp"

namespace idem_test {

[[nodiscard]] inline bool group_commit_from_env() {
    const char* v = std::getenv("IDEM_TEST_GROUP_COMMIT");
    return v == nullptr || std::string_view(v) != "0";
}

/// `options` with the environment's choices applied (helper processes inherit the environment).
[[nodiscard]] inline idem::PostgresOptions env_options(idem::PostgresOptions options) {
    options.group_commit = group_commit_from_env();
    return options;
}

} // namespace idem_test
