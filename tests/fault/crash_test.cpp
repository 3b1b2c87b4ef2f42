// Fault scenario 2 — PostgreSQL crash: kill -9 of the postmaster and every server process mid-load,
// then a restart (crash recovery). Guarantee: every acknowledged save is there, byte-identical;
// every acknowledged claim is there (completed, or in progress for the reconciler); one reconciler
// sweep resolves the rest; no effect twice. Negative control: the same with synchronous_commit=off
// must be able to DETECT loss (reported, not failed: whether a given crash loses anything is up to
// timing). Needs the cluster of scripts/with-postgres.sh (IDEM_PG_DATA ...): otherwise WARN and
// skip. The scenarios themselves are in scenarios.hpp, shared with idem::asio's.
#include "scenarios.hpp"

using namespace fault;

TEST_CASE("scenario 2: PostgreSQL killed (kill -9) mid-load and restarted", "[fault][crash]") {
    crash_scenario(blocking_driver());
}

// After a restart every idle pooled connection is dead. A statement that meets a broken connection
// marks the idle ones suspect, so its retry pings them (discarding the dead) and lands on a live or
// fresh connection: the first call after the restart succeeds.
TEST_CASE("after a restart, the first call succeeds (no retry into dead pooled connections)", "[fault][crash]") {
    first_call_after_restart_scenario(blocking_driver());
}
