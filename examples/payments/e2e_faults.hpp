// payments-e2e --faults: convergence after the database connections were killed under load
// (CTest payments_e2e_faults). See run_faults.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>

namespace e2e {

// The instances' settings in this scenario (those of the reported failure).
constexpr std::chrono::milliseconds kFaultsLease{1000};
constexpr std::chrono::milliseconds kFaultsReconcileEvery{200};
// payments-server releases a key that has no charge this long after its claim, and a request
// keeps its key (extends its lease) until this long after it arrived at the latest (README.md,
// "Reconciliation").
constexpr std::chrono::milliseconds kReleaseAfter{8000};
constexpr std::chrono::milliseconds kKeptFor{7000};
// The README's bound after the last fault ("Convergence after faults"): every key is settled
// within max(release age, kept for + lease) + 2 reconciler periods + 2 sweeps.
constexpr std::chrono::milliseconds kSettleBound =
    std::max(kReleaseAfter, kKeptFor + kFaultsLease) + 2 * kFaultsReconcileEvery;
// The test's clients retry every 100..250 ms.
constexpr std::chrono::milliseconds kRetryMin{100};
constexpr std::chrono::milliseconds kRetryMax{250};
// The README's 2 sweeps, and scheduling on a 2-core machine with both cores saturated: two
// instances' reconcilers sweeping the faults' backlog (a few round trips per key), a reconciler
// thread and a client woken late, the client's request.
constexpr std::chrono::milliseconds kSchedulingSlack{2000};

struct FaultOptions {
    std::chrono::milliseconds faults{5000};  // how long backends are terminated
    // Every key has its 201 this long after the last fault at the latest.
    std::chrono::milliseconds bound = kSettleBound + kRetryMax + kSchedulingSlack;
    int keys = 40;
    bool keep_logs = false;  // keep the instances' logs (and print where) even when every check passed
};

/// Two instances (lease 1 s, reconciler every 200 ms) while another session keeps terminating
/// their database backends (idem's and the gateway's): `keys` payments start one after the other
/// during the faults, each retried by its own client until it gets a 201. Then every key must
/// have its 201 within `bound` of the last fault and replay it byte for byte, and the gateway's
/// ledger (read with SQL, outside the servers) must hold exactly one charge per key. New payments
/// right after the faults, and after one more fault in a quiet moment, must be paid at once.
int run_faults(const std::string& server_exe, const std::string& db, const FaultOptions& fo);

}  // namespace e2e
