// The command line of idem-bench --store redis | tiered: the options, read from argv; --help lists
// them.
#pragma once

#include <idem/redis/store.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "cases.hpp"

namespace bench::redis {

struct Options {
    std::string store;  // redis | tiered
    std::vector<int> threads{1, 4, 16};
    std::vector<Case> cases = std::vector<Case>(kCases.begin(), kCases.end());
    double seconds = 6;
    int rounds = 3;
    std::int64_t preload = 100'000;
    std::string json;
    bool expect_round_trips = false;
    std::string only;  ///< run this side only (to profile it; no ratio)
    std::string socket, host = "127.0.0.1", db;
    int port = 6379;
};

/// Reads the command line; prints the usage and exits on --help (0) or a bad argument (2).
Options parse(int argc, char** argv);

/// Where RedisStore and the Redis tier connect: --redis-socket, or --redis-host and --redis-port.
idem::RedisOptions redis_options(const Options& o);

}  // namespace bench::redis
