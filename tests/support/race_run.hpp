// tests/support/race_run.hpp — the parent's side of a race of OS processes (race.hpp), with its
// assertions: store/concurrency_test.cpp and asio/async_concurrency_test.cpp.
#pragma once

#include "race.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <catch2/catch.hpp>

extern char** environ;

namespace idem_test::race {

struct Workers {
    std::vector<pid_t> pids;
    std::vector<std::string> outfiles;
};

/// Starts `processes` workers (`program` with `args`, each with its own outfile in `dir`) and
/// waits for them: every one must start and exit 0.
inline Workers run_workers(const std::string& program, WorkerArgs args, int processes,
                           const std::filesystem::path& dir) {
    Workers w;
    for (int p = 0; p < processes; ++p) {
        w.outfiles.push_back((dir / ("worker" + std::to_string(p) + ".txt")).string());
        args.outfile = w.outfiles.back();
        std::vector<std::string> strings = args.argv(program);
        std::vector<char*> argv;
        for (auto& a : strings) argv.push_back(a.data());
        argv.push_back(nullptr);
        pid_t pid = 0;
        const int rc = ::posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), environ);
        REQUIRE(rc == 0);
        w.pids.push_back(pid);
    }
    std::map<pid_t, int> exit_codes;
    for (pid_t pid : w.pids) {
        int status = 0;
        REQUIRE(::waitpid(pid, &status, 0) == pid);
        exit_codes[pid] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    for (const auto& [pid, code] : exit_codes) {
        CAPTURE(pid);
        CHECK(code == 0);
    }
    return w;
}

/// What the workers wrote (every outfile must be there).
inline Report require_report(const Workers& w) {
    auto report = read_report(w.pids, w.outfiles);
    REQUIRE(report.has_value());
    return *report;
}

/// A race that ran: its scope, its workers, what they wrote.
struct Race {
    std::string scope;
    Workers workers;
    Report report;
};

/// Runs `processes` workers (`program`) on `keys` keys of a fresh scope (`scope_prefix`) over
/// `tables`, `clients` clients each, all starting `start_in` from now; reads what they wrote.
inline Race run_race(const std::string& program, const Tables& tables, const std::string& scope_prefix, int processes,
                     int keys, int clients, std::chrono::milliseconds start_in) {
    const TempDir dir(scope_prefix + "_race");
    Race race;
    race.scope = unique_name(scope_prefix);
    race.workers = run_workers(program, worker_args(tables, race.scope, keys, clients, start_in), processes, dir.path);
    race.report = require_report(race.workers);
    return race;
}

/// The checks of every race of `clients` clients per process on `keys` keys in `scope`: one effect
/// row per key, each key completed, one execution per key whose row and body agree with what its process says, every
/// replay the executed bytes, every call of the race answered, every client sees every key replay at the end. `store`,
/// when given, is where the records are (a store whose records are not rows of tables.idem, e.g. RedisStore): each key
/// "key-K" of the race is read back through it instead.
inline void check_race(PgConn& admin, const Tables& tables, const Race& race, int keys, int clients,
                       idem::IdempotencyStore* store = nullptr) {
    const std::string& scope = race.scope;
    const Workers& w = race.workers;
    const Report& report = race.report;
    const int processes = static_cast<int>(w.pids.size());
    const std::string& effects_table = tables.effects;
    CHECK(admin.scalar("SELECT count(*) FROM " + effects_table) == keys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + effects_table) == keys);
    if (store == nullptr) {
        CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1 AND state = 'completed'",
                           {scope}) == keys);
    } else {
        int completed = 0;
        for (int k = 0; k < keys; ++k) {
            const auto record = store->read(idem::Key(scope, "key-" + std::to_string(k)));
            completed += record && record->state == idem::RecordState::completed ? 1 : 0;
        }
        CHECK(completed == keys);
    }
    CHECK(report.executed_lines == keys);
    CHECK(report.executed_body.size() == static_cast<std::size_t>(keys));
    CHECK(report.executed_lines + report.replayed_lines + report.busy_lines == processes * clients * keys);
    CHECK(disagreements(report, effect_rows(admin, effects_table)) == 0);
    CHECK(report.wrong_replays() == 0);
    for (pid_t pid : w.pids) {
        CAPTURE(pid);
        const auto first = report.first_pass.find(pid);
        const auto finals = report.finals.find(pid);
        CHECK((first == report.first_pass.end() ? 0 : first->second) ==
              clients * keys);  // every call of the race answered
        CHECK((finals == report.finals.end() ? 0 : finals->second) ==
              clients * keys);  // every client saw every key replay at the end
    }
}

}  // namespace idem_test::race
