// The throughput matrix (the default run): every thread count, case and side in alternating rounds,
// then the async points (--in-flight), and its figures: a Side is one side of one case, a Run one
// case at one thread count or one number of requests in flight.
#pragma once

#include <idem/idem.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../common/util.hpp"
#include "admin.hpp"
#include "cases.hpp"
#include "options.hpp"
#include "phase.hpp"

namespace bench {

struct Side {
    SideKind kind = SideKind::floor;
    std::uint64_t calls = 0, unexpected = 0;
    std::uint64_t wal_bytes = 0;
    std::optional<std::uint64_t> commits;  ///< commit records (pg_walinspect), if available
    double seconds = 0, cpu_seconds = 0;
    Counters counters;
    Histogram hist;

    void add(const PhaseResult& r) {
        calls += r.calls;
        unexpected += r.unexpected;
        seconds += r.seconds;
        cpu_seconds += r.cpu_seconds;
        counters.round_trips += r.delta.round_trips;
        counters.retries += r.delta.retries;
        counters.opened += r.delta.opened;
        counters.claim_groups += r.delta.claim_groups;
        counters.grouped_claims += r.delta.grouped_claims;
        counters.largest_claim_group = std::max(counters.largest_claim_group, r.delta.largest_claim_group);
        counters.save_groups += r.delta.save_groups;
        counters.grouped_saves += r.delta.grouped_saves;
        counters.largest_save_group = std::max(counters.largest_save_group, r.delta.largest_save_group);
        hist.merge(r.hist);
    }
    [[nodiscard]] bool ran() const { return calls > 0 || seconds > 0; }
    [[nodiscard]] double per_call(double total) const { return calls > 0 ? total / static_cast<double>(calls) : 0; }
    [[nodiscard]] double wal_bytes_per_call() const { return per_call(static_cast<double>(wal_bytes)); }
    /// Mean calls per shared transaction (group commit); 0 without it.
    [[nodiscard]] double mean_claim_group() const {
        return counters.claim_groups
                   ? static_cast<double>(counters.grouped_claims) / static_cast<double>(counters.claim_groups)
                   : 0;
    }
    [[nodiscard]] double mean_save_group() const {
        return counters.save_groups
                   ? static_cast<double>(counters.grouped_saves) / static_cast<double>(counters.save_groups)
                   : 0;
    }
    [[nodiscard]] double ops() const { return seconds > 0 ? static_cast<double>(calls) / seconds : 0; }
    /// Client CPU (this process: the workers and the library or libpq) per call, microseconds.
    [[nodiscard]] double cpu_us_per_call() const {
        return calls > 0 ? cpu_seconds * 1e6 / static_cast<double>(calls) : 0;
    }
    [[nodiscard]] double rt_per_call() const {
        return calls > 0 ? static_cast<double>(counters.round_trips) / static_cast<double>(calls) : 0;
    }
};

struct Run {
    int threads = 0;  ///< 1 for an async point (its one io_context thread)
    int pool = 0;     ///< the idem sides' connections (= threads unless --threads T/P or --pool); async: its pool
    /// An async point: the requests in flight (0 otherwise); its floor ran on floor_threads threads
    /// and its ideal in rounds of in_flight calls.
    int in_flight = 0;
    int floor_threads = 0;  ///< the floor's threads (= threads, except in an async point)
    Case kind = Case::fresh;
    std::vector<Side> sides;  ///< in SideKind order; only the sides that ran
    std::optional<double> pgbench_tps;

    [[nodiscard]] const Side* find(SideKind k) const {
        for (const Side& side : sides) {
            if (side.kind == k && side.ran()) return &side;
        }
        return nullptr;
    }
    /// The side the ratio column compares with the floor: idem (group commit off), else idem_gc,
    /// else async.
    [[nodiscard]] const Side* lib() const {
        const Side* s = find(SideKind::idem);
        s = s ? s : find(SideKind::idem_gc);
        return s ? s : find(SideKind::async);
    }
    /// The calls the ideal side sends in one statement.
    [[nodiscard]] int ideal_group() const { return in_flight > 0 ? in_flight : threads; }
    [[nodiscard]] double ratio(SideKind k) const {
        const Side* a = find(k);
        const Side* f = find(SideKind::floor);
        return a && f && f->ops() > 0 ? a->ops() / f->ops() : NAN;
    }
};

/// Runs the matrix on fresh tables named `prefix`_*, printing each run as it ends.
std::vector<Run> run_matrix(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                            const idem::Fingerprint& fp, std::uint64_t seed);

}  // namespace bench
