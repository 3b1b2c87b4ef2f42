// The async side of idem-bench (built with IDEM_BENCH_ASYNC, i.e. when the idem::asio component
// is): one idem::asio::AsyncPostgresStore on one io_context, run by the thread that measures, with
// N requests in flight at once — N coroutines, each calling async_execute_once (no-op effect) again
// as soon as its previous call completed, so that exactly N calls are outstanding while the phase
// runs. The store groups them as it does by itself (group commit is always on in idem::asio).
//
// A phase is measured as run_phase measures a side (phase.hpp): kWarmupCalls untimed calls per
// coroutine first, then the store's counters, the WAL position and the process's CPU time read
// before and after the timed calls; each call's latency runs from its start on the event loop to
// its completion. The header holds no Boost type, so matrix.cpp compiles without Boost.
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "admin.hpp"
#include "cases.hpp"
#include "phase.hpp"

namespace bench {

class AsyncSide {
public:
    /// A store with `pool` connections on `table` (connections open lazily: the warm-up opens them).
    /// `fingerprint_secret`: the store keys fingerprints (kBenchFingerprintSecret).
    AsyncSide(const std::string& conninfo, const std::string& table, int pool, bool fingerprint_secret = false);
    ~AsyncSide();
    AsyncSide(const AsyncSide&) = delete;
    AsyncSide& operator=(const AsyncSide&) = delete;

    /// One timed phase of `seconds` with `in_flight` requests of case `kind` (not replay_cached:
    /// there is no replay cache in front of AsyncPostgresStore) over the `preloaded` keys. Throws
    /// the first error a call met, once every call has completed.
    PhaseResult phase(Admin& admin, Case kind, int in_flight, double seconds, std::uint64_t seed,
                      const idem::Fingerprint& fp, std::int64_t preloaded);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace bench
