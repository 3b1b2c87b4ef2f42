// tests/support/require_db.hpp — the test database a Catch2 test case needs (not part of idem).
#pragma once

#include "test_env.hpp"

#include <catch2/catch.hpp>
#include <string>

namespace idem_test {

/// The conninfo of the test database (IDEM_TEST_DATABASE_URL). Without one it fails the running
/// test case with kNoDatabaseMessage: call it from a test case, or from a fixture one constructs.
inline std::string require_db() {
    auto url = database_url();
    if (url.empty()) FAIL(kNoDatabaseMessage);
    return url;
}

}  // namespace idem_test
