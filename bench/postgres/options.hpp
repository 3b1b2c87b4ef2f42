// idem-bench's command line (--store postgres): the options, read from argv; --help lists them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cases.hpp"

#ifndef IDEM_BENCH_PGBENCH
#define IDEM_BENCH_PGBENCH "/usr/lib/postgresql/15/bin/pgbench"
#endif

namespace bench {

struct Options {
    std::string db;
    std::vector<int> threads{1, 4, 16, 64, 64};
    /// The idem sides' pool per entry of `threads` (0: as many connections as threads): a thread
    /// per request on fewer connections, as a service usually runs (--threads 64/8, --pool N).
    std::vector<int> pools{0, 0, 0, 8, 16};
    std::vector<Case> cases = std::vector<Case>(kCases.begin(), kCases.end());
    std::vector<bool> group_commit{false, true};  ///< idem side(s): group commit off (idem), on (idem_gc)
    bool ideal = true;                            ///< run the ideal-grouping floor
    double seconds = 6;
    int rounds = 3;
    std::string json;
    std::string pgbench = IDEM_BENCH_PGBENCH;
    bool use_pgbench = true;
    std::int64_t preload = 100'000;
    std::int64_t cached_keys = 1000;  ///< replay-cached: the hot keys (the first N preloaded completed ones)
    bool checkpoint = true;
    bool keep_tables = false;
    bool expect_round_trips = false;
    std::int64_t table_size_check = 0;
    bool table_size_prewarm = false;  ///< --prewarm: the check's tables read into shared_buffers first
    bool rss_check = false;
    std::int64_t seal_check = 0;  ///< --seal-check N: the sealing check with N-byte bodies
    std::int64_t rss_calls = 1'000'000;
    int rss_threads = 4;
    bool print_scripts = false;
    /// The async points (bench/postgres/async_side.hpp): requests in flight on one io_context thread, each
    /// its own point; empty: none (always empty without the idem::asio component).
#ifdef IDEM_BENCH_ASYNC
    std::vector<int> in_flight{16, 64, 256};
#else
    std::vector<int> in_flight;
#endif
    int async_pool = 8;             ///< the AsyncPostgresStore's pool_size (PostgresOptions' default)
    std::string only;               ///< a side name: run that side only (for profiling; no ratio)
    bool store_per_thread = false;  ///< diagnostic: T stores with a pool of 1 instead of one pool of T
    /// The idem and async sides' stores key fingerprints (PostgresOptions::fingerprint_secret with
    /// kBenchFingerprintSecret): the client CPU per call with keying, against a run without it.
    bool fingerprint_secret = false;
    /// --retention-check LAYOUT (plain | generations): new calls with a short retention and a
    /// purger for a while, sampled (bench/postgres/retention.hpp); empty: not run.
    std::string retention_check;
    double retention_duration = 1200;  ///< --retention-duration S: how long the calls run
    int retention_threads = 16;        ///< --retention-threads N
    int retention_seconds = 60;        ///< --retention S: ClaimOptions::retention of every call
    double generation_seconds = 15;    ///< --generation-length S: generations' length
    double purge_every = 5;            ///< --purge-every S: purge_expired() this often
    double sample_every = 10;          ///< --sample-every S
    double steady_after = 300;         ///< --steady-after S: the WAL statistics' window begins then
    /// --generations-sizing MS,...: the lengths (ms) the sizing check runs (bench/postgres/generations_sizing.hpp).
    std::vector<int> generations_sizing;
    std::size_t generation_ahead = 4;  ///< --generation-ahead N: generations kept ready (sizing check)
};

/// The secret --fingerprint-secret gives the stores (a fixed one: only its cost is measured).
inline constexpr const char* kBenchFingerprintSecret = "idem-bench fingerprint secret, 32 bytes or more";

/// Reads the command line; prints the usage and exits on --help (0) or a bad argument (2).
Options parse(int argc, char** argv);

}  // namespace bench
