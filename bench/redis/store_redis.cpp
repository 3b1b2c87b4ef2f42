// idem-bench --store redis: RedisStore vs the raw-hiredis floor (see stores.hpp).
#include <fmt/format.h>
#include <unistd.h>
#include <idem/redis/store.hpp>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "../common/util.hpp"
#include "output.hpp"
#include "raw.hpp"
#include "sides.hpp"
#include "stores.hpp"

namespace bench::redis {

std::vector<Run> run_redis(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string prefix = fmt::format("idem-bench-{}:", ::getpid());
    const Names lib_names{prefix + "lib:"}, floor_names{prefix + "floor:"};
    const std::string fp_alg = std::to_string(static_cast<int>(fp.algorithm()));
    const std::string fp_bytes(fp.bytes());
    Raw admin(o);
    struct Cleanup {
        Raw& raw;
        std::string prefix;
        ~Cleanup() {
            try {
                drop_prefix(raw, prefix);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "warning: could not delete %s*: %s\n", prefix.c_str(), e.what());
            }
        }
    } cleanup{admin, prefix};
    std::fprintf(stderr, "preloading %lld completed + %lld in-progress keys per side...\n",
                 static_cast<long long>(o.preload), static_cast<long long>(o.preload));
    for (const Names* names : {&lib_names, &floor_names}) {
        preload(admin, *names, true, kReplayBase, o.preload, fp_alg, fp_bytes);
        preload(admin, *names, false, kConflictBase, o.preload, fp_alg, fp_bytes);
    }
    std::vector<Run> runs;
    print_header("/floor");
    for (const int threads : o.threads) {
        idem::RedisOptions options = redis_options(o);
        options.key_prefix = lib_names.prefix;
        options.pool_size = static_cast<std::size_t>(threads);
        idem::RedisStore store(options);
        prewarm(store, threads);
        std::vector<std::unique_ptr<Floor>> floors;
        for (int t = 0; t < threads; ++t) floors.push_back(std::make_unique<Floor>(o, floor_names, fp_alg, fp_bytes));
        const auto floor_counts = [&floors] {
            Counts c{};
            for (const auto& f : floors) c[0] += f->round_trips();
            return c;
        };
        const auto store_counts = [&store] { return Counts{store.stats().round_trips, 0, 0, 0}; };
        for (const Case kind : o.cases) {
            const auto pick = [&](Rng& rng) {
                if (kind == Case::fresh) return random_hex_key(rng);
                return preloaded_key(kind == Case::replay ? kReplayBase : kConflictBase,
                                     rng.below(static_cast<std::uint64_t>(o.preload)));
            };
            const std::function<bool(int, Rng&)> floor_op = [&](int t, Rng& rng) {
                Floor& f = *floors[static_cast<std::size_t>(t)];
                const std::string key = pick(rng);
                const std::int64_t fence = random_fence(rng);
                const Floor::Answer a = f.claim(key, fence);
                switch (kind) {
                    case Case::fresh: return a.tag == "claimed" && f.save(key, fence);
                    case Case::replay: return a.tag == "found" && a.state == "c" && a.result == kResult;
                    case Case::conflict: return a.tag == "found" && a.state == "p";
                }
                return false;
            };
            const idem::Outcome want = kind == Case::fresh    ? idem::Outcome::executed
                                       : kind == Case::replay ? idem::Outcome::replayed
                                                              : idem::Outcome::in_progress;
            const std::function<bool(int, Rng&)> lib_op = [&](int, Rng& rng) {
                return execute(store, idem::Key(kScope, pick(rng)), fp, want);
            };
            Run run{threads, case_name(kind), {Side{"floor"}, Side{"idem"}}};
            run_rounds(o, run.sides, seed, [&](std::size_t i, Side& side) {
                if (i == 0) {
                    run_phase(side, threads, o.seconds / o.rounds, seed, floor_op, floor_counts);
                } else {
                    run_phase(side, threads, o.seconds / o.rounds, seed, lib_op, store_counts);
                }
            });
            print_run(run);
            runs.push_back(std::move(run));
        }
    }
    return runs;
}

bool check_redis(const std::vector<Run>& runs) {
    bool ok = true;
    for (const Run& r : runs) {
        const std::uint64_t want = r.kind == "new" ? 2 : 1;
        for (const Side& s : r.sides) {
            if (s.calls == 0 || s.unexpected != 0 || s.counts[0] != want * s.calls) {
                std::fprintf(stderr,
                             "FAIL: %s at %d threads, %s: %llu round trips for %llu calls (want %llu per call), "
                             "%llu unexpected outcomes\n",
                             r.kind.c_str(), r.threads, s.name.c_str(), static_cast<unsigned long long>(s.counts[0]),
                             static_cast<unsigned long long>(s.calls), static_cast<unsigned long long>(want),
                             static_cast<unsigned long long>(s.unexpected));
                ok = false;
            }
        }
    }
    return ok;
}

}  // namespace bench::redis
