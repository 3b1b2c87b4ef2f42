// The parent: runs each scenario in a child process (this program again, with --scenario), reads
// its figures and peak RSS, and prints the summary as JSON, with a verdict per target.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <string>

#include "options.hpp"

namespace bench::inflight {

/// This program's path (/proc/self/exe): what the children and the re-execution run.
std::string self_path();

/// A child's figures ("key value" lines) and the parent's view of it.
struct ScenarioRun {
    std::string scenario;
    std::map<std::string, std::string> figures;
    int exit_code = -1;
    double peak_rss_mb = 0;  ///< the child's ru_maxrss (wait4)

    [[nodiscard]] double num(const std::string& key) const {
        const auto it = figures.find(key);
        return it == figures.end() ? NAN : std::strtod(it->second.c_str(), nullptr);
    }
    [[nodiscard]] std::string str(const std::string& key) const {
        const auto it = figures.find(key);
        return it == figures.end() ? std::string() : it->second;
    }
    /// Every answer right, in every round this child ran.
    [[nodiscard]] bool correct(std::size_t n, bool replay) const {
        if (exit_code != 0) return false;
        const auto round_ok = [&](const std::string& p) {
            return num(p + "_correct") == static_cast<double>(n) && num(p + "_answered") == static_cast<double>(n);
        };
        return round_ok("new") && (!replay || round_ok("replay")) && num("effects_run") == static_cast<double>(n) &&
               num("keys_not_run_once") == 0;
    }
};

/// Runs every round of the scenarios and prints the summary; the process's exit code.
int run_parent(const Options& o);

}  // namespace bench::inflight
