// The parent (see parent.hpp).
#include "parent.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "output.hpp"

namespace bench::inflight {
namespace {

std::string load_average() {
    std::ifstream in("/proc/loadavg");
    std::string a, b, c;
    in >> a >> b >> c;
    return a.empty() ? "?" : a + " " + b + " " + c;
}

ScenarioRun spawn_scenario(const Options& o, const std::string& scenario, const std::string& table) {
    const std::string self = self_path();
    // The conninfo goes by the environment (it may hold a password: not on a command line).
    std::vector<std::string> args{self,
                                  "--scenario",
                                  scenario,
                                  "--table",
                                  table,
                                  "--requests",
                                  std::to_string(o.requests),
                                  "--connections",
                                  std::to_string(o.connections),
                                  "--threads",
                                  std::to_string(o.threads),
                                  "--blocking-pool",
                                  std::to_string(o.blocking_pool),
                                  "--effect-ms",
                                  std::to_string(o.effect_ms)};
    if (o.statement_timeout_ms > 0) {
        args.emplace_back("--statement-timeout-ms");
        args.push_back(std::to_string(o.statement_timeout_ms));
    }
    if (!o.replay) args.emplace_back("--no-replay");
    const bench::ChildRun child = bench::run_child(args, false);  // its stderr is ours: its progress lines show
    if (child.status < 0) throw std::runtime_error("idem-asio-bench: " + child.output);
    const int status = child.status;
    const rusage& ru = child.usage;
    const std::string& out = child.output;
    ScenarioRun r;
    r.scenario = scenario;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    r.peak_rss_mb = static_cast<double>(ru.ru_maxrss) / 1024.0;  // kilobytes on Linux
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
        const auto sp = line.find(' ');
        if (sp != std::string::npos) r.figures[line.substr(0, sp)] = line.substr(sp + 1);
    }
    return r;
}

/// libpq on the side: server settings, and dropping the scenarios' tables.
class Db {
public:
    explicit Db(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str())) {
        if (PQstatus(conn_) != CONNECTION_OK) {
            const std::string why = PQerrorMessage(conn_);
            PQfinish(conn_);
            throw std::runtime_error("cannot connect: " + why);
        }
    }
    ~Db() { PQfinish(conn_); }
    Db(const Db&) = delete;
    Db& operator=(const Db&) = delete;
    std::string exec(const std::string& sql) {
        PGresult* r = PQexec(conn_, sql.c_str());
        const auto st = PQresultStatus(r);
        std::string v = st == PGRES_TUPLES_OK && PQntuples(r) > 0 ? PQgetvalue(r, 0, 0) : "";
        const std::string err = PQresultErrorMessage(r);
        PQclear(r);
        if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK) throw std::runtime_error(sql + ": " + err);
        return v;
    }

private:
    PGconn* conn_;
};

