// idem-asio-bench's command line: the options, read from argv; --help lists them.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace bench::inflight {

/// The program's name, at the start of its messages.
inline constexpr const char* kName = "idem-asio-bench";

struct Options {
    std::string db;
    std::size_t requests = 10'000;
    std::size_t connections = 8;    ///< async: AsyncPostgresStore pool_size
    std::size_t threads = 64;       ///< blocking: threads
    std::size_t blocking_pool = 0;  ///< blocking: PostgresStore pool_size (0: = threads)
    int effect_ms = 20;
    long long statement_timeout_ms = 0;  ///< 0: PostgresOptions' default (both stores)
    int rounds = 1;
    bool replay = true;
    bool keep_tables = false;
    std::string json;
    std::vector<std::string> scenarios{"async", "blocking"};
    // Internal (the parent passes these to a child):
    std::string scenario;
    std::string table;
};

/// Prints the usage, on stdout when `code` is 0, else on stderr, and exits with `code`.
[[noreturn]] void usage(int code);

/// Reads the command line; prints the usage and exits on --help (0) or a bad argument (2).
Options parse(int argc, char** argv);

}  // namespace bench::inflight
