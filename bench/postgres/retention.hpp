// --retention-check LAYOUT: retention under load. New calls (execute_once, new keys, a small
// result) on --retention-threads threads with a short ClaimOptions::retention, and a purger calling
// purge_expired() every --purge-every seconds, for --retention-duration seconds, on one table of
// LAYOUT: plain (purge_expired deletes expired rows in batches) or generations (it drops whole
// generations). Every --sample-every seconds it prints and records the table's size (every
// partition, indexes included), WAL bytes per call, calls/s, p50/p99 and rows purged in the
// window; at the end, pg_waldump --stats=record over the steady-state window (from
// --steady-after to the end; a temporary replication slot keeps that WAL), and then 45 s of
// purges alone, each bracketed by the WAL position. bench/retention.sh runs both layouts at once,
// each on its own throwaway cluster; bench/retention_plot.py draws and attributes
// (docs/benchmarks.md, "Retention under load").
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>

#include "admin.hpp"
#include "options.hpp"

namespace bench {

/// Runs it, prints the samples as they come and writes every figure to --json (when given).
void retention_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                     const idem::Fingerprint& fp, std::uint64_t seed);

}  // namespace bench
