// A timed phase of --store redis | tiered: one side's calls on T threads for a few seconds, added
// to that side's figures (run_phase), the alternating rounds of a case's sides (run_rounds), and a
// case's figures (Run).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../common/util.hpp"
#include "options.hpp"

namespace bench::redis {

/// The counters a side reports: [0] round trips (the store's, the floor's, or the primary's),
/// [1] Redis tier hits, [2] memory tier hits, [3] tier errors + calls skipped after one.
using Counts = std::array<std::uint64_t, 4>;

struct Side {
    explicit Side(std::string n) : name(std::move(n)) {}
    std::string name;
    std::uint64_t calls = 0, unexpected = 0;
    double seconds = 0, cpu = 0;
    Counts counts{};
    Histogram hist;
    std::vector<double> round_ops;  ///< ops/s of each phase, in round order

    [[nodiscard]] double ops() const { return seconds > 0 ? static_cast<double>(calls) / seconds : 0; }
    [[nodiscard]] double per_call(std::uint64_t n) const {
        return calls ? static_cast<double>(n) / static_cast<double>(calls) : 0;
    }
    [[nodiscard]] double cpu_us() const { return calls ? cpu * 1e6 / static_cast<double>(calls) : 0; }
};

/// Thrown by an op that has run out of keys: the phase ends there (the call is not counted).
struct Exhausted {};

/// `op(thread, rng)` on `threads` threads for `seconds` after kWarmupCalls each, added to `side`;
/// `counts()` is read once all are warm and again after the last one stopped.
void run_phase(Side& side, int threads, double seconds, std::uint64_t seed, const std::function<bool(int, Rng&)>& op,
               const std::function<Counts()>& counts);

/// Alternating rounds (A B, then B A, ...) of every side, `seconds / rounds` each.
void run_rounds(const Options& o, std::vector<Side>& sides, std::uint64_t& seed,
                const std::function<void(std::size_t side, Side&)>& one_phase);

struct Run {
    int threads = 0;
    std::string kind;
    std::vector<Side> sides;  // sides[0] is what the ratios compare with

    /// The median over rounds of side i's ops/s / sides[0]'s in the same round: on a busy machine
    /// a stall of another program lands in a few phases, and this ratio does not follow them.
    [[nodiscard]] double median_round_ratio(std::size_t i) const;
};

}  // namespace bench::redis
