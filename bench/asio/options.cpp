// idem-asio-bench's command line (see options.hpp).
#include "options.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>

namespace bench::inflight {

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s",
                 R"(usage: idem-asio-bench [--db CONNINFO] [options]

  --requests N        requests per scenario, all on new keys (default 10000)
  --connections N     async: AsyncPostgresStore pool_size, one io_context thread (default 8)
  --threads N         blocking: threads calling idem::execute_once (default 64)
  --blocking-pool N   blocking: PostgresStore pool_size (default: = --threads)
  --effect-ms N       the effect's wait: an asio steady_timer (async) or sleep_for (blocking) (20)
  --statement-timeout-ms N  PostgresOptions::statement_timeout of both stores (default: the
                      library's, 5000); the async store's answer deadline follows from it
  --rounds N          rounds of both scenarios, order alternating (ABBA); the summary takes each
                      scenario's median throughput and the largest async peak RSS (default 1)
  --scenarios LIST    async,blocking (default both; one alone gives no ratio)
  --no-replay         skip the replay round (the same keys again: replayed, same bytes)
  --json FILE         also write the JSON object to FILE
  --keep-tables       leave the bench_asio_<pid>_* tables in place
Each scenario runs in its own child process; its peak RSS is the child's ru_maxrss (wait4).
Prints one JSON object on stdout. Exit 0: every answer right; 3: some answer wrong; 1: error.
Without --db: $IDEM_TEST_DATABASE_URL if set, else a throwaway cluster (scripts/with-postgres.sh).
)");
    std::exit(code);
}

namespace {

long long to_int(const std::string& s, const char* what, long long min) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0' || v < min) {
        std::fprintf(stderr, "%s: %s: not an integer >= %lld: '%s'\n", kName, what, min, s.c_str());
        usage(2);
    }
    return v;
}

}  // namespace

Options parse(int argc, char** argv) {
    Options o;
    std::vector<std::string> args(argv + 1, argv + argc);
    for (std::size_t i = 0; i < args.size(); ++i) {
        std::string arg = args[i];
        std::optional<std::string> inline_value;
        if (const auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
            inline_value = arg.substr(eq + 1);
            arg = arg.substr(0, eq);
        }
        const auto value = [&]() -> std::string {
            if (inline_value) return *inline_value;
            if (i + 1 >= args.size()) {
                std::fprintf(stderr, "%s: %s needs a value\n", kName, arg.c_str());
                usage(2);
            }
            return args[++i];
        };
        const auto size = [&](const char* what, long long min) {
            return static_cast<std::size_t>(to_int(value(), what, min));
        };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--requests") {
            o.requests = size("--requests", 1);
        } else if (arg == "--connections") {
            o.connections = size("--connections", 1);
        } else if (arg == "--threads") {
            o.threads = size("--threads", 1);
        } else if (arg == "--blocking-pool") {
            o.blocking_pool = size("--blocking-pool", 1);
        } else if (arg == "--effect-ms") {
            o.effect_ms = static_cast<int>(to_int(value(), "--effect-ms", 0));
        } else if (arg == "--statement-timeout-ms") {
            o.statement_timeout_ms = to_int(value(), "--statement-timeout-ms", 1);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value(), "--rounds", 1));
        } else if (arg == "--scenarios") {
            o.scenarios.clear();
            std::stringstream in(value());
            for (std::string s; std::getline(in, s, ',');) {
                if (s != "async" && s != "blocking") usage(2);
                if (std::find(o.scenarios.begin(), o.scenarios.end(), s) == o.scenarios.end()) o.scenarios.push_back(s);
            }
            if (o.scenarios.empty()) usage(2);
        } else if (arg == "--no-replay") {
            o.replay = false;
        } else if (arg == "--json") {
            o.json = value();
        } else if (arg == "--keep-tables") {
            o.keep_tables = true;
        } else if (arg == "--scenario") {
            o.scenario = value();
            if (o.scenario != "async" && o.scenario != "blocking") usage(2);
        } else if (arg == "--table") {
            o.table = value();
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "%s: unknown argument '%s'\n", kName, arg.c_str());
            usage(2);
        }
    }
    if (o.blocking_pool == 0) o.blocking_pool = o.threads;
    return o;
}

}  // namespace bench::inflight
