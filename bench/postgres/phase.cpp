// The counters of a phase and the process's CPU time (see phase.hpp).
#include "phase.hpp"

#include <ctime>

namespace bench {

Counters counters_delta(const Counters& after, const Counters& before) {
    Counters d;
    d.round_trips = after.round_trips - before.round_trips;
    d.retries = after.retries - before.retries;
    d.opened = after.opened - before.opened;
    d.claim_groups = after.claim_groups - before.claim_groups;
    d.grouped_claims = after.grouped_claims - before.grouped_claims;
    d.largest_claim_group = after.largest_claim_group;
    d.save_groups = after.save_groups - before.save_groups;
    d.grouped_saves = after.grouped_saves - before.grouped_saves;
    d.largest_save_group = after.largest_save_group;
    return d;
}

double process_cpu_seconds() {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

}  // namespace bench
