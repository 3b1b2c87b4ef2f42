// Small helpers of idem-bench: a fixed-size latency histogram, a fast PRNG, the keys every case
// uses, and the process's memory figures. Nothing here allocates per call, so the benchmark itself
// adds no per-key state to the RSS it measures.
#pragma once

#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <sys/resource.h>

namespace bench {

using Clock = std::chrono::steady_clock;

/// Log-linear histogram of nanosecond values: 128 sub-buckets per power of two (relative error
/// below 0.8 %), fixed size (59 KB), so recording never allocates.
class Histogram {
public:
    void record(std::uint64_t ns) noexcept {
        ++counts_[index(ns)];
        ++total_;
    }
    void merge(const Histogram& other) noexcept {
        for (std::size_t i = 0; i < kBuckets; ++i) counts_[i] += other.counts_[i];
        total_ += other.total_;
    }
    [[nodiscard]] std::uint64_t count() const noexcept { return total_; }

    /// The p-quantile (0 < p <= 1) in microseconds; 0 when empty.
    [[nodiscard]] double percentile_us(double p) const noexcept {
        if (total_ == 0) return 0;
        auto target = static_cast<std::uint64_t>(p * static_cast<double>(total_) + 0.999999);
        if (target == 0) target = 1;
        std::uint64_t seen = 0;
        for (std::size_t i = 0; i < kBuckets; ++i) {
            seen += counts_[i];
            if (seen >= target) {
                const double mid = (static_cast<double>(lower(i)) + static_cast<double>(lower(i + 1))) / 2;
                return mid / 1000.0;
            }
        }
        return static_cast<double>(lower(kBuckets - 1)) / 1000.0;
    }

private:
    static constexpr unsigned kSubBits = 7;
    static constexpr std::uint64_t kSub = std::uint64_t{1} << kSubBits;
    static constexpr std::size_t kBuckets = kSub + (64 - kSubBits) * kSub;

    static std::size_t index(std::uint64_t v) noexcept {
        if (v < kSub) return static_cast<std::size_t>(v);
        const auto msb = static_cast<unsigned>(63 - std::countl_zero(v));
        const unsigned shift = msb - kSubBits;
        return static_cast<std::size_t>(kSub + shift * kSub + ((v >> shift) - kSub));
    }
    static std::uint64_t lower(std::size_t i) noexcept {
        if (i < kSub) return i;
        const std::uint64_t shift = (i - kSub) / kSub;
        const std::uint64_t sub = (i - kSub) % kSub;
        return (kSub + sub) << shift;
    }

    std::array<std::uint64_t, kBuckets> counts_{};
    std::uint64_t total_ = 0;
};

/// splitmix64: fast, good enough to spread keys and fences.
class Rng {
public:
    explicit Rng(std::uint64_t seed) noexcept : state_(seed) {}
    std::uint64_t next() noexcept {
        std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    /// An independent stream for worker `index` of a phase seeded `seed`: the state is a hash of
    /// both, so two workers' sequences never overlap in practice (seed + index would: splitmix64
    /// steps its state by a constant, so it would just be the same sequence shifted).
    static Rng stream(std::uint64_t seed, std::uint64_t index) noexcept {
        Rng a(seed);
        Rng b(a.next() ^ (index * 0xD1B54A32D192ED03ull));
        return Rng(b.next());
    }
    /// Uniform in [0, n) (n > 0; the modulo bias is irrelevant here).
    std::uint64_t below(std::uint64_t n) noexcept { return next() % n; }

private:
    std::uint64_t state_;
};

/// A fresh key like a client's UUID: 32 random hex digits (so new keys land all over the index,
/// like md5(i::text) of the preloaded rows in the table-size check).
inline std::string random_hex_key(Rng& rng) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s(32, '0');
    std::uint64_t a = rng.next();
    std::uint64_t b = rng.next();
    for (std::size_t i = 0; i < 16; ++i, a >>= 4, b >>= 4) {
        s[i] = digits[a & 0xF];
        s[i + 16] = digits[b & 0xF];
    }
    return s;
}

/// Preloaded keys are decimal numbers: completed ones from kReplayBase, in-progress ones from
/// kConflictBase (pgbench scripts can name them with a plain integer variable).
inline constexpr std::int64_t kReplayBase = 1'000'000'000;
inline constexpr std::int64_t kConflictBase = 2'000'000'000;

inline std::string preloaded_key(std::int64_t base, std::uint64_t i) {
    return std::to_string(base + static_cast<std::int64_t>(i));
}

/// A positive, non-zero 63-bit fence.
inline std::int64_t random_fence(Rng& rng) noexcept {
    const std::uint64_t v = rng.next() & 0x7FFFFFFFFFFFFFFFull;
    return static_cast<std::int64_t>(v == 0 ? 1 : v);
}

struct Memory {
    double rss_mb = 0;   ///< VmRSS
    double peak_mb = 0;  ///< VmHWM
};

/// Reads VmRSS and VmHWM from /proc/self/status (zeros elsewhere).
Memory memory_now();

/// A child process run to its end: its wait status, what it wrote, and its resource usage.
struct ChildRun {
    int status = 0;      ///< as from waitpid (WIFEXITED...); -1 when it could not be started
    std::string output;  ///< its stdout (and stderr with merge_stderr)
    rusage usage{};      ///< the child's own (ru_maxrss: its peak RSS, in kB)
};

/// Runs argv[0] with argv (no shell), reading its stdout — and its stderr too with merge_stderr;
/// otherwise the child's stderr is ours. Flushes our stdio first.
ChildRun run_child(const std::vector<std::string>& argv, bool merge_stderr);

/// "a,b,,c" → {"a", "b", "c"}: a comma-separated option value, empty parts dropped.
std::vector<std::string> split(const std::string& s);

/// Walks a command line: for (Args args(argc, argv, usage); args.next();) { args.name() ... }.
/// "--name=value" and "--name value" both give name() "--name" and value() "value".
class Args {
public:
    /// `usage(2)` is called when an option's value is missing.
    Args(int argc, char** argv, void (*usage)(int)) : args_(argv + 1, argv + argc), usage_(usage) {}
    /// Moves to the next argument; false after the last.
    bool next();
    [[nodiscard]] const std::string& name() const noexcept { return name_; }
    /// The current option's value (after '=', else the next argument, which it consumes).
    std::string value();

private:
    std::vector<std::string> args_;
    void (*usage_)(int);
    std::size_t i_ = 0;
    bool started_ = false;
    std::string name_;
    std::optional<std::string> inline_value_;
};

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

}  // namespace bench
