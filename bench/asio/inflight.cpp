// idem-asio-bench — many requests in flight on one event loop thread (issue #13), next to the
// blocking API with a thread per request in flight, in the same run.
//
//   idem-asio-bench [--db CONNINFO] [--requests 10000] [--connections 8] [--threads 64] [--json FILE]
//
// Scenarios, each in its own child process (this program re-executed with --scenario), so that the
// peak RSS of the asynchronous one is its own (wait4's ru_maxrss of that child):
//   async:    one io_context thread, AsyncPostgresStore (pool_size = --connections); N coroutines
//             started at once, each async_execute_once on its own new key with an effect that
//             awaits a steady_timer of --effect-ms and returns a small idem::Response;
//   blocking: --threads threads, PostgresStore (pool_size = --blocking-pool, default = threads), the
//             same N requests on new keys through idem::execute_once, the effect sleeping
//             --effect-ms (std::this_thread::sleep_for).
// Then (unless --no-replay) a replay round of the same N keys in each scenario: every answer
// replayed with the same bytes, no effect run. Every answer is checked (executed, the right status
// and body; the effect ran exactly once per key). Prints one JSON object on stdout (progress on
// stderr): both scenarios' figures, the throughput ratio async / blocking, the async peak RSS, and
// a verdict per target. Exit status: 0 when every answer was right, 3 when one was not, 1 on an
// error, 2 on bad usage — never because of speed (figures are reported, not asserted).
// Without --db: $IDEM_TEST_DATABASE_URL, else a throwaway cluster (scripts/with-postgres.sh).
// docs/benchmarks.md ("Requests in flight: idem::asio") holds the latest figures.
//
// This file wires the pieces together: options.hpp (the command line), child.hpp (a scenario in
// its child process: async.cpp, blocking.cpp), parent.hpp (the rounds of children and the
// summary), output.hpp (the JSON).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "child.hpp"
#include "options.hpp"
#include "parent.hpp"

#ifndef IDEM_BENCH_WITH_POSTGRES
#define IDEM_BENCH_WITH_POSTGRES ""
#endif

namespace {

using namespace bench::inflight;

// No --db and no IDEM_TEST_DATABASE_URL: run again under scripts/with-postgres.sh, which starts a
// throwaway cluster, exports IDEM_TEST_DATABASE_URL, and removes the cluster when we exit.
[[noreturn]] void reexec_under_with_postgres(int argc, char** argv) {
    const char* script = IDEM_BENCH_WITH_POSTGRES;
    if (script[0] == '\0' || ::access(script, X_OK) != 0) {
        std::fprintf(stderr, "%s: no --db given and %s is missing; pass --db CONNINFO\n", kName,
                     script[0] ? script : "scripts/with-postgres.sh");
        std::exit(2);
    }
    std::string self = self_path();
    std::vector<char*> args{const_cast<char*>(script), const_cast<char*>("--"), self.data()};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    std::fprintf(stderr, "%s: no --db: running under %s\n", kName, script);
    std::fflush(stderr);
    ::execv(script, args.data());
    std::perror("idem-asio-bench: exec with-postgres.sh");
    std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
    Options o = parse(argc, argv);
    if (!o.scenario.empty()) {
        // A child: the parent passes the conninfo in the environment.
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (o.db.empty() && env != nullptr) o.db = env;
        if (o.db.empty() || o.table.empty()) usage(2);
        return run_child(o);
    }
    if (o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') reexec_under_with_postgres(argc, argv);
        o.db = env;
    }
    ::setenv("IDEM_TEST_DATABASE_URL", o.db.c_str(), 1);  // for the children
    try {
        return run_parent(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", kName, e.what());
        return 1;
    }
}
