// idem-bench --store tiered: the Redis replay tier in front of PostgresStore (see stores.hpp).
#include <fmt/format.h>
#include <unistd.h>
#include <idem/postgres_store.hpp>
#include <idem/redis/replay_cache.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "../common/util.hpp"
#include "../postgres/admin.hpp"
#include "output.hpp"
#include "raw.hpp"
#include "sides.hpp"
#include "stores.hpp"

namespace bench::redis {

std::vector<Run> run_tiered(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string table = fmt::format("bench_{}_tiered", ::getpid());
    const std::string prefix = fmt::format("idem-bench-{}:", ::getpid());
    Admin admin(o.db);
    Raw raw(o);
    struct Cleanup {
        Admin& admin;
        Raw& raw;
        std::string table, prefix;
        ~Cleanup() {
            try {
                admin.drop_table(table);
                drop_prefix(raw, prefix);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "warning: clean-up: %s\n", e.what());
            }
        }
    } cleanup{admin, raw, table, prefix};
    admin.create_table(table);
    std::fprintf(stderr, "preloading %lld completed keys into %s...\n", static_cast<long long>(o.preload),
                 table.c_str());
    admin.exec("ALTER TABLE \"" + table + "\" SET (autovacuum_enabled = false)");
    admin.preload(table, Admin::Preload::completed, kReplayBase, o.preload, fp.bytes(), false);
    admin.exec("VACUUM (ANALYZE) \"" + table + "\"");

    idem::RedisReplayCacheOptions tier_options;
    tier_options.connection = idem::RedisReplayCacheOptions::cache_connection_defaults();
    const idem::RedisOptions where = redis_options(o);
    tier_options.connection.unix_socket = where.unix_socket;
    tier_options.connection.host = where.host;
    tier_options.connection.port = where.port;
    tier_options.connection.key_prefix = prefix;
    const auto keys = static_cast<std::uint64_t>(o.preload);
    const auto key_of = [](std::uint64_t i) { return idem::Key(kScope, preloaded_key(kReplayBase, i)); };

    std::vector<Run> runs;
    print_header("/pg");
    bool filled = false;
    for (const int threads : o.threads) {
        idem::PostgresOptions pg_options;
        pg_options.table = table;
        pg_options.pool_size = static_cast<std::size_t>(threads);
        idem::PostgresStore primary(o.db, pg_options);
        prewarm(primary, threads);
        tier_options.connection.pool_size = static_cast<std::size_t>(std::max(threads, 4));
        auto tier = std::make_shared<idem::RedisReplayCache>(tier_options);
        idem::CachedStore redis_only(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{tier});
        if (!filled) {
            // The Redis tier holds every key before the first case (untimed): each one's first replay,
            // through a tier on the same entries with patient timeouts (a busy machine misses 50 ms).
            std::fprintf(stderr, "filling the Redis tier with %llu keys...\n", static_cast<unsigned long long>(keys));
            idem::RedisReplayCacheOptions patient = tier_options;
            patient.connection.command_timeout = patient.connection.pool_wait = std::chrono::seconds(5);
            patient.pause_after_error = std::chrono::milliseconds(0);
            auto filler_tier = std::make_shared<idem::RedisReplayCache>(patient);
            idem::CachedStore filler(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{filler_tier});
            std::atomic<std::uint64_t> next{0};
            std::vector<std::thread> fillers;
            for (int t = 0; t < 4; ++t) {
                fillers.emplace_back([&] {
                    for (std::uint64_t i; (i = next.fetch_add(1)) < keys;) (void)filler.claim(key_of(i), fp);
                });
            }
            for (auto& f : fillers) f.join();
            if (filler_tier->stats().inserts < keys) {
                throw std::runtime_error(fmt::format("the Redis tier kept {} of {} keys ({} errors)",
                                                     filler_tier->stats().inserts, keys, filler_tier->stats().errors));
            }
            filled = true;
        }
        // memory+redis: a fresh CachedStore (empty memory tier) per phase; every call takes the next
        // key, and the phase ends early when every key has been asked once.
        std::unique_ptr<idem::CachedStore> two_tier;
        std::atomic<std::uint64_t> next_key{0};
        std::uint64_t first_key = 0;
        const auto tier_counts = [&]() {
            const auto s = tier->stats();
            const std::uint64_t memory_hits = two_tier ? two_tier->cache().stats().hits : 0;
            return Counts{primary.stats().round_trips, s.hits, memory_hits, s.errors + s.skipped};
        };
        const auto random_key = [&](Rng& rng) { return key_of(rng.below(keys)); };
        const std::function<bool(int, Rng&)> pg_op = [&](int, Rng& rng) {
            return execute(primary, random_key(rng), fp, idem::Outcome::replayed);
        };
        const std::function<bool(int, Rng&)> redis_op = [&](int, Rng& rng) {
            return execute(redis_only, random_key(rng), fp, idem::Outcome::replayed);
        };
        const std::function<bool(int, Rng&)> two_op = [&](int, Rng&) {
            const std::uint64_t n = next_key.fetch_add(1, std::memory_order_relaxed);
            if (n - first_key >= keys) throw Exhausted{};
            return execute(*two_tier, key_of(n % keys), fp, idem::Outcome::replayed);
        };
        Run run{threads, "replay", {Side{"postgres"}, Side{"redis"}, Side{"memory+redis"}}};
        run_rounds(o, run.sides, seed, [&](std::size_t i, Side& side) {
            const double s = o.seconds / o.rounds;
            if (i == 0) {
                run_phase(side, threads, s, seed, pg_op, tier_counts);
            } else if (i == 1) {
                run_phase(side, threads, s, seed, redis_op, tier_counts);
            } else {
                two_tier = std::make_unique<idem::CachedStore>(
                    primary,
                    std::vector<std::shared_ptr<idem::ReplayTier>>{std::make_shared<idem::ReplayCache>(), tier});
                first_key = seed % keys;
                next_key.store(first_key);
                run_phase(side, threads, s, seed, two_op, tier_counts);
                two_tier.reset();
            }
        });
        print_run(run);
        runs.push_back(std::move(run));
    }
    return runs;
}

bool check_tiered(const std::vector<Run>& runs) {
    bool ok = true;
    for (const Run& r : runs) {
        for (const Side& s : r.sides) {
            const bool pg = s.name == "postgres";
            // A tier's timeout is a miss answered by the primary: allowed (and reported), not failed.
            const bool good =
                s.calls > 0 && s.unexpected == 0 && (pg ? s.counts[0] == s.calls : s.counts[0] == 0 || s.counts[3] > 0);
            if (!good) {
                std::fprintf(stderr,
                             "FAIL: replay at %d threads, %s: %llu primary round trips for %llu calls (want %s), "
                             "%llu unexpected outcomes\n",
                             r.threads, s.name.c_str(), static_cast<unsigned long long>(s.counts[0]),
                             static_cast<unsigned long long>(s.calls), pg ? "1 per call" : "0",
                             static_cast<unsigned long long>(s.unexpected));
                ok = false;
            }
        }
    }
    return ok;
}

}  // namespace bench::redis
