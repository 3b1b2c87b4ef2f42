// idem-asio-bench's JSON: a number, a string, a scenario's figures.
#pragma once

#include <string>

#include "options.hpp"
#include "parent.hpp"

namespace bench::inflight {

/// `v` with 6 significant digits; null when it is not finite.
std::string json_number(double v);
/// `s` quoted and escaped.
std::string json_string(const std::string& s);
/// A scenario's figures, as the summary's "runs" list them.
std::string json_scenario(const ScenarioRun& r, const Options& o);

}  // namespace bench::inflight
