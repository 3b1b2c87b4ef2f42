// payments-e2e's helpers: the checks that count failures, the server instances it starts, HTTP
// requests to them, and a libpq session of its own (the witness's view of the ledger and idem's
// table, and the fault injector).
#pragma once

#include <httplib.h>
#include <libpq-fe.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace e2e {

using Clock = std::chrono::steady_clock;

/// Checks made and failed so far (check() counts; the run's exit status comes from these).
extern int g_failures;
extern int g_checks;

/// Counts a check; prints "FAIL: what" when `ok` is false.
void check(bool ok, const std::string& what);
/// Prints a section's title.
void section(const std::string& title);

// ------------------------------------------------------------------------------------------
// servers

/// A payments-server instance this test started.
struct Server {
    pid_t pid = -1;
    std::string url;
};

/// SIGKILLs every instance still running (atexit, and on std::terminate).
void kill_children();
/// Starts a server and waits for its address. `log_path`: where its stderr goes (default: ours).
std::optional<Server> start_server(const std::string& exe, const std::vector<std::string>& args,
                                   const std::string& log_path = {});
/// SIGTERM, then the exit status (or -1 if it did not exit within 15 s, then it is killed).
int stop_server(Server& server);

// ------------------------------------------------------------------------------------------
// HTTP

struct Reply {
    int status = 0;  // 0: no response (network error)
    std::string error;
    std::string body;
    httplib::Headers headers;
    [[nodiscard]] std::string header(const std::string& name) const {
        const auto it = headers.find(name);
        return it == headers.end() ? std::string() : it->second;
    }
    [[nodiscard]] bool replayed() const { return header("Idempotent-Replayed") == "true"; }
    std::chrono::milliseconds took{0};  // (set by callers that time the request)
};

/// One request on a new connection (10 s to connect, 30 s to read). Thread-safe.
Reply send(const std::string& url, const std::string& method, const std::string& path, const httplib::Headers& headers,
           const std::string& body = {});
/// POST /payments as `account` (none if empty) with this key (none if nullopt). Thread-safe.
Reply pay(const std::string& url, const std::string& account, const std::optional<std::string>& key,
          const std::string& body);
/// A payment request's JSON body.
std::string payment_body(long order, long amount, const std::string& card, const std::string& currency = "BRL");
/// The gateway's own count of calls for a key (optionally one account's), or -1 on error.
long gateway_count(const std::string& url, const std::string& key, const std::string& account = {});
/// "HTTP <status> <body's first 200 bytes>", or the network error.
std::string describe(const Reply& r);
/// Runs payments-client; returns its exit status and combined output.
std::pair<int, std::string> run_client(const std::string& exe, const std::vector<std::string>& args);

// ------------------------------------------------------------------------------------------
// SQL

/// A libpq session of the test's own: the fault injector, and the witness's view of the ledger
/// and of idem's table (read outside the servers and outside idem).
class Sql {
public:
    explicit Sql(const std::string& conninfo);
    ~Sql() { PQfinish(conn_); }
    Sql(const Sql&) = delete;
    Sql& operator=(const Sql&) = delete;

    /// The rows of a statement, every value as text (NULL as "NULL"). Throws on any error.
    std::vector<std::vector<std::string>> query(const std::string& sql, const std::vector<std::string>& params = {});

private:
    PGconn* conn_ = nullptr;
};

// ------------------------------------------------------------------------------------------
// the main run's instances

/// What the main run's sections share: the programs, the database, the instances it started
/// (A and B: a 50 ms gateway; C and D: a rate limit of 3/s; E: for /metrics alone; more are added
/// by sections that need their own) and the names unique to this run.
struct Run {
    std::string server_exe, client_exe, db;
    std::string id;    ///< unique to this run: keys may be reused on a database that is not throwaway
    std::string acct;  ///< the account most sections pay as
    std::vector<Server> servers;
    std::string A, B, C, D, E;

    /// A key no other section uses.
    std::string fresh_key(const std::string& tag) { return "e2e-" + id + "-" + tag + "-" + std::to_string(++keys_); }

private:
    int keys_ = 0;
};

/// The sections of the main run, in the order they run (each in its own file).
void contract_sections(Run& run);       // e2e_contract.cpp: the HTTP contract, one charge per key
void metrics_section(Run& run);         // e2e_metrics.cpp: GET /metrics against known calls
void gateway_fault_sections(Run& run);  // e2e_gateway_faults.cpp: the gateway's commits and stalls

}  // namespace e2e
