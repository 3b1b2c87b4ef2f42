// idem_lifecycle_worker — a separate OS process for the lifecycle tests (reconciler_test.cpp).
//
//   idem_lifecycle_worker crash CONNINFO TABLE EFFECTS_TABLE SCOPE KEY
//     execute_once(key) with a lease of 30 s; the effect INSERTs a row (scope, key) into
//     EFFECTS_TABLE over its own autocommit connection, records the phase "charged" with data
//     "charge-<row id>", prints "effect-done <row id>" and then sleeps forever (the test SIGKILLs it).
//
//   idem_lifecycle_worker reconcile CONNINFO TABLE RESOLUTIONS_TABLE SCOPE START_AT_MS
//     At START_AT_MS (ms since the epoch) sweeps with a Reconciler of SCOPE (exactly) until no stale
//     key is listed. The
//     resolver INSERTs (scope, key, 'process') into RESOLUTIONS_TABLE and saves Response{200, key}.
//     Prints "saved <n>" and exits 0.
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include "idem/execute_once.hpp"
#include "idem/postgres_store.hpp"
#include "idem/reconciler.hpp"
#include "idem/response.hpp"
#include "pg.hpp"

namespace {

int crash(const std::string& conninfo, const std::string& table, const std::string& effects, const std::string& scope,
          const std::string& value) {
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = 2;
    options.application_name = "idem_lc_worker";
    idem::PostgresStore store(conninfo, options);
    idem_test::PgConn effect_conn(conninfo);
    const idem::Key key(scope, value);
    const auto fp = idem::fingerprint(std::string("charge"), value);
    idem::ClaimOptions claim_options;
    claim_options.lease = std::chrono::seconds(30);
    (void)idem::execute_once(
        store, key, fp,
        [&](idem::Context& ctx) -> idem::Response {
            auto row = effect_conn.exec("INSERT INTO " + effects +
                                            " (scope, key, note) VALUES ($1, $2, 'worker') "
                                            "RETURNING id",
                                        {scope, value});
            const std::string id = row.text(0, 0);
            ctx.record_phase("charged", "charge-" + id);
            std::cout << "effect-done " << id << std::endl;
            for (;;) ::pause();  // killed here: between the effect and the save
        },
        claim_options);
    return 3;  // unreachable
}

int reconcile(const std::string& conninfo, const std::string& table, const std::string& resolutions,
              const std::string& scope, long long start_at_ms) {
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = 2;
    options.application_name = "idem_lc_reconciler_process";
    idem::PostgresStore store(conninfo, options);
    idem_test::PgConn conn(conninfo);
    (void)store.list_stale(1, idem::ScopeFilter::exact(scope));  // connect before the start
    idem::ReconcilerOptions ro;
    ro.batch = 20;
    ro.scopes = idem::ScopeFilter::exact(scope);
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            conn.exec("INSERT INTO " + resolutions + " (scope, key, note) VALUES ($1, $2, 'process')",
                      {r.key().scope(), r.key().value()});
            r.save(idem::Response{200, r.key().value()});
        },
        ro);
    std::this_thread::sleep_until(std::chrono::system_clock::time_point(std::chrono::milliseconds(start_at_ms)));
    std::size_t saved = 0;
    for (;;) {
        const auto sweep = reconciler.run_once();
        saved += sweep.saved;
        if (sweep.failed != 0) {
            std::cerr << "reconcile: " << sweep.failed << " failed\n";
            return 1;
        }
        if (sweep.listed == 0) break;
    }
    std::cout << "saved " << saved << std::endl;
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const std::string mode = argc > 1 ? argv[1] : "";
        if (mode == "crash" && argc == 7) return crash(argv[2], argv[3], argv[4], argv[5], argv[6]);
        if (mode == "reconcile" && argc == 7) return reconcile(argv[2], argv[3], argv[4], argv[5], std::stoll(argv[6]));
        std::cerr << "usage: idem_lifecycle_worker crash CONNINFO TABLE EFFECTS SCOPE KEY\n"
                     "       idem_lifecycle_worker reconcile CONNINFO TABLE RESOLUTIONS SCOPE START_AT_MS\n";
        return 2;
    } catch (const std::exception& e) {
        std::cerr << "idem_lifecycle_worker: " << e.what() << "\n";
        return 1;
    }
}
