// Phases and rounds (see phase.hpp).
#include "phase.hpp"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <ctime>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace bench::redis {
namespace {

double cpu_seconds() {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

}  // namespace

void run_phase(Side& side, int threads, double seconds, std::uint64_t seed, const std::function<bool(int, Rng&)>& op,
               const std::function<Counts()>& counts) {
    const auto n = static_cast<std::size_t>(threads);
    auto hists = std::make_unique<Histogram[]>(n);
    std::vector<std::uint64_t> done(n, 0), bad(n, 0);
    std::atomic<bool> stop{false};
    std::mutex m;
    std::string error;
    Counts before{};
    Clock::time_point start;
    double cpu0 = 0;
    std::barrier ready(threads + 1, [&]() noexcept {
        before = counts();
        cpu0 = cpu_seconds();
        start = Clock::now();
    });
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, t);
            const int id = static_cast<int>(t);
            const auto failed = [&](const std::exception& e) {
                std::lock_guard lock(m);
                if (error.empty()) error = e.what();
                stop.store(true);
            };
            bool warm = true;
            try {
                for (int i = 0; i < kWarmupCalls; ++i) (void)op(id, rng);
            } catch (const std::exception& e) {
                failed(e);
                warm = false;
            }
            ready.arrive_and_wait();
            if (!warm) return;
            try {
                while (!stop.load(std::memory_order_relaxed)) {
                    const auto t0 = Clock::now();
                    const bool good = op(id, rng);
                    hists[t].record(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count()));
                    ++done[t];
                    if (!good) ++bad[t];
                }
            } catch (const Exhausted&) {
                stop.store(true);
            } catch (const std::exception& e) {
                failed(e);
            }
        });
    }
    ready.arrive_and_wait();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (!stop.load() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stop.store(true);
    for (auto& w : workers) w.join();
    const auto end = Clock::now();
    side.cpu += cpu_seconds() - cpu0;
    if (!error.empty()) throw std::runtime_error(error);
    const Counts after = counts();
    const double took = seconds_between(start, end);
    side.seconds += took;
    for (std::size_t i = 0; i < 4; ++i) side.counts[i] += after[i] - before[i];
    std::uint64_t calls = 0;
    for (std::size_t t = 0; t < n; ++t) {
        calls += done[t];
        side.unexpected += bad[t];
        side.hist.merge(hists[t]);
    }
    side.calls += calls;
    side.round_ops.push_back(took > 0 ? static_cast<double>(calls) / took : 0);
}

void run_rounds(const Options& o, std::vector<Side>& sides, std::uint64_t& seed,
                const std::function<void(std::size_t side, Side&)>& one_phase) {
    for (int round = 0; round < o.rounds; ++round) {
        for (std::size_t step = 0; step < sides.size(); ++step) {
            const std::size_t i = round % 2 == 0 ? step : sides.size() - 1 - step;
            seed += 0x632BE59BD9B4E019ull;
            if (o.only.empty() || o.only == sides[i].name) one_phase(i, sides[i]);
        }
    }
}

double Run::median_round_ratio(std::size_t i) const {
    std::vector<double> r;
    const auto& a = sides[i].round_ops;
    const auto& b = sides[0].round_ops;
    for (std::size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
        if (b[k] > 0) r.push_back(a[k] / b[k]);
    }
    if (r.empty()) return NAN;
    std::sort(r.begin(), r.end());
    const std::size_t m = r.size() / 2;
    return r.size() % 2 ? r[m] : (r[m - 1] + r[m]) / 2;
}

}  // namespace bench::redis
