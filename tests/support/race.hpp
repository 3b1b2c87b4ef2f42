// tests/support/race.hpp — races of OS processes on the same keys (not part of idem): the tables,
// the race workers' command line and output (store/race_worker.cpp, asio/async_race_worker.cpp),
// and the parent's side (store/concurrency_test.cpp, asio/async_concurrency_test.cpp): start the
// workers together, wait for them, read what each says happened and check it against the effect
// rows the database holds.
//
// A worker writes one line per call: "E k body" (executed), "R k body" (replayed), "P k" (in
// progress) in the race, and "F k body" for the final replay of every key. The body of key k's
// effect is "key=K;pid=P;tid=T", and the effect row (scope, key-K, pid P, tid T).
#pragma once

#include "pg.hpp"
#include "test_env.hpp"

#include <unistd.h>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

namespace idem_test::race {

/// A worker's command line: CONNINFO TABLE EFFECTS_TABLE SCOPE KEYS CLIENTS START_AT_MS OUTFILE.
struct WorkerArgs {
    std::string conninfo;
    std::string table;
    std::string effects;
    std::string scope;
    int keys = 0;
    int clients = 0;  // threads or coroutines
    long long start_at_ms = 0;
    std::string outfile;

    /// Null (and the usage on stderr) unless there are exactly the eight arguments.
    static std::optional<WorkerArgs> parse(int argc, char** argv, const char* clients_name) {
        if (argc != 9) {
            std::cerr << "usage: " << (argc > 0 ? argv[0] : "race_worker")
                      << " CONNINFO TABLE EFFECTS_TABLE SCOPE KEYS " << clients_name << " START_AT_MS OUTFILE\n";
            return std::nullopt;
        }
        WorkerArgs a;
        a.conninfo = argv[1];
        a.table = argv[2];
        a.effects = argv[3];
        a.scope = argv[4];
        a.keys = std::stoi(argv[5]);
        a.clients = std::stoi(argv[6]);
        a.start_at_ms = std::stoll(argv[7]);
        a.outfile = argv[8];
        return a;
    }

    /// The arguments, with the program first (for posix_spawn).
    [[nodiscard]] std::vector<std::string> argv(const std::string& program) const {
        return {program,
                conninfo,
                table,
                effects,
                scope,
                std::to_string(keys),
                std::to_string(clients),
                std::to_string(start_at_ms),
                outfile};
    }
};

/// The body an effect returns: "key=K;pid=P;tid=T".
inline std::string effect_body(int k, int pid, int tid) {
    return "key=" + std::to_string(k) + ";pid=" + std::to_string(pid) + ";tid=" + std::to_string(tid);
}

/// A worker's end: writes `lines` to the outfile; the exit status (0 when nothing failed).
inline int finish_worker(const WorkerArgs& args, const std::vector<std::string>& lines, int failed) {
    std::ofstream out(args.outfile);
    for (const auto& line : lines) out << line << '\n';
    out.close();
    if (!out) {
        std::cerr << "worker " << ::getpid() << ": cannot write " << args.outfile << "\n";
        return 1;
    }
    return failed == 0 ? 0 : 1;
}

/// An idem table and an effects table (no unique constraint on purpose: a second run of an effect
/// must show up as a second row), both dropped at the end.
struct Tables {
    std::string conninfo;
    std::string idem;
    std::string effects;

    Tables(std::string url, const std::string& idem_prefix, const std::string& effects_prefix)
        : conninfo(std::move(url)), idem(unique_name(idem_prefix)), effects(unique_name(effects_prefix)) {
        PgConn(conninfo).exec("CREATE TABLE " + effects +
                              " (scope text NOT NULL, key text NOT NULL, pid int NOT NULL, tid int NOT NULL, "
                              "at timestamptz NOT NULL DEFAULT clock_timestamp())");
    }
    ~Tables() {
        drop_idem_table(conninfo, idem);
        try {
            PgConn(conninfo).exec("DROP TABLE IF EXISTS " + effects);
        } catch (...) {
        }
    }
    Tables(const Tables&) = delete;
    Tables& operator=(const Tables&) = delete;
};

/// A fresh temporary directory, removed with everything in it at the end.
struct TempDir {
    std::filesystem::path path;
    explicit TempDir(const std::string& prefix) : path(std::filesystem::temp_directory_path() / unique_name(prefix)) {
        std::filesystem::create_directories(path);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
};

/// Milliseconds since the Unix epoch, `delay` from now: when the workers start together.
inline long long start_at_ms(std::chrono::milliseconds delay) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               (std::chrono::system_clock::now() + delay).time_since_epoch())
        .count();
}

