// tests/support/test_env.hpp — where the test database is, and names no other test process uses.
#pragma once

#include <unistd.h>
#include <atomic>
#include <cstdlib>
#include <string>

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

/// The column idem's tables are distributed by in a run against a Citus cluster
/// (scripts/citus-check.sh sets IDEM_TEST_CITUS_DISTRIBUTE), or "" on plain PostgreSQL.
inline std::string citus_distribution() {
    const char* by = std::getenv("IDEM_TEST_CITUS_DISTRIBUTE");
    return by ? std::string(by) : std::string();
}
inline bool citus_run() { return !citus_distribution().empty(); }

}  // namespace idem_test

/// For a test case whose instrumentation cannot exist on a Citus-distributed table — triggers,
/// row-level security, a sequence owned by the table, the coordinator's pg_stat_* / pg_locks views
/// (the rows and their locks live on the workers) — not idem's behaviour: on a Citus run it passes
/// with a note saying why, so that scripts/citus-check.sh runs the rest of its suite. Use it first
/// in the test case.
#define IDEM_NOT_ON_CITUS(why)              \
    do {                                    \
        if (::idem_test::citus_run()) {     \
            WARN("not run on Citus: " why); \
            return;                         \
        }                                   \
    } while (0)
