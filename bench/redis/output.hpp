// What --store redis | tiered prints: the table (a header, then each run as it ends) and the
// --json file.
#pragma once

#include <string>
#include <vector>

#include "options.hpp"
#include "phase.hpp"

namespace bench::redis {

/// The table's column names; `base` names the ratio's column ("/floor", "/pg").
void print_header(const char* base);
/// The table's lines for `r`: one per side.
void print_run(const Run& r);

/// Writes the runs' figures to `path` as JSON; throws when it cannot.
void write_json(const std::string& path, const Options& o, const std::vector<Run>& runs);

}  // namespace bench::redis
