// What both scenarios share, and the child's entry (see child.hpp).
#include "child.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>

namespace bench::inflight {
namespace {

const std::string kScope = "bench-asio";

}  // namespace

void Round::merge(const Round& r) {
    hist->merge(*r.hist);
    answered += r.answered, correct += r.correct, wrong_outcome += r.wrong_outcome, wrong_body += r.wrong_body;
    errors += r.errors;
    if (first_error.empty()) first_error = r.first_error;
}

void Round::check(const idem::Result<idem::Response>& r, idem::Outcome want, const idem::Key& key) {
    if (r.outcome() != want) {
        ++wrong_outcome;
    } else if (r.response().status != kStatus || r.response().body != body_for(key)) {
        ++wrong_body;
    } else {
        ++correct;
    }
}

void Round::error(const char* what) {
    ++errors;
    if (first_error.empty()) first_error = what;
}

void Round::print(const std::string& prefix, std::size_t n) const {
    std::printf("%s_requests %zu\n", prefix.c_str(), n);
    std::printf("%s_wall_s %.6f\n", prefix.c_str(), wall_s);
    std::printf("%s_ops_per_s %.3f\n", prefix.c_str(), wall_s > 0 ? static_cast<double>(n) / wall_s : 0.0);
    std::printf("%s_p50_ms %.3f\n", prefix.c_str(), hist->percentile_us(0.5) / 1000);
    std::printf("%s_p99_ms %.3f\n", prefix.c_str(), hist->percentile_us(0.99) / 1000);
    std::printf("%s_max_ms %.3f\n", prefix.c_str(), hist->percentile_us(1.0) / 1000);
    std::printf("%s_answered %llu\n", prefix.c_str(), static_cast<unsigned long long>(answered));
    std::printf("%s_correct %llu\n", prefix.c_str(), static_cast<unsigned long long>(correct));
    std::printf("%s_wrong_outcome %llu\n", prefix.c_str(), static_cast<unsigned long long>(wrong_outcome));
    std::printf("%s_wrong_body %llu\n", prefix.c_str(), static_cast<unsigned long long>(wrong_body));
    std::printf("%s_errors %llu\n", prefix.c_str(), static_cast<unsigned long long>(errors));
    std::printf("%s_in_flight_max %llu\n", prefix.c_str(), static_cast<unsigned long long>(in_flight_max));
    std::printf("%s_effects_max %llu\n", prefix.c_str(), static_cast<unsigned long long>(effects_max));
    std::printf("%s_vmhwm_mb %.2f\n", prefix.c_str(), bench::memory_now().peak_mb);
    if (!first_error.empty()) {
        std::string one_line = first_error;
        std::replace(one_line.begin(), one_line.end(), '\n', ' ');
        std::printf("%s_first_error %s\n", prefix.c_str(), one_line.c_str());
    }
}

std::uint64_t ns_since(Clock::time_point start) {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

std::vector<idem::Key> make_keys(std::size_t n, const std::string& tag) {
    bench::Rng rng(static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                   (static_cast<std::uint64_t>(::getpid()) << 32));
    std::vector<idem::Key> keys;
    keys.reserve(n);
    for (std::size_t i = 0; i < n; ++i) keys.emplace_back(kScope, tag + bench::random_hex_key(rng));
    return keys;
}

void print_common(const std::vector<std::uint32_t>& runs_per_key, const idem::StoreStats& stats) {
    std::uint64_t total = 0, not_once = 0;
    for (const auto r : runs_per_key) total += r, not_once += r != 1;
    rusage self{};
    ::getrusage(RUSAGE_SELF, &self);
    const auto secs = [](const timeval& t) {
        return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
    };
    std::printf("effects_run %llu\n", static_cast<unsigned long long>(total));
    std::printf("keys_not_run_once %llu\n", static_cast<unsigned long long>(not_once));
    std::printf("round_trips %llu\n", static_cast<unsigned long long>(stats.round_trips));
    std::printf("retries %llu\n", static_cast<unsigned long long>(stats.retries));
    std::printf("connections_opened %llu\n", static_cast<unsigned long long>(stats.connections_opened));
    std::printf("cpu_s %.3f\n", secs(self.ru_utime) + secs(self.ru_stime));
    std::printf("vmhwm_mb %.2f\n", bench::memory_now().peak_mb);
}

int run_child(const Options& o) {
    try {
        const int rc = o.scenario == "async" ? run_async(o) : run_blocking(o);
        std::fflush(stdout);
        return rc;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s --scenario %s: %s\n", kName, o.scenario.c_str(), e.what());
        return 1;
    }
}

}  // namespace bench::inflight