double median(std::vector<double> v) {
    v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

std::string self_path() {
    char self[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) throw std::runtime_error(std::string("readlink /proc/self/exe: ") + std::strerror(errno));
    self[n] = '\0';
    return self;
}

int run_parent(const Options& o) {
    std::string server;
    {
        Db db(o.db);
        server = fmt::format("server_version={}, synchronous_commit={}, fsync={}, max_connections={}",
                             db.exec("SHOW server_version"), db.exec("SHOW synchronous_commit"), db.exec("SHOW fsync"),
                             db.exec("SHOW max_connections"));
    }
    const std::string load_before = load_average();
    std::fprintf(stderr,
                 "%s: %zu requests per scenario, effect %d ms; async: 1 thread, %zu connections; blocking: "
                 "%zu threads, %zu connections; %u CPUs, load %s; %s\n",
                 kName, o.requests, o.effect_ms, o.connections, o.threads, o.blocking_pool,
                 std::thread::hardware_concurrency(), load_before.c_str(), server.c_str());

    const std::string prefix = "bench_asio_" + std::to_string(::getpid());
    std::vector<std::string> tables;
    std::vector<std::vector<ScenarioRun>> rounds;
    for (int round = 0; round < o.rounds; ++round) {
        std::vector<std::string> order = o.scenarios;
        if (round % 2 == 1) std::reverse(order.begin(), order.end());  // ABBA
        std::vector<ScenarioRun> runs;
        for (const auto& scenario : order) {
            const std::string table = fmt::format("{}_{}_{}", prefix, scenario, round);
            tables.push_back(table);
            ScenarioRun r = spawn_scenario(o, scenario, table);
            std::fprintf(stderr,
                         "%s: round %d %-8s %8.0f req/s  wall %.2f s  p50 %.1f ms  p99 %.1f ms  in flight max %.0f  "
                         "peak RSS %.1f MB  %s\n",
                         kName, round + 1, scenario.c_str(), r.num("new_ops_per_s"), r.num("new_wall_s"),
                         r.num("new_p50_ms"), r.num("new_p99_ms"), r.num("new_in_flight_max"), r.peak_rss_mb,
                         r.exit_code != 0                  ? fmt::format("FAILED (exit {})", r.exit_code).c_str()
                         : r.correct(o.requests, o.replay) ? "all answers right"
                                                           : "WRONG ANSWERS");
            runs.push_back(std::move(r));
        }
        rounds.push_back(std::move(runs));
    }
    if (!o.keep_tables) {
        try {
            Db db(o.db);
            for (const auto& t : tables) db.exec("DROP TABLE IF EXISTS " + t);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "%s: dropping the tables: %s\n", kName, e.what());
        }
    }
    const std::string load_after = load_average();

    // Summary: medians over rounds; the largest async peak RSS.
    bool all_correct = true;
    std::vector<double> async_ops, blocking_ops;
    double async_rss = NAN;
    std::uint64_t answers = 0;
    for (const auto& runs : rounds) {
        for (const auto& r : runs) {
            all_correct = all_correct && r.correct(o.requests, o.replay);
            answers += o.requests * (o.replay ? 2 : 1);
            (r.scenario == "async" ? async_ops : blocking_ops).push_back(r.num("new_ops_per_s"));
            if (r.scenario == "async")
                async_rss = std::isfinite(async_rss) ? std::max(async_rss, r.peak_rss_mb) : r.peak_rss_mb;
        }
    }
    const double a = median(async_ops), b = median(blocking_ops);
    const double ratio = a / b;
    const bool ratio_ok = std::isfinite(ratio) && ratio >= 1.0;
    const bool rss_ok = std::isfinite(async_rss) && async_rss <= 100.0;

    std::vector<std::string> verdicts;
    verdicts.push_back(
        fmt::format("{} correctness: {} of {} answers right (executed or replayed, right bytes; each "
                    "effect ran exactly once)",
                    all_correct ? "PASS" : "FAIL", all_correct ? answers : 0, answers));
    verdicts.push_back(std::isfinite(ratio) ? fmt::format("{} throughput: async / blocking = {:.2f} (target >= 1.0)",
                                                          ratio_ok ? "PASS" : "FAIL", ratio)
                                            : std::string("SKIP throughput: needs both scenarios"));
    verdicts.push_back(std::isfinite(async_rss) ? fmt::format("{} memory: async peak RSS {:.1f} MB (target <= 100 MB)",
                                                              rss_ok ? "PASS" : "FAIL", async_rss)
                                                : std::string("SKIP memory: the async scenario did not run"));

    std::string s = "{\n";
    s += fmt::format("  \"requests\": {}, \"effect_ms\": {}, \"rounds\": {}, \"replay\": {},\n", o.requests,
                     o.effect_ms, o.rounds, o.replay ? "true" : "false");
    s += fmt::format("  \"cpus\": {}, \"load_before\": {}, \"load_after\": {}, \"server\": {},\n",
                     std::thread::hardware_concurrency(), json_string(load_before), json_string(load_after),
                     json_string(server));
    s += "  \"runs\": [";
    for (std::size_t i = 0; i < rounds.size(); ++i) {
        s += i ? ",\n    {" : "\n    {";
        for (std::size_t j = 0; j < rounds[i].size(); ++j) {
            s +=
                fmt::format("{}\"{}\": {}", j ? ",\n     " : "", rounds[i][j].scenario, json_scenario(rounds[i][j], o));
        }
        s += "}";
    }
    s += "\n  ],\n";
    s += fmt::format(
        "  \"async_ops_per_s\": {}, \"blocking_ops_per_s\": {}, \"ratio\": {}, \"async_peak_rss_mb\": {},\n",
        json_number(a), json_number(b), json_number(ratio), json_number(async_rss));
    s += fmt::format("  \"targets\": {{\"all_correct\": {}, \"ratio_ge_1\": {}, \"async_rss_le_100_mb\": {}}},\n",
                     all_correct ? "true" : "false", std::isfinite(ratio) ? (ratio_ok ? "true" : "false") : "null",
                     std::isfinite(async_rss) ? (rss_ok ? "true" : "false") : "null");
    s += "  \"verdicts\": [";
    for (std::size_t i = 0; i < verdicts.size(); ++i) s += (i ? ",\n    " : "\n    ") + json_string(verdicts[i]);
    s += "\n  ]\n}\n";

    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    for (const auto& v : verdicts) std::fprintf(stderr, "%s: %s\n", kName, v.c_str());
    if (!o.json.empty()) {
        std::FILE* f = std::fopen(o.json.c_str(), "w");
        if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
            std::fprintf(stderr, "%s: cannot write %s\n", kName, o.json.c_str());
            return 1;
        }
    }
    return all_correct ? 0 : 3;
}

}  // namespace bench::inflight
