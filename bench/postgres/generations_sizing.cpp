// The generations sizing check (see generations_sizing.hpp).
#include "generations_sizing.hpp"

#include <fmt/format.h>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "sides.hpp"

namespace bench {
namespace {

constexpr const char* kScope = "sizing";

struct Outcome {
    std::uint64_t calls = 0, failed = 0, no_generation = 0, purges = 0, purge_errors = 0;
    double seconds = 0, purge_p50_s = 0, purge_max_s = 0;
    int max_partitions = 0, expected_partitions = 0;
    std::string first_error;
};

Outcome run_length(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                   const idem::Fingerprint& fp, std::uint64_t seed, std::chrono::milliseconds length) {
    const std::string table = tables.add(fmt::format("{}_gs{}", prefix, length.count()), length);
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = static_cast<std::size_t>(o.retention_threads);
    options.generations = idem::PostgresOptions::Generations{length, o.generation_ahead};
    idem::PostgresStore store(o.db, options);
    store.ensure_schema();  // the generations ahead this length asks for
    options.pool_size = 1;
    idem::PostgresStore purger_store(o.db, options);
    prewarm(store, o.retention_threads);
    idem::ClaimOptions claim_options;
    claim_options.retention = std::chrono::seconds(o.retention_seconds);

    Outcome out;
    out.expected_partitions =
        static_cast<int>(o.retention_seconds * 1000 / length.count()) + static_cast<int>(o.generation_ahead) + 2;
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> calls{0}, failed{0}, no_generation{0};
    std::mutex mutex;  // first_error, purge_seconds
    std::vector<double> purge_seconds;
    const auto note = [&](const std::string& what) {
        std::lock_guard lock(mutex);
        if (out.first_error.empty()) out.first_error = what;
    };
    std::vector<std::thread> workers;
    const auto started = Clock::now();
    for (int t = 0; t < o.retention_threads; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, static_cast<std::uint64_t>(t));
            while (!stop.load(std::memory_order_relaxed)) {
                const idem::Key key(kScope, random_hex_key(rng));
                try {
                    (void)idem::execute_once(
                        store, key, fp, [] { return std::string("ok"); }, claim_options);
                } catch (const std::exception& e) {
                    ++failed;
                    if (std::string_view(e.what()).find("no generation covers now") != std::string_view::npos) {
                        ++no_generation;
                    }
                    note(e.what());
                }
                ++calls;
            }
        });
    }
    std::thread purger([&] {
        while (!stop.load()) {
            const auto t0 = Clock::now();
            try {
                (void)purger_store.purge_expired();
            } catch (const std::exception& e) {
                ++out.purge_errors;
                note(std::string("purge_expired: ") + e.what());
            }
            {
                std::lock_guard lock(mutex);
                purge_seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            }
            const auto until = Clock::now() + length / 2;
            while (!stop.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    });
    const auto end =
        started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.retention_duration));
    while (Clock::now() < end) {
        out.max_partitions = std::max(
            out.max_partitions,
            std::stoi(admin.exec("SELECT count(*) FROM pg_partition_tree($1::regclass) WHERE isleaf", {table})));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    stop = true;
    for (auto& w : workers) w.join();
    purger.join();
    out.seconds = std::chrono::duration<double>(Clock::now() - started).count();
    out.calls = calls.load();
    out.failed = failed.load();
    out.no_generation = no_generation.load();
    std::sort(purge_seconds.begin(), purge_seconds.end());
    out.purges = purge_seconds.size();
    if (!purge_seconds.empty()) {
        out.purge_p50_s = purge_seconds[purge_seconds.size() / 2];
        out.purge_max_s = purge_seconds.back();
    }
    return out;
}

}  // namespace

void generations_sizing(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                        const idem::Fingerprint& fp, std::uint64_t seed) {
    std::printf(
        "generations sizing: %d threads of new calls (retention %d s), %zu generations ahead, purge_expired back "
        "to back (half a length apart), %.0f s per length\n",
        o.retention_threads, o.retention_seconds, o.generation_ahead, o.retention_duration);
    std::printf("%9s %9s %9s %11s %7s %10s %10s %7s %9s %s\n", "length", "calls/s", "failed", "no-gen", "purges",
                "purge p50", "purge max", "parts", "expected", "keeps up");
    std::fflush(stdout);
    for (const int ms : o.generations_sizing) {
        const auto r = run_length(o, admin, tables, prefix, fp, seed, std::chrono::milliseconds(ms));
        const bool keeps_up = r.no_generation == 0 && r.max_partitions <= r.expected_partitions;
        std::printf("%7d ms %9.0f %9llu %11llu %7llu %8.3f s %8.3f s %7d %9d %s\n", ms,
                    static_cast<double>(r.calls) / r.seconds, static_cast<unsigned long long>(r.failed),
                    static_cast<unsigned long long>(r.no_generation), static_cast<unsigned long long>(r.purges),
                    r.purge_p50_s, r.purge_max_s, r.max_partitions, r.expected_partitions, keeps_up ? "yes" : "NO");
        if (!r.first_error.empty()) std::printf("          first error: %s\n", r.first_error.c_str());
        std::fflush(stdout);
    }
}

}  // namespace bench
