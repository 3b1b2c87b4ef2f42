// What idem-bench prints: the matrix's table (a header, then each run as it ends) and the --json file.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "checks.hpp"
#include "matrix.hpp"
#include "options.hpp"

namespace bench {

/// The table's column names.
void print_header();
/// The table's lines for `r`: one per side that ran (a note under it when something was off), then
/// pgbench's when it ran.
void print_run(const Run& r);

/// Writes every figure of this run of idem-bench to `path` as JSON; throws when it cannot.
void write_json(const std::string& path, const Options& o, const std::string& server, const std::vector<Run>& runs,
                const std::optional<TableSizeResult>& ts, const std::optional<RssResult>& rss, double rss_mb);

}  // namespace bench
