// payments-e2e's helpers (e2e_support.hpp): checks, server processes, HTTP, SQL.
#include "e2e_support.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace e2e {

using namespace std::chrono_literals;

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

namespace {
std::vector<pid_t> g_children;
}  // namespace

void kill_children() {
    for (const pid_t pid : g_children) {
        if (pid > 0) kill(pid, SIGKILL);
    }
}

/// Starts a server and waits for its address. `log_path`: where its stderr goes (default: ours).
std::optional<Server> start_server(const std::string& exe, const std::vector<std::string>& args,
                                   const std::string& log_path) {
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

Reply send(const std::string& url, const std::string& method, const std::string& path, const httplib::Headers& headers,
           const std::string& body) {
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

std::string payment_body(long order, long amount, const std::string& card, const std::string& currency) {
    return R"({"order_id":)" + std::to_string(order) + R"(,"amount_cents":)" + std::to_string(amount) +
           R"(,"currency":")" + currency + R"(","card":")" + card + R"("})";
}

/// The gateway's own count of calls for a key (optionally one account's), or -1 on error.
long gateway_count(const std::string& url, const std::string& key, const std::string& account) {
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

Sql::Sql(const std::string& conninfo) {
    const char* keys[] = {"dbname", "application_name", nullptr};
    const char* values[] = {conninfo.c_str(), "payments-e2e", nullptr};
    conn_ = PQconnectdbParams(keys, values, 1);
    if (PQstatus(conn_) != CONNECTION_OK) {
        const std::string message = PQerrorMessage(conn_);
        PQfinish(conn_);
        throw std::runtime_error("cannot connect: " + message);
    }
}

std::vector<std::vector<std::string>> Sql::query(const std::string& sql, const std::vector<std::string>& params) {
    std::vector<const char*> values;
    for (const auto& p : params) values.push_back(p.c_str());
    PGresult* result =
        PQexecParams(conn_, sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(), nullptr, nullptr, 0);
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

}  // namespace e2e