/// The command line of a race over `tables` (the outfile is each worker's own).
inline WorkerArgs worker_args(const Tables& tables, const std::string& scope, int keys, int clients,
                              std::chrono::milliseconds start_in) {
    WorkerArgs a;
    a.conninfo = tables.conninfo;
    a.table = tables.idem;
    a.effects = tables.effects;
    a.scope = scope;
    a.keys = keys;
    a.clients = clients;
    a.start_at_ms = start_at_ms(start_in);
    return a;
}

/// What the workers' output files say happened.
struct Report {
    std::map<int, std::string> executed_body;  // key -> body, from the executing process
    std::map<int, pid_t> executed_by;
    int executed_lines = 0, replayed_lines = 0, busy_lines = 0;
    std::vector<std::tuple<pid_t, int, std::string>> replays;  // R and F lines
    std::map<pid_t, int> first_pass;                           // E, R and P lines
    std::map<pid_t, int> finals;                               // F lines

    /// Replays (R and F) whose body is not the executing process's.
    [[nodiscard]] int wrong_replays() const {
        int wrong = 0;
        for (const auto& [pid, k, body] : replays) {
            const auto it = executed_body.find(k);
            if (it == executed_body.end() || body != it->second) ++wrong;
        }
        return wrong;
    }
};

/// Reads outfiles[p], written by the worker pids[p]. Null if one cannot be opened.
inline std::optional<Report> read_report(const std::vector<pid_t>& pids, const std::vector<std::string>& outfiles) {
    Report report;
    for (std::size_t p = 0; p < pids.size(); ++p) {
        const pid_t pid = pids[p];
        std::ifstream in(outfiles[p]);
        if (!in.good()) return std::nullopt;
        std::string line;
        while (std::getline(in, line)) {
            std::istringstream fields(line);
            std::string kind;
            std::string body;
            int k = -1;
            fields >> kind >> k >> body;
            if (kind == "E") {
                ++report.executed_lines, ++report.first_pass[pid];
                report.executed_body[k] = body;
                report.executed_by[k] = pid;
            } else if (kind == "R" || kind == "F") {
                report.replays.emplace_back(pid, k, body);
                if (kind == "F") {
                    ++report.finals[pid];
                } else {
                    ++report.replayed_lines, ++report.first_pass[pid];
                }
            } else if (kind == "P") {
                ++report.busy_lines, ++report.first_pass[pid];
            }
        }
    }
    return report;
}

/// What the database says happened: "key-K" -> (pid, tid) of the effect row.
inline std::map<std::string, std::pair<std::string, std::string>> effect_rows(PgConn& admin,
                                                                              const std::string& effects_table) {
    std::map<std::string, std::pair<std::string, std::string>> by_key;
    const auto rows = admin.exec("SELECT key, pid, tid FROM " + effects_table);
    for (int i = 0; i < rows.rows(); ++i) by_key[rows.text(i, 0)] = {rows.text(i, 1), rows.text(i, 2)};
    return by_key;
}

/// Executions the processes report that the effect rows do not confirm: another process's row, or
/// a body that is not the one the row's effect returned.
inline int disagreements(const Report& report, const std::map<std::string, std::pair<std::string, std::string>>& rows) {
    int n = 0;
    for (const auto& [k, pid] : report.executed_by) {
        const auto it = rows.find("key-" + std::to_string(k));
        if (it == rows.end()) {
            n += 2;
            continue;
        }
        const auto& [row_pid, row_tid] = it->second;
        if (row_pid != std::to_string(pid)) ++n;
        if (report.executed_body.at(k) != "key=" + std::to_string(k) + ";pid=" + row_pid + ";tid=" + row_tid) ++n;
    }
    return n;
}

}  // namespace idem_test::race
