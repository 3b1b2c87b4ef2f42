// payments-e2e — end-to-end test of payments-server over HTTP, with several instances on one
// database. This file starts the instances and runs the sections (e2e_contract.cpp,
// e2e_metrics.cpp, e2e_gateway_faults.cpp), then stops them; e2e_faults.cpp is the --faults run.
//
//   payments-e2e --server PATH --client PATH [--db CONNINFO]   (default: $IDEM_TEST_DATABASE_URL)
//
// Starts instances A and B (--lease-ms 2000 --reconcile-every-ms 100 --gateway-latency-ms 50) and,
// for the rate limit, C and D (--rate-limit-per-second 3), E (GET /metrics: its counters against
// a known sequence of calls) and others for single sections (a gateway slower than the lease, a
// commit that waits, one connection at a time), then checks every rule of the payments example
// through HTTP, using the fake gateway's ledger (GET /gateway/charges) as the witness of how often
// a card was charged. Finally stops every instance with SIGTERM and expects exit status 0. Exit
// status: 0 if every check passed, 1 otherwise (each failure is printed).
//
//   payments-e2e --faults --server PATH [--db CONNINFO] [--bound-ms N] [--faults-ms N] [--keys N]
//                [--keep-logs]
//
// Convergence after faults (CTest payments_e2e_faults): two instances (--lease-ms 1000
// --reconcile-every-ms 200) whose database backends are terminated for 5 s while 40 payments
// start, each retried; then every key must have its one 201 and one ledger charge within the
// README's bound of the last fault. The instances' logs are kept (their directory printed) when
// a check fails, or with --keep-logs. See run_faults.
#include <signal.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "e2e_faults.hpp"
#include "e2e_support.hpp"

using namespace e2e;

