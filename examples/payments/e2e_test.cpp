// payments-e2e — end-to-end test of payments-server over HTTP, with several instances on one
// database.
//
//   payments-e2e --server PATH --client PATH [--db CONNINFO]   (default: $IDEM_TEST_DATABASE_URL)
//
// Starts instances A and B (--lease-ms 2000 --reconcile-every-ms 100 --gateway-latency-ms 50) and,
// for the rate limit, C and D (--rate-limit-per-second 3), E (GET /metrics: its counters against
// a known sequence of calls) and one whose gateway is three times slower than its lease, then
// checks every rule of the payments example through HTTP alone, using the fake gateway's ledger
// (GET /gateway/charges) as the witness of how often a card was charged. Finally stops every
// instance with SIGTERM and expects exit status 0. Exit status: 0 if every check passed, 1
// otherwise (each failure is printed).
//
//   payments-e2e --faults --server PATH [--db CONNINFO] [--bound-ms N] [--faults-ms N] [--keys N]
//
// Convergence after faults (CTest payments_e2e_faults): two instances (--lease-ms 1000
// --reconcile-every-ms 200) whose database backends are terminated for 5 s while 40 payments
// start, each retried; then every key must have its one 201 and one ledger charge within the
// README's bound of the last fault. See run_faults.
#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <latch>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int g_failures = 0;
int g_checks = 0;

void check(bool ok, const std::string& what) {
    ++g_checks;
    if (!ok) {
        ++g_failures;
        std::cout << "  FAIL: " << what << std::endl;
    }
}

void section(const std::string& title) { std::cout << "-- " << title << std::endl; }

// ------------------------------------------------------------------------------------------
// servers

struct Server {
    pid_t pid = -1;
    std::string url;
};

std::vector<pid_t> g_children;

void kill_children() {
    for (const pid_t pid : g_children) {
        if (pid > 0) kill(pid, SIGKILL);
    }
}

/// Starts a server and waits for its address. `log_path`: where its stderr goes (default: ours).
std::optional<Server> start_server(const std::string& exe, const std::vector<std::string>& args,
                                   const std::string& log_path = {}) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return std::nullopt;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    if (!log_path.empty()) {
        posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    }
    std::vector<std::string> storage{exe};
    storage.insert(storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        std::cout << "cannot start " << exe << std::endl;
        return std::nullopt;
    }
    g_children.push_back(pid);
    // The server's only stdout line: "listening on http://HOST:PORT".
    std::string line;
    const auto until = Clock::now() + 30s;
    while (line.find('\n') == std::string::npos && Clock::now() < until) {
        pollfd p{fds[0], POLLIN, 0};
        if (poll(&p, 1, 200) <= 0) continue;
        char buf[256];
        const ssize_t n = read(fds[0], buf, sizeof buf);
        if (n <= 0) break;
        line.append(buf, static_cast<std::size_t>(n));
    }
    close(fds[0]);
    const std::string prefix = "listening on ";
    const auto at = line.find(prefix);
    const auto end = line.find('\n');
    if (at == std::string::npos || end == std::string::npos) {
        std::cout << "server did not report its address (got '" << line << "')" << std::endl;
        return std::nullopt;
    }
    return Server{pid, line.substr(at + prefix.size(), end - at - prefix.size())};
}

