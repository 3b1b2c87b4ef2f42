// The child: one scenario (--scenario async | blocking) run in its own process, which prints its
// figures as "name value" lines on stdout for the parent. What both scenarios share: the keys, the
// answers they expect, the figures of a round.
#pragma once

#include <idem/idem.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../common/util.hpp"
#include "options.hpp"

namespace bench::inflight {

/// The response every effect answers: status kStatus, body body_for(key).
inline std::string body_for(const idem::Key& key) { return "ok " + key.value(); }
inline constexpr int kStatus = 201;

/// Figures of one round (new keys, or the replay of them) of one scenario.
struct Round {
    std::unique_ptr<Histogram> hist = std::make_unique<Histogram>();
    double wall_s = 0;
    std::uint64_t answered = 0;  ///< calls that completed (with a result or an exception)
    std::uint64_t correct = 0;   ///< right outcome, status and body
    std::uint64_t wrong_outcome = 0;
    std::uint64_t wrong_body = 0;
    std::uint64_t errors = 0;  ///< calls that threw
    std::string first_error;
    std::uint64_t in_flight_max = 0;  ///< calls started and not yet answered, at most
    std::uint64_t effects_max = 0;    ///< effects running at once, at most

    void merge(const Round& r);
    void check(const idem::Result<idem::Response>& r, idem::Outcome want, const idem::Key& key);
    void error(const char* what);
    /// Prints the figures as "<prefix>_<name> <value>" lines on stdout (the parent reads them).
    void print(const std::string& prefix, std::size_t n) const;
};

/// Nanoseconds from `start` to now.
std::uint64_t ns_since(Clock::time_point start);

/// `n` new random keys, each starting with `tag`.
std::vector<idem::Key> make_keys(std::size_t n, const std::string& tag);

/// What every scenario prints after its rounds: the effect count per key, the process's figures.
void print_common(const std::vector<std::uint32_t>& runs_per_key, const idem::StoreStats& stats);

/// The async scenario (async.cpp): one io_context thread, every request in flight at once.
int run_async(const Options& o);
/// The blocking scenario (blocking.cpp): --threads threads through idem::execute_once.
int run_blocking(const Options& o);
/// Runs the scenario --scenario names; the process's exit code.
int run_child(const Options& o);

}  // namespace bench::inflight