int main(int argc, char** argv) {
    std::string server_exe, client_exe, db;
    bool faults = false;
    FaultOptions fault_options;
    if (const char* env = std::getenv("IDEM_TEST_DATABASE_URL")) db = env;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--faults") {
            faults = true;
            continue;
        }
        if (arg == "--keep-logs") {
            fault_options.keep_logs = true;
            continue;
        }
        if (i + 1 >= argc) break;
        const std::string value = argv[++i];
        if (arg == "--server") server_exe = value;
        else if (arg == "--client") client_exe = value;
        else if (arg == "--db") db = value;
        else if (arg == "--bound-ms") fault_options.bound = std::chrono::milliseconds(std::stol(value));
        else if (arg == "--faults-ms") fault_options.faults = std::chrono::milliseconds(std::stol(value));
        else if (arg == "--keys") fault_options.keys = std::stoi(value);
    }
    if (faults && !server_exe.empty() && !db.empty()) {
        std::atexit(kill_children);
        // An exception that escapes (a failed query of the test's own) must not leave the
        // instances running.
        std::set_terminate([] {
            kill_children();
            std::abort();
        });
        signal(SIGPIPE, SIG_IGN);
        return run_faults(server_exe, db, fault_options);
    }
    if (server_exe.empty() || client_exe.empty() || db.empty()) {
        std::cerr << "usage: payments-e2e --server PATH --client PATH [--db CONNINFO]\n"
                     "       payments-e2e --faults --server PATH [--db CONNINFO] [--bound-ms N] "
                     "[--faults-ms N] [--keys N] [--keep-logs]\n"
                     "(the database comes from IDEM_TEST_DATABASE_URL by default; see "
                     "scripts/with-postgres.sh)\n";
        return 2;
    }
    std::atexit(kill_children);
    signal(SIGPIPE, SIG_IGN);

    Run r;
    r.server_exe = server_exe;
    r.client_exe = client_exe;
    r.db = db;
    // Keys unique to this run, so the test may also run against a database that is not throwaway.
    std::mt19937_64 rng(std::random_device{}());
    r.id = std::to_string(rng() % 1'000'000'000);
    r.acct = "acct_e2e_" + r.id;

    section(
        "starting instances A, B (lease 2 s, gateway 50 ms) and C, D (rate limit 3/s) on "
        "one database");
    // A and B: a 50 ms gateway, so that the simultaneous requests really overlap a running charge.
    // A lease of 2 s: short enough that the reconciler settles a tok_timeout within seconds, long
    // enough that a busy machine's stalls never let it take over a request still running (whose
    // heartbeat renews the lease every 500 ms).
    const std::vector<std::string> common{"--listen", "127.0.0.1:0",          "--db", db,          "--lease-ms",
                                          "2000",     "--reconcile-every-ms", "100",  "--threads", "64"};
    std::vector<Server>& servers = r.servers;
    for (int i = 0; i < 4; ++i) {
        auto args = common;
        if (i < 2) args.insert(args.end(), {"--gateway-latency-ms", "50"});
        if (i >= 2) args.insert(args.end(), {"--rate-limit-per-second", "3"});
        auto s = start_server(server_exe, args);
        if (!s) {
            std::cout << "FAILED: could not start instance " << i << std::endl;
            return 1;
        }
        servers.push_back(*s);
    }
    r.A = servers[0].url;
    r.B = servers[1].url;
    r.C = servers[2].url;
    r.D = servers[3].url;
    for (const auto& s : servers) {
        check(s.url.starts_with("http://127.0.0.1:"), "instance listens on loopback: " + s.url);
        check(send(s.url, "GET", "/healthz", {}).status == 200, "instance answers /healthz: " + s.url);
    }
    // E: only the /metrics section calls it, so its counters are exactly that section's calls (the
    // default 30 s lease and an hourly reconciler: no other section's key reaches its observer).
    // Without the replay cache and group commit (both on by default), so that every call reaches the
    // store and each claim and save is a transaction of its own.
    const auto metrics_instance =
        start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000", "--db-pool",
                                  "4", "--threads", "8", "--replay-cache-mb", "0", "--group-commit", "off"});
    if (!metrics_instance) {
        std::cout << "FAILED: could not start instance E" << std::endl;
        return 1;
    }
    servers.push_back(*metrics_instance);
    r.E = metrics_instance->url;

    contract_sections(r);
    metrics_section(r);
    gateway_fault_sections(r);

    section("SIGTERM as soon as the address is printed: exit status 0");
    {
        // The address line says the server is up; a SIGTERM from then on stops it cleanly. (Sent at
        // once, it lands while the server still starts its threads.)
        int clean = 0;
        constexpr int kStarts = 20;
        for (int i = 0; i < kStarts; ++i) {
            auto s =
                start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000"});
            if (s && stop_server(*s) == 0) ++clean;
        }
        check(clean == kStarts,
              "every instance stopped at once exited 0: " + std::to_string(clean) + "/" + std::to_string(kStarts));
    }

    section("loopback only");
    {
        auto [rc, out] = run_client(server_exe, {"--listen", "0.0.0.0:0", "--db", db});
        check(rc == 2 && out.find("loopback") != std::string::npos, "--listen 0.0.0.0 is refused: " + out);
    }

    section("the user's libpq options reach every connection, the gateway's too");
    // A search_path given in the --db conninfo, then in PGOPTIONS: idem's table, the ledger and the
    // gateway's functions must all live in (and be used from) that schema, none of them in public.
    for (const bool from_env : {false, true}) {
        const std::string schema = "e2e_options_" + std::string(from_env ? "env_" : "") + r.id;
        const std::string how = from_env ? "PGOPTIONS" : "the conninfo";
        Sql sql(db);
        sql.query("CREATE SCHEMA " + schema);
        const bool url = db.starts_with("postgres://") || db.starts_with("postgresql://");
        std::string conninfo = db;
        const char* old_env = std::getenv("PGOPTIONS");
        const std::optional<std::string> old_options = old_env ? std::optional<std::string>(old_env) : std::nullopt;
        if (from_env) {
            ::setenv("PGOPTIONS", ("-c search_path=" + schema).c_str(), 1);  // for the instance started now
        } else if (url) {
            conninfo +=
                (db.find('?') == std::string::npos ? "?" : "&") + std::string("options=-c%20search_path%3D") + schema;
        } else {
            conninfo += " options='-c search_path=" + schema + "'";
        }
        auto s =
            start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", conninfo, "--reconcile-every-ms", "3600000"});
        if (old_options) {
            ::setenv("PGOPTIONS", old_options->c_str(), 1);
        } else {
            ::unsetenv("PGOPTIONS");
        }
        check(s.has_value(), "an instance starts with options in " + how);
        if (s) {
            const std::string key = r.fresh_key(from_env ? "env-options" : "conninfo-options");
            const Reply paid = pay(s->url, r.acct, key, payment_body(4401, 1500, "tok_ok"));
            check(paid.status == 201, how + ": the payment is made: " + describe(paid));
            // The key's rows in schema.table ("none": no such table).
            const auto in_schema = [&](const std::string& table) -> std::string {
                if (sql.query("SELECT to_regclass($1) IS NULL", {schema + "." + table})[0][0] == "t") return "none";
                return sql.query("SELECT count(*) FROM " + schema + "." + table + " WHERE " +
                                     (table == "idem_keys" ? "key" : "idempotency_key") + " = $1",
                                 {key})[0][0];
            };
            const std::string charges = in_schema("gateway_charges"), keys = in_schema("idem_keys");
            check(charges == "1", how + ": the charge is in " + schema + ".gateway_charges: " + charges);
            check(keys == "1", how + ": the key is in " + schema + ".idem_keys: " + keys);
            check(
                sql.query("SELECT count(*) FROM public.gateway_charges WHERE idempotency_key = $1", {key})[0][0] == "0",
                how + ": no charge for it in public.gateway_charges");
            check(stop_server(*s) == 0, how + ": the instance exits cleanly");
        }
        sql.query("SET client_min_messages = warning");  // no NOTICE per dropped object
        sql.query("DROP SCHEMA " + schema + " CASCADE");
    }

    section("SIGTERM: every instance exits cleanly");
    for (auto& s : servers) {
        const std::string url = s.url;
        const int status = stop_server(s);
        check(status == 0, "instance " + url + " exited with " + std::to_string(status));
    }

    std::cout << (g_failures == 0 ? "PASSED" : "FAILED") << ": " << g_checks - g_failures << "/" << g_checks
              << " checks passed" << std::endl;
    return g_failures == 0 ? 0 : 1;
}
