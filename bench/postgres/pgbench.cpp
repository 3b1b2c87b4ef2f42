#include "pgbench.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "../common/util.hpp"
#include "floor.hpp"

namespace bench {
namespace {

// Replaces $1..$9 in `sql` with pgbench variables (:name).
std::string with_variables(const std::string& sql, const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < sql.size(); ++i) {
        if (sql[i] == '$' && i + 1 < sql.size() && std::isdigit(static_cast<unsigned char>(sql[i + 1]))) {
            const auto n = static_cast<std::size_t>(sql[i + 1] - '0');
            out += ":" + names.at(n - 1);
            ++i;
        } else {
            out += sql[i];
        }
    }
    return out;
}

// Runs argv, returns (exit status, stdout+stderr).
std::pair<int, std::string> capture(const std::vector<std::string>& argv) {
    ChildRun run = run_child(argv, true);
    if (run.status < 0) return {-1, run.output};
    return {WIFEXITED(run.status) ? WEXITSTATUS(run.status) : 128, std::move(run.output)};
}

}  // namespace

std::string pgbench_script(const PgbenchRun& run) {
    const FloorSql sql = floor_sql(quote_ident(run.table));
    const std::string claim = with_variables(sql.claim, {"scope", "k", "fp", "alg", "fence", "lease", "retention"});
    const std::string select = with_variables(sql.select, {"scope", "k"});
    const std::string save = with_variables(sql.save, {"scope", "k", "fence", "result"});
    std::string s;
    if (run.kind == "new") {
        s += "\\set k random(1000000000000000, 9000000000000000000)\n";
    } else {
        const std::int64_t base = run.kind == "replay" ? kReplayBase : kConflictBase;
        s += "\\set k random(" + std::to_string(base) + ", " + std::to_string(base + run.preloaded - 1) + ")\n";
    }
    s += "\\set fence random(1, 9000000000000000000)\n";
    s += "\\startpipeline\n" + claim + ";\n" + select + ";\n\\endpipeline\n";
    if (run.kind == "new") s += save + ";\n";
    return s;
}

std::optional<double> run_pgbench(const PgbenchRun& run) {
    char path[] = "/tmp/idem-bench-pgbench-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) return std::nullopt;
    const std::string script = pgbench_script(run);
    const bool written = ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
    ::close(fd);
    std::optional<double> tps;
    if (written) {
        const std::string clients = std::to_string(run.clients);
        auto [status, out] = capture({run.pgbench, "-n",
                                      "-M",        "prepared",
                                      "-f",        path,
                                      "-c",        clients,
                                      "-j",        clients,
                                      "-T",        std::to_string(run.seconds),
                                      "-D",        "scope=bench",
                                      "-D",        "fp=\\x" + run.fp_hex,
                                      "-D",        "alg=1",
                                      "-D",        "lease=30000",
                                      "-D",        "retention=86400",
                                      "-D",        "result=ok",
                                      run.conninfo});
        const auto at = out.find("tps = ");
        if (status == 0 && at != std::string::npos) {
            tps = std::strtod(out.c_str() + at + 6, nullptr);
        } else {
            std::fprintf(stderr, "warning: pgbench (%s, %d clients) failed with status %d:\n%s\n", run.kind.c_str(),
                         run.clients, status, out.substr(out.size() > 2000 ? out.size() - 2000 : 0).c_str());
        }
    }
    ::unlink(path);
    return tps;
}

}  // namespace bench