/// SIGTERM, then the exit status (or -1 if it did not exit within 15 s, then it is killed).
int stop_server(Server& server) {
    kill(server.pid, SIGTERM);
    const auto until = Clock::now() + 15s;
    while (Clock::now() < until) {
        int status = 0;
        if (waitpid(server.pid, &status, WNOHANG) == server.pid) {
            std::erase(g_children, server.pid);
            server.pid = -1;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        std::this_thread::sleep_for(20ms);
    }
    kill(server.pid, SIGKILL);
    waitpid(server.pid, nullptr, 0);
    std::erase(g_children, server.pid);
    server.pid = -1;
    return -1;
}

// ---------------------------------------------------------------------------------------------
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

Reply send(const std::string& url, const std::string& method, const std::string& path, const httplib::Headers& headers,
           const std::string& body = {}) {
    httplib::Client client(url);
    client.set_connection_timeout(10s);
    client.set_read_timeout(30s);
    auto result = method == "GET" ? client.Get(path, headers) : client.Post(path, headers, body, "application/json");
    Reply reply;
    if (!result) {
        reply.error = httplib::to_string(result.error());
        return reply;
    }
    reply.status = result->status;
    reply.body = result->body;
    reply.headers = result->headers;
    return reply;
}

Reply pay(const std::string& url, const std::string& account, const std::optional<std::string>& key,
          const std::string& body) {
    httplib::Headers headers;
    if (!account.empty()) headers.emplace("Authorization", "Bearer " + account);
    if (key) headers.emplace("Idempotency-Key", *key);
    return send(url, "POST", "/payments", headers, body);
}

std::string payment_body(long order, long amount, const std::string& card, const std::string& currency = "BRL") {
    return R"({"order_id":)" + std::to_string(order) + R"(,"amount_cents":)" + std::to_string(amount) +
           R"(,"currency":")" + currency + R"(","card":")" + card + R"("})";
}

/// The gateway's own count of calls for a key (optionally one account's), or -1 on error.
long gateway_count(const std::string& url, const std::string& key, const std::string& account = {}) {
    std::string path = "/gateway/charges?idempotency_key=" + httplib::detail::encode_query_param(key);
    if (!account.empty()) path += "&account=" + httplib::detail::encode_query_param(account);
    const Reply r = send(url, "GET", path, {});
    if (r.status != 200) return -1;
    const auto json = nlohmann::json::parse(r.body, nullptr, false);
    if (json.is_discarded() || !json.contains("count")) return -1;
    return json["count"].get<long>();
}

std::string describe(const Reply& r) {
    if (r.status == 0) return "network error: " + r.error;
    return "HTTP " + std::to_string(r.status) + " " + r.body.substr(0, 200);
}

/// Runs payments-client; returns its exit status and combined output.
std::pair<int, std::string> run_client(const std::string& exe, const std::vector<std::string>& args) {
    std::string command = exe;
    for (const auto& a : args) command += " '" + a + "'";
    command += " 2>&1";
    std::string output;
    FILE* pipe = popen(command.c_str(), "r");
    if (pipe == nullptr) return {-1, ""};
    char buf[512];
    while (fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
    const int status = pclose(pipe);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// -----------------------------------------------------------------------------------------
// --faults: every key converges after the database connections were killed under load

/// A libpq session of the test's own: the fault injector, and the witness's view of the ledger
/// and of idem's table (read outside the servers and outside idem).
class Sql {
public:
    explicit Sql(const std::string& conninfo) {
        const char* keys[] = {"dbname", "application_name", nullptr};
        const char* values[] = {conninfo.c_str(), "payments-e2e", nullptr};
        conn_ = PQconnectdbParams(keys, values, 1);
        if (PQstatus(conn_) != CONNECTION_OK) {
            const std::string message = PQerrorMessage(conn_);
            PQfinish(conn_);
            throw std::runtime_error("cannot connect: " + message);
        }
    }
    ~Sql() { PQfinish(conn_); }
    Sql(const Sql&) = delete;
    Sql& operator=(const Sql&) = delete;

    /// The rows of a statement, every value as text (NULL as "NULL"). Throws on any error.
    std::vector<std::vector<std::string>> query(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::vector<const char*> values;
        for (const auto& p : params) values.push_back(p.c_str());
        PGresult* result = PQexecParams(conn_, sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                        nullptr, nullptr, 0);
        const auto status = PQresultStatus(result);
        if (status != PGRES_TUPLES_OK && status != PGRES_COMMAND_OK) {
            const std::string message = PQresultErrorMessage(result);
            PQclear(result);
            throw std::runtime_error("query failed: " + message + " (" + sql + ")");
        }
        std::vector<std::vector<std::string>> rows;
        for (int r = 0; r < PQntuples(result); ++r) {
            auto& row = rows.emplace_back();
            for (int c = 0; c < PQnfields(result); ++c)
                row.emplace_back(PQgetisnull(result, r, c) ? "NULL" : PQgetvalue(result, r, c));
        }
        PQclear(result);
        return rows;
    }

private:
    PGconn* conn_ = nullptr;
};

// The instances' settings in this scenario (those of the reported failure).
constexpr std::chrono::milliseconds kFaultsLease{1000};
constexpr std::chrono::milliseconds kFaultsReconcileEvery{200};
// payments-server releases a key that has no charge this long after its claim (README.md,
// "Reconciliation"); the README's bound after the last fault is this + lease + 2 reconciler
// periods.
constexpr std::chrono::milliseconds kReleaseAfter{8000};
// The test's clients retry every 100..250 ms.
constexpr std::chrono::milliseconds kRetryMin{100};
constexpr std::chrono::milliseconds kRetryMax{250};
// Scheduling delay allowed on a loaded 2-core machine, on top of the README's bound.
constexpr std::chrono::milliseconds kSchedulingSlack{2000};

struct FaultOptions {
    std::chrono::milliseconds faults{5000};  // how long backends are terminated
    // Every key has its 201 this long after the last fault at the latest.
    std::chrono::milliseconds bound =
        kReleaseAfter + kFaultsLease + 2 * kFaultsReconcileEvery + kRetryMax + kSchedulingSlack;
    int keys = 40;
};

/// One payment intent: one key, retried by its own thread until it gets its 201.
struct Intent {
    std::string key;
    std::string body;
    Clock::time_point first_request;
    std::optional<Clock::time_point> settled_at;  // the first 201
    std::string body_201;
    std::optional<Reply> refused;  // a final answer other than 201 (never expected)
    std::map<int, int> statuses;   // status -> how many (0: no response)
};

double seconds_between(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
}

std::string histogram(const std::map<int, int>& statuses) {
    std::string out;
    for (const auto& [status, n] : statuses)
        out += (out.empty() ? "" : " ") + std::to_string(status) + "x" + std::to_string(n);
    return out;
}

/// Two instances (lease 1 s, reconciler every 200 ms) while another session keeps terminating
/// their database backends (idem's and the gateway's): `keys` payments start one after the other
/// during the faults, each retried by its own client until it gets a 201. Then every key must
/// have its 201 within `bound` of the last fault and replay it byte for byte, and the gateway's
/// ledger (read with SQL, outside the servers) must hold exactly one charge per key. New payments
/// right after the faults, and after one more fault in a quiet moment, must be paid at once.
int run_faults(const std::string& server_exe, const std::string& db, const FaultOptions& fo) {
    std::mt19937_64 rng(std::random_device{}());
    const std::string run = std::to_string(rng() % 1'000'000'000);
    const std::string acct = "acct_faults_" + run;
    char dir_template[] = "/tmp/payments-faults.XXXXXX";
    const char* dir = mkdtemp(dir_template);
    if (dir == nullptr) {
        std::cout << "FAILED: mkdtemp" << std::endl;
        return 1;
    }
    const std::string log_dir = dir;

    section("starting instances A and B (--lease-ms " + std::to_string(kFaultsLease.count()) +
            " --reconcile-every-ms " + std::to_string(kFaultsReconcileEvery.count()) + ")");
    std::vector<Server> servers;
    std::vector<std::string> logs;
    for (const char* name : {"A", "B"}) {
        logs.push_back(log_dir + "/" + name + ".log");
        auto s =
            start_server(server_exe,
                         {"--listen", "127.0.0.1:0", "--db", db, "--lease-ms", std::to_string(kFaultsLease.count()),
                          "--reconcile-every-ms", std::to_string(kFaultsReconcileEvery.count()),
                          // (a request's claim and its save further apart: more faults
                          // land in between)
                          "--gateway-latency-ms", "20", "--threads", "64"},
                         logs.back());
        if (!s) {
            std::cout << "FAILED: could not start instance " << name << std::endl;
            return 1;
        }
        servers.push_back(*s);
    }
    const std::string A = servers[0].url, B = servers[1].url;

    Sql killer(db);
    Sql witness(db);

    // Terminates up to `victims` of the instances' backends (idem's and the gateway's
    // connections), chosen at random; returns their pids as a PostgreSQL array literal.
    int kills = 0, rounds = 0;
    const auto terminate = [&](int victims) {
        ++rounds;
        const auto killed = killer.query(
            "SELECT coalesce(array_agg(pid), '{}') FROM (SELECT pid FROM pg_stat_activity WHERE "
            "application_name IN ('payments-server', 'payments-gateway') AND pid <> "
            "pg_backend_pid() ORDER BY random() LIMIT $1) v WHERE pg_terminate_backend(pid)",
            {std::to_string(victims)});
        const std::string pids = killed.at(0).at(0);
        kills += pids == "{}" ? 0 : static_cast<int>(std::count(pids.begin(), pids.end(), ',') + 1);
        return pids;
    };
    // Terminates every backend of the instances and waits until they have all exited.
    const auto terminate_all = [&] {
        const std::string pids = terminate(1'000'000);
        for (const auto until = Clock::now() + 30s; Clock::now() < until;) {
            if (killer.query("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", {pids}).at(0).at(0) ==
                "0")
                return;
            std::this_thread::sleep_for(10ms);
        }
        check(false, "the terminated backends exited within 30 s");
    };
    // Payments sent all at once, alternately to A and B; the replies in order.
    const auto pay_at_once = [&](const std::string& tag, int count, long first_order) {
        std::vector<std::string> keys;
        std::vector<Reply> replies(static_cast<std::size_t>(count));
        for (int i = 0; i < count; ++i) keys.push_back("faults-" + run + "-" + tag + "-" + std::to_string(i));
        std::latch go(count);
        std::vector<std::thread> threads;
        for (int i = 0; i < count; ++i) {
            threads.emplace_back([&, i] {
                const auto at = static_cast<std::size_t>(i);
                go.arrive_and_wait();
                const auto sent = Clock::now();
                replies[at] = pay(i % 2 == 0 ? A : B, acct, keys[at], payment_body(first_order + i, 100 + i, "tok_ok"));
                replies[at].took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - sent);
            });
        }
        for (auto& t : threads) t.join();
        return std::pair(keys, replies);
    };
    // The gateway's ledger ids per key of this run's account, straight from the database.
    const auto ledger = [&] {
        std::map<std::string, std::vector<std::string>> charges;
        for (const auto& row : witness.query("SELECT idempotency_key, id FROM gateway_charges "
                                             "WHERE account = $1 ORDER BY id",
                                             {acct})) {
            charges[row[0]].push_back(row[1]);
        }
        return charges;
    };
    // What the database and the servers' logs say about a key (on failure).
    const auto explain = [&](const std::string& key) {
        for (const auto& row :
             witness.query("SELECT state, fence, attempt, created_at, lease_until, now() FROM idem_keys "
                           "WHERE scope = $1 AND key = $2",
                           {"payments:acct:" + acct, key})) {
            std::cout << "     idem row: state " << row[0] << ", fence " << row[1] << ", attempt " << row[2]
                      << ", created " << row[3] << ", lease until " << row[4] << " (now " << row[5] << ")" << std::endl;
        }
        for (std::size_t s = 0; s < logs.size(); ++s) {
            std::ifstream in(logs[s]);
            for (std::string line; std::getline(in, line);) {
                if (line.find("'" + key + "'") != std::string::npos)
                    std::cout << "     log "
                              << "AB"[s] << ": " << line << std::endl;
            }
        }
    };

    // New payments must be paid on their first request, each charged once.
    const auto check_paid_at_once = [&](const std::vector<std::string>& keys, const std::vector<Reply>& replies,
                                        const std::string& when) {
        auto charges = ledger();
        std::chrono::milliseconds slowest{0};
        for (const Reply& r : replies) slowest = std::max(slowest, r.took);
        std::cout << "   the slowest answered in " << slowest.count() << " ms" << std::endl;
        for (std::size_t i = 0; i < keys.size(); ++i) {
            const bool paid = replies[i].status == 201 && !replies[i].replayed();
            check(paid, "new payment " + keys[i] + " " + when + " -> 201 at once, got " + describe(replies[i]) +
                            " after " + std::to_string(replies[i].took.count()) + " ms");
            if (!paid) explain(keys[i]);
            check(charges[keys[i]].size() == 1, "new payment " + keys[i] + ": the gateway holds " +
                                                    std::to_string(charges[keys[i]].size()) + " charges");
        }
    };
    section("terminating the instances' backends for " + std::to_string(fo.faults.count()) + " ms while " +
            std::to_string(fo.keys) + " payments start, each retried");
    std::vector<Intent> intents(static_cast<std::size_t>(fo.keys));
    const auto start = Clock::now() + 200ms;
    // Every client retries until its 201, or until well past the bound (to tell "late" from
    // "never" in the report).
    std::atomic<Clock::rep> give_up{Clock::time_point::max().time_since_epoch().count()};
    std::vector<std::thread> clients;
    for (int i = 0; i < fo.keys; ++i) {
        Intent& intent = intents[static_cast<std::size_t>(i)];
        intent.key = "faults-" + run + "-" + std::to_string(i);
        intent.body = payment_body(1000 + i, 100 + i, "tok_ok");
        // Spread over the fault window, so that claims, charges and saves all meet a fault.
        intent.first_request = start + (fo.faults - 400ms) * i / fo.keys;
        clients.emplace_back([&intent, &give_up, &A, &B, &acct, i] {
            std::minstd_rand jitter(static_cast<unsigned>(i) + 1);
            std::this_thread::sleep_until(intent.first_request);
            for (int n = 0; Clock::now().time_since_epoch().count() < give_up.load(); ++n) {
                const Reply r = pay((i + n) % 2 == 0 ? A : B, acct, intent.key, intent.body);
                ++intent.statuses[r.status];
                if (r.status == 201) {
                    intent.settled_at = Clock::now();
                    intent.body_201 = r.body;
                    return;
                }
                if (r.status != 0 && r.status != 409 && r.status != 429 && r.status < 500) {
                    intent.refused = r;
                    return;
                }
                std::this_thread::sleep_for(kRetryMin +
                                            std::chrono::milliseconds(jitter() % (kRetryMax - kRetryMin).count()));
            }
        });
    }
    // Every 20..100 ms 1..3 backends, every eighth round and last all of them. The faults end
    // when the backends of the last round have exited.
    std::minstd_rand fault_rng(static_cast<unsigned>(rng()));
    std::this_thread::sleep_until(start);
    while (Clock::now() < start + fo.faults) {
        terminate(rounds % 8 == 7 ? 1'000'000 : static_cast<int>(1 + fault_rng() % 3));
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + fault_rng() % 80));
    }
    terminate_all();
    const auto last_fault = Clock::now();
    const auto deadline = last_fault + fo.bound;
    std::cout << "   " << kills << " backends terminated in " << rounds << " rounds" << std::endl;

    section("new payments right after the faults: paid at once");
    const auto [after_keys, after_replies] = pay_at_once("after", 8, 2000);
    give_up = (deadline + 5s).time_since_epoch().count();
    for (auto& t : clients) t.join();
    check_paid_at_once(after_keys, after_replies, "right after the faults");

    section("every key settled within " + std::to_string(fo.bound.count()) +
            " ms of the last fault: one 201, replayed byte for byte, one charge");
    std::map<int, int> all_statuses;
    double latest = 0;
    for (const Intent& intent : intents) {
        for (const auto& [status, n] : intent.statuses) all_statuses[status] += n;
        if (intent.settled_at) latest = std::max(latest, seconds_between(last_fault, *intent.settled_at));
    }
    std::cout << "   answers to the clients (0: no response): " << histogram(all_statuses) << std::endl;
    std::cout << "   the last key settled " << latest << " s after the last fault" << std::endl;
    check(kills > 0, "the faults terminated backends");
    auto charges = ledger();
    int unsettled = 0;
    for (const Intent& intent : intents) {
        const auto& ids = charges[intent.key];
        const bool in_time = intent.settled_at && *intent.settled_at <= deadline;
        const std::string who = "key " + intent.key + " (first sent " +
                                std::to_string(seconds_between(start, intent.first_request)) +
                                " s into the faults; answers " + histogram(intent.statuses) + ")";
        if (intent.refused) check(false, who + ": refused with " + describe(*intent.refused));
        check(in_time,
              who + ": " +
                  (intent.settled_at ? "201 only " + std::to_string(seconds_between(last_fault, *intent.settled_at)) +
                                           " s after the last fault"
                                     : "no 201 " + std::to_string(seconds_between(last_fault, Clock::now())) +
                                           " s after the last fault"));
        check(ids.size() == 1, who + ": the gateway holds " + std::to_string(ids.size()) + " charges");
        if (intent.settled_at) {
            const auto json = nlohmann::json::parse(intent.body_201, nullptr, false);
            check(!json.is_discarded() && ids.size() == 1 && json.value("payment_id", "") == "pay_" + ids[0],
                  who + ": the 201 is the gateway's one charge: " + intent.body_201);
            // A 201 whose save failed was answered from memory; the reconciler stores the same
            // bytes later. Either way, stored by the deadline.
            Reply again = pay(B, acct, intent.key, intent.body);
            while (again.status != 201 && Clock::now() < deadline) {
                std::this_thread::sleep_for(100ms);
                again = pay(B, acct, intent.key, intent.body);
            }
            check(again.status == 201 && again.replayed() && again.body == intent.body_201,
                  who + ": a retry replays the 201 byte for byte, got " + describe(again));
        }
        if (!in_time || ids.size() != 1) {
            ++unsettled;
            explain(intent.key);
        }
    }
    for (const auto& key : after_keys) {
        if (charges[key].size() != 1) explain(key);
    }

    section(
        "one more fault in a quiet moment (every backend terminated), then new payments: "
        "paid at once");
    terminate_all();
    const auto [quiet_keys, quiet_replies] = pay_at_once("quiet", 8, 4000);
    check_paid_at_once(quiet_keys, quiet_replies, "after a fault in a quiet moment");
    for (std::size_t i = 0; i < quiet_keys.size(); ++i) {
        if (quiet_replies[i].status != 201) explain(quiet_keys[i]);
    }

    const auto left = witness.query("SELECT count(*) FROM idem_keys WHERE scope = $1 AND state = 'in_progress'",
                                    {"payments:acct:" + acct});
    check(left.at(0).at(0) == "0", "no key left in progress: " + left.at(0).at(0));

    section("SIGTERM: both instances exit cleanly");
    for (auto& s : servers) {
        const std::string url = s.url;
        const int status = stop_server(s);
        check(status == 0, "instance " + url + " exited with " + std::to_string(status));
    }
    if (g_failures == 0) {
        for (const auto& log : logs) std::remove(log.c_str());
        rmdir(log_dir.c_str());
    } else {
        std::cout << "   server logs kept in " << log_dir << std::endl;
    }
    std::cout << (g_failures == 0 ? "PASSED" : "FAILED") << ": " << g_checks - g_failures << "/" << g_checks
              << " checks passed (" << unsettled << " of " << fo.keys << " keys of the faults unsettled in time)"
              << std::endl;
    return g_failures == 0 ? 0 : 1;
}

}  // namespace

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
                     "[--faults-ms N] [--keys N]\n"
                     "(the database comes from IDEM_TEST_DATABASE_URL by default; see "
                     "scripts/with-postgres.sh)\n";
        return 2;
    }
    std::atexit(kill_children);
    signal(SIGPIPE, SIG_IGN);

    // Keys unique to this run, so the test may also run against a database that is not throwaway.
    std::mt19937_64 rng(std::random_device{}());
    const std::string run = std::to_string(rng() % 1'000'000'000);
    auto fresh_key = [&, n = 0](const std::string& tag) mutable {
        return "e2e-" + run + "-" + tag + "-" + std::to_string(++n);
    };
    const std::string acct = "acct_e2e_" + run;

    section(
        "starting instances A, B (lease 2 s, gateway 50 ms) and C, D (rate limit 3/s) on "
        "one database");
    // A and B: a 50 ms gateway, so that the simultaneous requests really overlap a running charge.
    // A lease of 2 s: short enough that the reconciler settles a tok_timeout within seconds, long
    // enough that a busy machine's stalls never let it take over a request still running (whose
    // heartbeat renews the lease every 500 ms).
    const std::vector<std::string> common{"--listen", "127.0.0.1:0",          "--db", db,          "--lease-ms",
                                          "2000",     "--reconcile-every-ms", "100",  "--threads", "64"};
    std::vector<Server> servers;
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
    const std::string A = servers[0].url, B = servers[1].url, C = servers[2].url, D = servers[3].url;
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
    const std::string E = metrics_instance->url;

    section("401: no or malformed Authorization");
    {
        const std::string key = fresh_key("auth");
        const Reply none = pay(A, "", key, payment_body(1, 100, "tok_ok"));
        check(none.status == 401, "no Authorization -> 401, got " + describe(none));
        httplib::Headers basic{{"Authorization", "Basic YWxpY2U6c2VjcmV0"}, {"Idempotency-Key", key}};
        const Reply b = send(A, "POST", "/payments", basic, payment_body(1, 100, "tok_ok"));
        check(b.status == 401, "Basic auth -> 401, got " + describe(b));
        check(gateway_count(A, key) == 0, "no charge after 401");
    }

    section("400: missing or invalid Idempotency-Key");
    {
        const Reply missing = pay(A, acct, std::nullopt, payment_body(2, 100, "tok_ok"));
        check(missing.status == 400, "missing key -> 400, got " + describe(missing));
        for (const std::string& bad : {std::string(), std::string(256, 'k'),
                                       std::string("ab\x01"
                                                   "cd"),
                                       std::string("ab\tcd"), std::string("\xff\xfe")}) {
            const Reply r = pay(A, acct, bad, payment_body(2, 100, "tok_ok"));
            check(r.status == 400, "invalid key (" + std::to_string(bad.size()) + " bytes) -> 400, got " + describe(r));
        }
        const Reply max = pay(A, acct, run + std::string(255 - run.size(), 'k'), payment_body(2, 100, "tok_ok"));
        check(max.status == 201, "a 255-byte key is accepted, got " + describe(max));
    }

    section("GET /gateway/charges: 400 for a parameter the ledger could never hold, never 503");
    {
        const auto status_of = [&](const std::string& query) {
            return send(A, "GET", "/gateway/charges?" + query, {}).status;
        };
        check(status_of("account=x") == 400, "no idempotency_key -> 400");
        for (const char* bad : {"%FF", "a%00b", "%C3%28", "%ED%A0%80", "%F4%90%80%80", "%C0%AF"}) {
            check(status_of(std::string("idempotency_key=") + bad) == 400,
                  std::string("idempotency_key=") + bad + " -> 400");
        }
        check(status_of("idempotency_key=k&account=%FE") == 400, "account=%FE -> 400");
        const Reply fine = send(A, "GET", "/gateway/charges?idempotency_key=caf%C3%A9%F0%9F%92%B3", {});
        check(fine.status == 200 && fine.body.find("\"count\":0") != std::string::npos,
              "a UTF-8 key no one used -> 200, count 0: " + describe(fine));
    }

    section("400: invalid bodies do not consume the key; the corrected request then succeeds");
    const std::string k1 = fresh_key("body");
    std::string k1_body;
    {
        const std::vector<std::pair<std::string, std::string>> bad_bodies = {
            {"not JSON", "{order_id: 1"},
            {"empty body", ""},
            {"array", "[1,2]"},
            {"missing card", R"({"order_id":7,"amount_cents":2500,"currency":"BRL"})"},
            {"amount as string", R"({"order_id":7,"amount_cents":"2500","currency":"BRL","card":"tok_ok"})"},
            {"amount as float", R"({"order_id":7,"amount_cents":2500.0,"currency":"BRL","card":"tok_ok"})"},
            {"amount fractional", R"({"order_id":7,"amount_cents":25.5,"currency":"BRL","card":"tok_ok"})"},
            {"amount zero", R"({"order_id":7,"amount_cents":0,"currency":"BRL","card":"tok_ok"})"},
            {"amount negative", R"({"order_id":7,"amount_cents":-100,"currency":"BRL","card":"tok_ok"})"},
            {"order_id as string", R"({"order_id":"7","amount_cents":2500,"currency":"BRL","card":"tok_ok"})"},
            {"lowercase currency", R"({"order_id":7,"amount_cents":2500,"currency":"brl","card":"tok_ok"})"},
            {"4-letter currency", R"({"order_id":7,"amount_cents":2500,"currency":"BRLX","card":"tok_ok"})"},
            {"card as number", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":42})"},
            {"unknown field", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":"tok_ok","x":1})"},
            {"duplicate field",
             R"({"order_id":7,"amount_cents":1,"amount_cents":2500,"currency":"BRL","card":"tok_ok"})"},
            {"trailing garbage", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":"tok_ok"} x)"},
        };
        for (const auto& [what, body] : bad_bodies) {
            const Reply r = pay(what.size() % 2 == 0 ? A : B, acct, k1, body);
            check(r.status == 400, what + " -> 400, got " + describe(r));
        }
        check(gateway_count(A, k1) == 0, "no gateway call for invalid bodies");
        k1_body = payment_body(7, 2500, "tok_ok");
        const Reply ok = pay(A, acct, k1, k1_body);
        check(ok.status == 201, "same key, corrected body -> 201, got " + describe(ok));
        check(!ok.replayed(), "first success is not marked as replayed");
        const auto json = nlohmann::json::parse(ok.body, nullptr, false);
        check(!json.is_discarded() && json.value("status", "") == "captured" && json.value("order_id", 0) == 7 &&
                  json.value("amount_cents", 0) == 2500 && json.value("currency", "") == "BRL" &&
                  json.value("payment_id", "").starts_with("pay_"),
              "201 body has payment_id, status, order_id, amount_cents, currency: " + ok.body);
        check(ok.header("Content-Type").starts_with("application/json"), "201 is application/json");

        section(
            "replay: same status, byte-identical body, Idempotent-Replayed; field "
            "order/whitespace do not matter");
        const Reply again = pay(B, acct, k1, k1_body);
        check(again.status == 201 && again.body == ok.body,
              "replay on the other instance is identical: " + describe(again));
        check(again.replayed(), "replay carries Idempotent-Replayed: true");
        const std::string reordered =
            "{ \"card\" : \"tok_ok\",\n  \"currency\":\"BRL\", "
            "\"amount_cents\": 2500 ,\"order_id\":7 }";
        const Reply re = pay(A, acct, k1, reordered);
        check(re.status == 201 && re.body == ok.body && re.replayed(),
              "reordered fields and whitespace -> same replay, got " + describe(re));
        check(gateway_count(A, k1) == 1, "gateway count for the key is 1");

        section("422: same key, different request");
        const Reply other = pay(B, acct, k1, payment_body(7, 2600, "tok_ok"));
        check(other.status == 422, "different amount -> 422, got " + describe(other));
        const Reply other_card = pay(A, acct, k1, payment_body(7, 2500, "tok_declined"));
        check(other_card.status == 422, "different card -> 422, got " + describe(other_card));
        check(gateway_count(A, k1) == 1, "gateway count still 1 after 422s");
    }

    section("402: a decline is saved and replayed without calling the gateway again");
    {
        const std::string key = fresh_key("declined");
        const Reply first = pay(A, acct, key, payment_body(8, 990, "tok_declined"));
        check(first.status == 402, "tok_declined -> 402, got " + describe(first));
        const auto json = nlohmann::json::parse(first.body, nullptr, false);
        check(!json.is_discarded() && json.value("error", "") == "card_declined", "402 body has error card_declined");
        check(gateway_count(A, key) == 1, "the declined attempt is one gateway call");
        const Reply second = pay(B, acct, key, payment_body(8, 990, "tok_declined"));
        check(second.status == 402 && second.body == first.body && second.replayed(),
              "402 replayed identically, got " + describe(second));
        check(gateway_count(B, key) == 1, "gateway count stays 1 after the replay");
    }

    section("tok_timeout: 503 outcome_unknown -> 409 while in progress -> reconciled 201, one charge");
    {
        const std::string key = fresh_key("timeout");
        const std::string body = payment_body(9, 4200, "tok_timeout");
        const Reply first = pay(A, acct, key, body);
        check(first.status == 503, "tok_timeout -> 503, got " + describe(first));
        check(first.body == R"({"error":"outcome_unknown"})",
              "503 body is {\"error\":\"outcome_unknown\"}: " + first.body);
        const Reply retry = pay(B, acct, key, body);
        check(retry.status == 409, "immediate retry -> 409, got " + describe(retry));
        check(!retry.header("Retry-After").empty(), "409 has Retry-After");
        check(gateway_count(A, key) == 1, "the gateway did record one charge");
        Reply settled;
        const auto until = Clock::now() + 15s;
        while (Clock::now() < until) {
            settled = pay(settled.status % 2 == 0 ? A : B, acct, key, body);
            if (settled.status != 409) break;
            std::this_thread::sleep_for(100ms);
        }
        check(settled.status == 201, "after the reconciler, the retry gets 201, got " + describe(settled));
        const auto json = nlohmann::json::parse(settled.body, nullptr, false);
        const std::string charges = send(A, "GET", "/gateway/charges?idempotency_key=" + key, {}).body;
        const auto ledger = nlohmann::json::parse(charges, nullptr, false);
        check(!json.is_discarded() && !ledger.is_discarded() && ledger["count"] == 1 &&
                  json.value("payment_id", "") == ledger["charges"][0].value("payment_id", "?") &&
                  json.value("status", "") == "captured",
              "the 201 is the one charge the gateway made: " + settled.body + " vs " + charges);
        const Reply again = pay(A, acct, key, body);
        check(again.status == 201 && again.body == settled.body && again.replayed(), "and it replays identically");
        check(gateway_count(A, key) == 1, "gateway count is 1");
    }

    section("a payment slower than its lease keeps its key: 201 at once, one charge");
    {
        // An instance whose gateway answers 4 s after the claim, twice the lease, with the
        // reconciler looking every 100 ms: the request must keep its key until its own save.
        // (A charge starts within 5 s of the request or not at all: 4 s is the slowest gateway
        // that still charges.)
        const auto slow_instance =
            start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--lease-ms", "2000",
                                      "--reconcile-every-ms", "100", "--gateway-latency-ms", "4000"});
        check(slow_instance.has_value(), "the slow instance (lease 2 s, gateway 4 s) starts");
        if (slow_instance) {
            servers.push_back(*slow_instance);
            const std::string key = fresh_key("slow");
            const std::string body = payment_body(11, 4300, "tok_ok");
            const Reply first = pay(slow_instance->url, acct, key, body);
            check(first.status == 201 && !first.replayed(),
                  "a payment 4 s long with a 2 s lease -> 201 at once, got " + describe(first));
            check(gateway_count(A, key) == 1, "the gateway holds one charge");
            const Reply again = pay(A, acct, key, body);
            check(again.status == 201 && again.replayed() && again.body == first.body,
                  "a retry replays it byte for byte, got " + describe(again));
        }
    }

    section("50 simultaneous identical requests over two instances -> one charge");
    {
        const std::string key = fresh_key("burst");
        const std::string body = payment_body(10, 15000, "tok_ok");
        constexpr int kRequests = 50;
        std::vector<Reply> replies(kRequests);
        std::latch go(kRequests);
        std::vector<std::thread> threads;
        for (int i = 0; i < kRequests; ++i) {
            threads.emplace_back([&, i] {
                go.arrive_and_wait();
                replies[static_cast<std::size_t>(i)] = pay(i % 2 == 0 ? A : B, acct, key, body);
            });
        }
        for (auto& t : threads) t.join();
        std::map<int, int> by_status;
        std::set<std::string> bodies_201;
        bool retry_after_ok = true;
        for (const auto& r : replies) {
            ++by_status[r.status];
            if (r.status == 0) std::cout << "   network error: " << r.error << std::endl;
            if (r.status == 201) bodies_201.insert(r.body);
            if (r.status == 409 && r.header("Retry-After").empty()) retry_after_ok = false;
        }
        std::string summary;
        for (const auto& [status, n] : by_status) summary += std::to_string(status) + "x" + std::to_string(n) + " ";
        std::cout << "   statuses: " << summary << std::endl;
        check(by_status.size() <= 2 && by_status[201] >= 1 && by_status[201] + by_status[409] == kRequests,
              "every response is 201 or 409: " + summary);
        check(bodies_201.size() == 1,
              "every 201 body is byte-identical (" + std::to_string(bodies_201.size()) + " distinct)");
        check(retry_after_ok, "every 409 has Retry-After");
        check(gateway_count(A, key) == 1, "gateway count is 1");
        const Reply after = pay(B, acct, key, body);
        check(after.status == 201 && bodies_201.count(after.body) == 1 && after.replayed(),
              "a later retry replays the same 201");
    }

    section("account isolation: the same key in two accounts is two payments");
    {
        const std::string key = fresh_key("shared");
        const std::string acct_b = acct + "_b";
        const Reply a = pay(A, acct, key, payment_body(11, 1000, "tok_ok"));
        const Reply b = pay(B, acct_b, key, payment_body(12, 2000, "tok_ok"));
        check(a.status == 201 && b.status == 201,
              "both accounts get 201 (no 422 across accounts): " + describe(a) + " / " + describe(b));
        check(a.body != b.body, "different payments");
        check(gateway_count(A, key, acct) == 1 && gateway_count(A, key, acct_b) == 1, "one charge per account");
        const Reply a2 = pay(B, acct, key, payment_body(11, 1000, "tok_ok"));
        check(a2.status == 201 && a2.body == a.body && a2.replayed(), "account A's replay is A's payment");
        const Reply b_with_a_body = pay(A, acct_b, key, payment_body(11, 1000, "tok_ok"));
        check(b_with_a_body.status == 422, "account B cannot reach A's request under the same key");
    }

    section("429: per-account rate limit across instances, key not consumed");
    {
        const std::string limited = acct + "_rl";
        // All at once (a latch), so that they fall in one or two of the limiter's 1 s windows
        // however long each takes on a busy machine.
        std::vector<std::pair<std::string, Reply>> sent(10);
        {
            std::latch go(10);
            std::vector<std::thread> threads;
            for (int i = 0; i < 10; ++i) {
                sent[static_cast<std::size_t>(i)].first = fresh_key("rl");
                threads.emplace_back([&, i] {
                    auto& [key, reply] = sent[static_cast<std::size_t>(i)];
                    go.arrive_and_wait();
                    reply = pay(i % 2 == 0 ? C : D, limited, key, payment_body(20 + i, 100, "tok_ok"));
                });
            }
            for (auto& t : threads) t.join();
        }
        int ok = 0, limited_count = 0;
        std::string rejected_key;
        int rejected_order = 0;
        bool retry_after = true;
        for (std::size_t i = 0; i < sent.size(); ++i) {
            const auto& [key, r] = sent[i];
            if (r.status == 201) ++ok;
            if (r.status == 429) {
                ++limited_count;
                if (r.header("Retry-After").empty()) retry_after = false;
                if (rejected_key.empty()) {
                    rejected_key = key;
                    rejected_order = 20 + static_cast<int>(i);
                }
            }
        }
        check(limited_count >= 1 && ok + limited_count == 10, "10 quick requests at 3/s: some 429s, the rest 201 (" +
                                                                  std::to_string(ok) + " ok, " +
                                                                  std::to_string(limited_count) + " limited)");
        check(ok <= 6, "no more than 3 per second were accepted across both instances");
        check(retry_after, "every 429 has Retry-After");
        const Reply other = pay(C, acct + "_other", fresh_key("rl-other"), payment_body(30, 100, "tok_ok"));
        check(other.status == 201, "another account is not limited, got " + describe(other));
        if (!rejected_key.empty()) {
            check(gateway_count(C, rejected_key) == 0, "no gateway call for a 429");
            std::this_thread::sleep_for(1100ms);
            const Reply later = pay(D, limited, rejected_key, payment_body(rejected_order, 100, "tok_ok"));
            check(later.status == 201 && !later.replayed(),
                  "after Retry-After the same key succeeds: " + describe(later));
            check(gateway_count(C, rejected_key) == 1, "one charge for it");
        }
    }

    section("payments-client: one key per intent, reused on retries");
    {
        const std::string key = fresh_key("client");
        auto [rc1, out1] = run_client(client_exe, {"--url", A, "--account", acct, "--order", "40", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_ok", "--key", key});
        check(rc1 == 0 && out1.find("HTTP 201") != std::string::npos,
              "client pays: exit " + std::to_string(rc1) + "\n" + out1);
        auto [rc2, out2] = run_client(client_exe, {"--url", B, "--account", acct, "--order", "40", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_ok", "--key", key});
        check(rc2 == 0 && out2.find("HTTP 201 (replayed)") != std::string::npos, "client replays: " + out2);
        check(gateway_count(A, key) == 1, "one charge");

        auto [rc3, out3] = run_client(client_exe, {"--url", B, "--account", acct, "--order", "41", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_timeout"});
        check(rc3 == 0 && out3.find("HTTP 201") != std::string::npos && out3.find("HTTP 503") != std::string::npos,
              "client retries through 503/409 to the reconciled 201: " + out3);
        const auto key_at = out3.find("Idempotency-Key ");
        if (key_at != std::string::npos) {
            const std::string generated = out3.substr(key_at + 16, 36);
            check(gateway_count(A, generated) == 1, "the generated key was charged once: " + generated);
        }
        auto [rc4, out4] = run_client(client_exe, {"--url", A, "--account", acct, "--order", "42", "--amount", "5000",
                                                   "--currency", "brl", "--card", "tok_ok"});
        check(rc4 == 1 && out4.find("HTTP 400") != std::string::npos && out4.find("retrying") == std::string::npos,
              "client does not retry a 400: " + out4);
    }

    section("GET /metrics: instance E's Prometheus counters are exactly the calls made");
    {
        // The value of one sample line ("name{labels} value"), or "" if the series is missing.
        const auto value = [](const std::string& text, const std::string& series) {
            const auto at = text.find("\n" + series + " ");
            if (at == std::string::npos) return std::string();
            const auto from = at + series.size() + 2;
            return text.substr(from, text.find('\n', from) - from);
        };
        const auto calls = [&](const std::string& text, const std::string& outcome) {
            return value(text, "idem_calls_total{outcome=\"" + outcome + "\"}");
        };
        const std::vector<std::string> outcomes{"executed", "replayed", "in_progress",
                                                "mismatch", "released", "unknown"};
        const Reply before = send(E, "GET", "/metrics", {});
        check(before.status == 200 && before.header("Content-Type").starts_with("text/plain; version=0.0.4"),
              "/metrics answers 200 text/plain; version=0.0.4: " + describe(before) + " " +
                  before.header("Content-Type"));
        for (const auto& outcome : outcomes)
            check(calls(before.body, outcome) == "0",
                  "before any payment, calls " + outcome + " = 0, got '" + calls(before.body, outcome) + "'");

        const std::string acct_m = acct + "_metrics";
        constexpr int kNew = 4, kReplays = 3;
        std::vector<std::string> keys;
        for (int i = 0; i < kNew; ++i) {
            keys.push_back(fresh_key("metrics"));
            const Reply r = pay(E, acct_m, keys.back(), payment_body(60 + i, 700, "tok_ok"));
            check(r.status == 201 && !r.replayed(), "metrics: new payment -> 201, got " + describe(r));
        }
        for (int i = 0; i < kReplays; ++i) {
            const Reply r = pay(E, acct_m, keys[static_cast<std::size_t>(i)], payment_body(60 + i, 700, "tok_ok"));
            check(r.status == 201 && r.replayed(), "metrics: replay -> 201 replayed, got " + describe(r));
        }
        const Reply reused = pay(E, acct_m, keys[0], payment_body(60, 701, "tok_ok"));
        check(reused.status == 422, "metrics: reused key -> 422, got " + describe(reused));
        const Reply invalid = pay(E, acct_m, fresh_key("metrics"), "{");
        check(invalid.status == 400, "metrics: invalid body -> 400 (no claim), got " + describe(invalid));
        const std::string timeout_key = fresh_key("metrics-timeout");
        const Reply lost = pay(E, acct_m, timeout_key, payment_body(70, 700, "tok_timeout"));
        check(lost.status == 503, "metrics: tok_timeout -> 503 (unknown), got " + describe(lost));
        const Reply busy = pay(E, acct_m, timeout_key, payment_body(70, 700, "tok_timeout"));
        check(busy.status == 409, "metrics: its retry -> 409 (in progress), got " + describe(busy));

        const Reply after = send(E, "GET", "/metrics", {});
        check(after.status == 200, "/metrics answers 200 again: " + describe(after));
        const std::map<std::string, std::string> expected{{"executed", std::to_string(kNew)},
                                                          {"replayed", std::to_string(kReplays)},
                                                          {"in_progress", "1"},
                                                          {"mismatch", "1"},
                                                          {"released", "0"},
                                                          {"unknown", "1"}};
        for (const auto& [outcome, n] : expected) {
            check(calls(after.body, outcome) == n,
                  "calls " + outcome + " = " + n + ", got '" + calls(after.body, outcome) + "'");
            const std::string histogram = "idem_call_duration_seconds";
            const std::string label = "{outcome=\"" + outcome + "\"";
            check(value(after.body, histogram + "_count" + label + "}") == n &&
                      value(after.body, histogram + "_bucket" + label + ",le=\"+Inf\"}") == n,
                  "duration histogram of " + outcome + " counts " + n);
        }
        check(value(after.body, "idem_pool_connections_max") == "4", "pool max 4");
        const std::string open = value(after.body, "idem_pool_connections_open");
        check(open >= "1" && open <= "4" && open.size() == 1, "1..4 connections open: " + open);
        check(value(after.body, "idem_pool_waiters") == "0", "no caller waits for a connection");
        check(value(after.body, "idem_pool_acquire_timeouts_total") == "0", "no pool timeout");
        check(value(after.body, "idem_reconcile_failures_total{kind=\"sweep\"}") == "0", "no failed reconciler sweep");
        check(value(after.body, "idem_store_claims_total") == std::to_string(kNew + kReplays + 1 + 2),
              "the store saw one claim per call that reached it: " + value(after.body, "idem_store_claims_total"));
        check(value(after.body, "payments_store_saves_total") == std::to_string(kNew),
              "one save per new payment: " + value(after.body, "payments_store_saves_total"));
        check(value(after.body, "payments_group_commit_grouped_claims_total") == "0" &&
                  value(after.body, "payments_group_commit_grouped_saves_total") == "0",
              "--group-commit off: no claim or save went in a shared transaction");

        // F: the defaults, the replay cache and group commit on. The first replay reads the
        // completed record from PostgreSQL and keeps it; the next ones never reach the store, and
        // are byte-identical.
        const auto cached_instance = start_server(
            server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000", "--db-pool", "2"});
        check(cached_instance.has_value(), "instance F starts with the default replay cache and group commit");
        if (cached_instance) {
            servers.push_back(*cached_instance);
            const std::string F = cached_instance->url;
            const std::string key = fresh_key("cached");
            const Reply first = pay(F, acct_m, key, payment_body(90, 900, "tok_ok"));
            check(first.status == 201 && !first.replayed(), "cache: new payment -> 201, got " + describe(first));
            for (int i = 0; i < 3; ++i) {
                const Reply r = pay(F, acct_m, key, payment_body(90, 900, "tok_ok"));
                check(r.status == 201 && r.replayed() && r.body == first.body,
                      "cache: replay " + std::to_string(i + 1) + " -> 201 replayed, same bytes, got " + describe(r));
            }
            const Reply changed = pay(F, acct_m, key, payment_body(90, 901, "tok_ok"));
            check(changed.status == 422,
                  "cache: same key, other amount -> 422 from a cached entry, got " + describe(changed));
            const Reply m = send(F, "GET", "/metrics", {});
            check(calls(m.body, "executed") == "1" && calls(m.body, "replayed") == "3" &&
                      calls(m.body, "mismatch") == "1",
                  "cache: F counted 1 executed, 3 replayed, 1 mismatch");
            check(value(m.body, "idem_store_claims_total") == "2",
                  "cache: the store saw the new payment and the first replay only: " +
                      value(m.body, "idem_store_claims_total"));
            check(send(F, "GET", "/gateway/charges?idempotency_key=" + key, {}).body.find("\"count\":1") !=
                      std::string::npos,
                  "cache: one charge");

            // More simultaneous payments than F has connections: the claims and saves that find
            // none free share transactions. Each payment is still charged once and replays its own
            // bytes.
            constexpr int kBurst = 24;
            std::vector<std::string> burst_keys;
            for (int i = 0; i < kBurst; ++i) burst_keys.push_back(fresh_key("grouped"));
            std::vector<Reply> firsts(kBurst);
            std::latch go(kBurst);
            std::vector<std::thread> threads;
            for (int i = 0; i < kBurst; ++i) {
                threads.emplace_back([&, i] {
                    go.arrive_and_wait();
                    const auto at = static_cast<std::size_t>(i);
                    firsts[at] = pay(F, acct_m, burst_keys[at], payment_body(100 + i, 1000 + i, "tok_ok"));
                });
            }
            for (auto& t : threads) t.join();
            int paid = 0, charged_once = 0, replayed = 0;
            for (int i = 0; i < kBurst; ++i) {
                const auto at = static_cast<std::size_t>(i);
                if (firsts[at].status == 201 && !firsts[at].replayed()) ++paid;
                if (gateway_count(F, burst_keys[at]) == 1) ++charged_once;
                const Reply again = pay(F, acct_m, burst_keys[at], payment_body(100 + i, 1000 + i, "tok_ok"));
                if (again.status == 201 && again.replayed() && again.body == firsts[at].body) ++replayed;
            }
            check(paid == kBurst, "group commit: every simultaneous payment -> 201: " + std::to_string(paid));
            check(charged_once == kBurst, "group commit: one charge each: " + std::to_string(charged_once));
            check(replayed == kBurst, "group commit: each replays its own bytes: " + std::to_string(replayed));
            const Reply g = send(F, "GET", "/metrics", {});
            const std::string grouped_claims = value(g.body, "payments_group_commit_grouped_claims_total");
            const std::string grouped_saves = value(g.body, "payments_group_commit_grouped_saves_total");
            std::cout << "   grouped: " << grouped_claims << " claims in "
                      << value(g.body, "payments_group_commit_claim_groups_total") << " transactions, " << grouped_saves
                      << " saves in " << value(g.body, "payments_group_commit_save_groups_total") << std::endl;
            check(!grouped_claims.empty() && grouped_claims != "0",
                  "group commit: claims that found no connection free went in shared transactions");
        }
    }

    section("a charge whose commit fails is not a charge");
    {
        // The gateway's INSERT returns its row before its implicit commit, which may still fail: a
        // deferred trigger that refuses (an error after the row: rolled back, nothing charged) or
        // one that waits while the test terminates its backend (the connection lost before the
        // server said the commit was done: the outcome is unknown). Neither may be taken as a
        // charge: the ledger, the witness, has no row.
        constexpr long kRefused = 770001, kCutOff = 770002;
        Sql sql(db);
        sql.query(R"SQL(CREATE OR REPLACE FUNCTION payments_e2e_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.order_id = 770001 THEN RAISE EXCEPTION 'payments-e2e: refused at commit'; END IF;
    PERFORM pg_sleep(30);
    RETURN NULL;
END $$)SQL");
        sql.query(
            "CREATE CONSTRAINT TRIGGER payments_e2e_at_commit AFTER INSERT ON gateway_charges "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.order_id IN (770001, 770002)) "
            "EXECUTE FUNCTION payments_e2e_at_commit()");
        const std::string refused_key = fresh_key("commit-refused");
        const Reply refused = pay(A, acct, refused_key, payment_body(kRefused, 100, "tok_ok"));
        check(refused.status == 503 && refused.body.find("gateway_unavailable") != std::string::npos,
              "commit refused -> 503 gateway_unavailable (not charged, key released), got " + describe(refused));
        check(gateway_count(A, refused_key) == 0, "commit refused: no charge in the ledger");

        // G: a 30 s lease, so that no reconciler takes the key over while its commit waits.
        const auto waiting_instance =
            start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000"});
        check(waiting_instance.has_value(), "instance G starts");
        if (waiting_instance) {
            servers.push_back(*waiting_instance);
            const std::string G = waiting_instance->url;
            const std::string cut_key = fresh_key("commit-cut-off");
            Reply cut;
            std::thread paying([&] { cut = pay(G, acct, cut_key, payment_body(kCutOff, 100, "tok_ok")); });
            bool terminated = false;
            for (const auto until = Clock::now() + 20s; !terminated && Clock::now() < until;) {
                terminated = !sql.query(
                                     "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                     "application_name = 'payments-gateway' AND wait_event = 'PgSleep'")
                                  .empty();
                if (!terminated) std::this_thread::sleep_for(20ms);
            }
            paying.join();
            check(terminated, "the gateway's backend was terminated during its commit");
            check(cut.status == 503 && cut.body == R"({"error":"outcome_unknown"})",
                  "connection lost during the commit -> 503 outcome_unknown, got " + describe(cut));
            check(gateway_count(G, cut_key) == 0, "connection lost during the commit: no charge in the ledger");
            const Reply busy = pay(G, acct, cut_key, payment_body(kCutOff, 100, "tok_ok"));
            check(busy.status == 409, "its key stays in progress for the reconciler -> 409, got " + describe(busy));
        }
        sql.query("DROP TRIGGER payments_e2e_at_commit ON gateway_charges");
        sql.query("DROP FUNCTION payments_e2e_at_commit()");
        const Reply paid = pay(A, acct, refused_key, payment_body(kRefused, 100, "tok_ok"));
        check(paid.status == 201 && !paid.replayed(), "the released key pays on its retry, got " + describe(paid));
        check(gateway_count(A, refused_key) == 1, "one charge for it");
    }

    section("a charge still committing when its key is due for release: one charge");
    {
        // The gateway's commit takes 12 s (a deferred trigger sleeps in it), past the 8 s after
        // which a key with no charge is released. The reconciler must not take "no row yet" for
        // "no charge": the key stays in progress until the commit has ended, then replays the
        // charge. A second request at the same time finds the trigger's lock taken and commits at
        // once, so a release would show as a second charge.
        constexpr long kSlowCommit = 770003;
        Sql sql(db);
        sql.query(R"SQL(CREATE OR REPLACE FUNCTION payments_e2e_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pg_try_advisory_lock(770003) THEN
        PERFORM pg_sleep(12);
        PERFORM pg_advisory_unlock(770003);
    END IF;
    RETURN NULL;
END $$)SQL");
        sql.query(
            "CREATE CONSTRAINT TRIGGER payments_e2e_slow_commit AFTER INSERT ON gateway_charges "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.order_id = 770003) "
            "EXECUTE FUNCTION payments_e2e_slow_commit()");
        const std::string key = fresh_key("slow-commit");
        const std::string body = payment_body(kSlowCommit, 100, "tok_ok");
        Reply first;
        std::thread paying([&] { first = pay(A, acct, key, body); });
        bool sleeping = false;
        for (const auto until = Clock::now() + 10s; !sleeping && Clock::now() < until;) {
            sleeping = !sql.query(
                               "SELECT 1 FROM pg_stat_activity WHERE application_name = 'payments-gateway' "
                               "AND wait_event = 'PgSleep'")
                            .empty();
            if (!sleeping) std::this_thread::sleep_for(20ms);
        }
        check(sleeping, "the charge's commit is under way");
        // Retries until the key is settled: 409 while in progress, then the charge replayed.
        Reply settled;
        int in_progress = 0;
        for (const auto until = Clock::now() + 60s; Clock::now() < until;) {
            settled = pay(A, acct, key, body);
            if (settled.status != 409) break;
            ++in_progress;
            std::this_thread::sleep_for(250ms);
        }
        paying.join();
        check(in_progress > 0, "the key stays in progress while the charge commits");
        check(settled.status == 201 && settled.replayed(),
              "then its retry replays the one charge (not a new one), got " + describe(settled) + " after " +
                  std::to_string(in_progress) + " answers 409; the first request got " + describe(first));
        check(gateway_count(A, key) == 1, "one charge for it");
        sql.query("DROP TRIGGER payments_e2e_slow_commit ON gateway_charges");
        sql.query("DROP FUNCTION payments_e2e_slow_commit()");
    }

    section("a charge that reaches the gateway after its deadline is refused by the database");
    {
        // gateway_charge compares the request's deadline with the database's clock, after taking
        // the key's lock: a charge sent in time but run late (its backend stalled) is not made.
        const std::string key = fresh_key("late-charge");
        Sql sql(db);
        const auto late = sql.query(
            "SELECT count(*) FROM gateway_charge($1, $2, 770004, 100, 'BRL', 'tok_ok', 'captured', "
            "clock_timestamp() - interval '1 second')",
            {acct, key});
        check(late.size() == 1 && late[0][0] == "0", "a charge past its deadline: no row returned");
        const auto in_time = sql.query(
            "SELECT count(*) FROM gateway_charge($1, $2, 770004, 100, 'BRL', 'tok_ok', 'captured', "
            "clock_timestamp() + interval '1 minute')",
            {acct, key});
        check(in_time.size() == 1 && in_time[0][0] == "1", "the same charge in time: made");
        check(gateway_count(A, key) == 1, "the ledger holds the one charge made in time");
    }

    section("a client that stops reading is disconnected (--threads 1)");
    {
        // H serves one connection at a time. A client pipelines requests and never reads their
        // answers: once the socket buffers are full the server cannot finish writing. It must
        // give up on that client, or the one slot (and SIGTERM) waits for it forever.
        auto stuck_instance = start_server(
            server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000", "--threads", "1"});
        check(stuck_instance.has_value(), "instance H starts with --threads 1");
        if (stuck_instance) {
            const std::string H = stuck_instance->url;
            const int port = std::stoi(H.substr(H.rfind(':') + 1));
            // A connection that sends `requests` pipelined GET /metrics and reads nothing.
            const auto stuck_client = [port](int requests) {
                const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                const int small = 4096;
                setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
                sockaddr_in to{};
                to.sin_family = AF_INET;
                to.sin_port = htons(static_cast<std::uint16_t>(port));
                to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                if (connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) return fd;
                std::string pipeline;
                for (int i = 0; i < requests; ++i) pipeline += "GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n";
                std::size_t sent = 0;
                for (const auto until = Clock::now() + 2s; sent < pipeline.size() && Clock::now() < until;) {
                    const ssize_t n = ::send(fd, pipeline.data() + sent, pipeline.size() - sent, MSG_DONTWAIT);
                    if (n > 0) sent += static_cast<std::size_t>(n);
                    else std::this_thread::sleep_for(10ms);
                }
                return fd;
            };
            const std::size_t metrics_bytes = send(H, "GET", "/metrics", {}).body.size();
            // Far more answer bytes than the largest socket buffers hold (4 MiB each way).
            const int requests = static_cast<int>((32u << 20) / std::max<std::size_t>(metrics_bytes, 1024));
            const int first = stuck_client(requests);
            std::this_thread::sleep_for(1s);
            const auto asked = Clock::now();
            const Reply health = send(H, "GET", "/healthz", {});
            check(health.status == 200 && Clock::now() - asked < 20s,
                  "the next connection is served once the stuck client is dropped, got " + describe(health));
            close(first);
            const int second = stuck_client(requests);
            std::this_thread::sleep_for(1s);
            const int status = stop_server(*stuck_instance);
            check(status == 0,
                  "SIGTERM with a client that reads nothing: exit status 0 within 15 s, got " + std::to_string(status));
            close(second);
        }
    }

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
