// tests/support/test_env.hpp — where the test database is, and names no other test process uses.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string>
#include <unistd.h>

namespace idem_test {

/// The conninfo of the test database, or "" when IDEM_TEST_DATABASE_URL is not set.
inline std::string database_url() {
    const char* url = std::getenv("IDEM_TEST_DATABASE_URL");
    return url ? std::string(url) : std::string();
}

inline constexpr const char* kNoDatabaseMessage =
    "IDEM_TEST_DATABASE_URL is not set: run this test under scripts/with-postgres.sh "
    "(e.g. scripts/with-postgres.sh ctest --test-dir build/dev), or export a libpq conninfo";

/// A name unique to this process and call: "<prefix>_<pid>_<n>" (valid SQL identifier).
inline std::string unique_name(const std::string& prefix) {
    static std::atomic<int> counter{0};
    return prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(++counter);
}

} // namespace idem_test
