// The throughput matrix (see matrix.hpp): tables, stores and clients per thread count, then for
// each case the sides' phases in alternating rounds, and pgbench after them; then the async points
// (--in-flight, with IDEM_BENCH_ASYNC): floor, ideal and async in alternating rounds per case.
#include "matrix.hpp"

#include <unistd.h>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string_view>
#include <utility>

#include "floor.hpp"
#include "output.hpp"
#ifdef IDEM_BENCH_ASYNC
#include "async_side.hpp"
#endif
#include "pgbench.hpp"
#include "sides.hpp"

namespace bench {
namespace {

// The async points' floor runs on min(N, kAsyncFloorThreads) threads: a thread (and a connection)
// per request up to 16, the largest plain thread count of the default matrix; so the point at 64 in
// flight measures, in its own rounds, the floor's p99 at 16 threads that its target compares with.
[[maybe_unused]] constexpr int kAsyncFloorThreads = 16;

std::string hex(std::string_view bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    for (const char ch : bytes) {
        const auto b = static_cast<unsigned char>(ch);
        s += digits[b >> 4];
        s += digits[b & 0xF];
    }
    return s;
}

// The library side of one group-commit setting at one thread count: its store(s), and a CachedStore
// in front of each for replay-cached.
struct LibrarySide {
    SideKind kind;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores;
    std::vector<std::unique_ptr<idem::CachedStore>> cached;

    [[nodiscard]] std::vector<idem::IdempotencyStore*> for_case(Case c) const {
        std::vector<idem::IdempotencyStore*> out;
        if (c == Case::replay_cached) {
            for (const auto& s : cached) out.push_back(s.get());
        } else {
            for (const auto& s : stores) out.push_back(s.get());
        }
        return out;
    }
    [[nodiscard]] Counters counters() const {
        Counters c;
        for (const auto& st : stores) {
            const Counters one = library_counters(*st);
            c.round_trips += one.round_trips;
            c.retries += one.retries;
            c.opened += one.opened;
            c.claim_groups += one.claim_groups;
            c.grouped_claims += one.grouped_claims;
            c.largest_claim_group = std::max(c.largest_claim_group, one.largest_claim_group);
            c.save_groups += one.save_groups;
            c.grouped_saves += one.grouped_saves;
            c.largest_save_group = std::max(c.largest_save_group, one.largest_save_group);
        }
        return c;
    }
};

// run.sides: the sides of `order` (only --only's, when given).
void add_sides(Run& run, std::vector<SideKind> order, const Options& o) {
    if (!o.only.empty()) std::erase_if(order, [&](SideKind k) { return o.only != side_name(k); });
    for (const SideKind k : order) {
        run.sides.emplace_back();
        run.sides.back().kind = k;
    }
}

// Measures every side of `run` in o.rounds rounds, ABC… then …CBA: alternating the order cancels a
// linear drift (ABBA for two sides). `phase(kind, seconds, seed)` runs one phase of one side.
template <class Phase>
void alternate(const Options& o, Admin& admin, bool walinspect, std::uint64_t& seed, Run& run, Phase phase) {
    const double per_round = o.seconds / o.rounds;
    for (int round = 0; round < o.rounds; ++round) {
        for (std::size_t step = 0; step < run.sides.size(); ++step) {
            const std::size_t i = round % 2 == 0 ? step : run.sides.size() - 1 - step;
            Side& side = run.sides[i];
            if (o.checkpoint) admin.checkpoint();
            seed += 0x632BE59BD9B4E019ull;
            const PhaseResult r = phase(side.kind, per_round, seed);
            side.add(r);
            side.wal_bytes += r.lsn_to - r.lsn_from;
            if (walinspect) side.commits = side.commits.value_or(0) + admin.commit_records(r.lsn_from, r.lsn_to);
        }
    }
}

// The ideal side: one connection; each op is a round of op.group calls.
template <class Snapshot>
PhaseResult ideal_phase(Admin& admin, double seconds, std::uint64_t seed, IdealOp& op, Snapshot snapshot) {
    PhaseResult r = run_phase(admin, 1, seconds, seed, op, snapshot);
    r.calls *= op.group;
    r.unexpected *= op.group;
    return r;
}

}  // namespace

std::vector<Run> run_matrix(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                            const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string fp_bytes(fp.bytes());
    const std::string lib_table = tables.add(prefix + "_lib");
    const std::string floor_table = tables.add(prefix + "_floor");
    const std::string ideal_table = o.ideal ? tables.add(prefix + "_ideal") : std::string();
    const std::string ideal_threads_table = o.ideal ? tables.add(prefix + "_ideal_threads") : std::string();
    const bool pgbench = o.use_pgbench && ::access(o.pgbench.c_str(), X_OK) == 0;
    const std::string pgb_table = pgbench ? tables.add(prefix + "_pgb") : std::string();
    const std::string async_table = o.in_flight.empty() ? std::string() : tables.add(prefix + "_async");
    if (o.use_pgbench && !pgbench) std::fprintf(stderr, "note: %s not found; no pgbench column\n", o.pgbench.c_str());
    const bool walinspect = admin.enable_walinspect();

    // The idem side(s): group commit off (idem) and on (idem_gc).
    std::vector<std::pair<SideKind, bool>> lib_sides;
    for (const bool gc : o.group_commit) lib_sides.emplace_back(gc ? SideKind::idem_gc : SideKind::idem, gc);

    std::fprintf(stderr, "preloading %lld completed + %lld in-progress keys per table...\n",
                 static_cast<long long>(o.preload), static_cast<long long>(o.preload));
    // No autovacuum on the benchmark's tables: a background VACUUM or ANALYZE of one side's table
    // (the `new` rounds add tens of thousands of rows, past autovacuum's thresholds) lands in
    // whichever rounds happen to run then, on one side only. Instead every table is vacuumed and
    // analyzed, untimed, before every case (vacuum_all below).
    const std::string all_tables[] = {lib_table, floor_table, ideal_table, ideal_threads_table, pgb_table, async_table};
    for (const std::string& t : all_tables) {
        if (t.empty()) continue;
        admin.exec("ALTER TABLE " + quote_ident(t) + " SET (autovacuum_enabled = false)");
        admin.preload(t, Admin::Preload::completed, kReplayBase, o.preload, fp_bytes, false);
        admin.preload(t, Admin::Preload::in_progress, kConflictBase, o.preload, fp_bytes, false);
        admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
    }
    const auto vacuum_all = [&] {
        for (const std::string& t : all_tables) {
            if (!t.empty()) admin.exec("VACUUM (ANALYZE) " + quote_ident(t));
        }
    };

    std::vector<Run> runs;
    print_header();
    for (std::size_t load = 0; load < o.threads.size(); ++load) {
        const int threads = o.threads[load];
        const int pool = o.pools[load] > 0 ? o.pools[load] : threads;
        // Each idem side: normally one store, pool size = threads (or the entry's own pool, T/P).
        // --store-per-thread (a diagnostic): one store with a pool of 1 per thread, so each thread
        // keeps its own connection, like the floor.
        std::vector<LibrarySide> libs;
        for (const auto& [kind, gc] : lib_sides) {
            idem::PostgresOptions options;
            options.table = lib_table;
            options.pool_size = o.store_per_thread ? 1 : static_cast<std::size_t>(pool);
            options.application_name = std::string("idem-bench-") + side_name(kind);
            options.group_commit = gc;
            if (o.fingerprint_secret) options.fingerprint_secret = idem::FingerprintSecret(kBenchFingerprintSecret);
            LibrarySide side{kind, {}, {}};
            for (int i = 0; i < (o.store_per_thread ? threads : 1); ++i) {
                side.stores.push_back(std::make_unique<idem::PostgresStore>(o.db, options));
                prewarm(*side.stores.back(), static_cast<int>(options.pool_size));
                side.cached.push_back(std::make_unique<idem::CachedStore>(*side.stores.back()));
            }
            libs.push_back(std::move(side));
        }
        std::vector<std::unique_ptr<FloorClient>> clients;
        for (int t = 0; t < threads; ++t) clients.push_back(std::make_unique<FloorClient>(o.db, floor_table));
        std::unique_ptr<IdealClient> ideal, ideal_threads;
        if (o.ideal) {
            ideal = std::make_unique<IdealClient>(o.db, ideal_table);
            ideal_threads = std::make_unique<IdealClient>(o.db, ideal_threads_table);
        }
        const auto floor_counters = [&clients]() noexcept {
            Counters c;
            for (const auto& client : clients) c.round_trips += client->round_trips();
            return c;
        };
        const auto counters_of = [](const std::unique_ptr<IdealClient>& client) {
            return [&client]() noexcept {
                Counters c;
                c.round_trips = client ? client->round_trips() : 0;
                return c;
            };
        };
        const auto ideal_counters = counters_of(ideal);
        const auto ideal_threads_counters = counters_of(ideal_threads);
        std::vector<std::string> ideal_keys;
        std::vector<std::int64_t> ideal_fences;

        for (const Case kind : o.cases) {
            Run run;
            run.threads = threads;
            run.pool = o.store_per_thread ? threads : pool;
            run.floor_threads = threads;
            run.kind = kind;
            std::vector<SideKind> order{SideKind::floor};
            if (ideal) {
                order.push_back(SideKind::ideal);
                order.push_back(SideKind::ideal_threads);
            }
            for (const auto& lib : libs) order.push_back(lib.kind);
            add_sides(run, order, o);
            // replay-cached: every side replays the same hot keys; the caches hold them before timing.
            const std::int64_t keys = kind == Case::replay_cached ? std::min(o.cached_keys, o.preload) : o.preload;
            if (kind == Case::replay_cached) {
                for (const LibrarySide& lib : libs) {
                    for (const auto& cached : lib.cached) {
                        for (std::int64_t i = 0; i < keys; ++i) {
                            (void)cached->claim(
                                idem::Key(kScope, preloaded_key(kReplayBase, static_cast<std::uint64_t>(i))), fp);
                        }
                    }
                }
            }
            FloorOp floor_op{clients, fp_bytes, kind, keys};
            IdealOp ideal_op{ideal.get(), fp_bytes,    kind, keys, static_cast<std::size_t>(threads),
                             ideal_keys,  ideal_fences};
            vacuum_all();
            alternate(o, admin, walinspect, seed, run, [&](SideKind k, double per_round, std::uint64_t phase_seed) {
                if (k == SideKind::floor)
                    return run_phase(admin, threads, per_round, phase_seed, floor_op, floor_counters);
                if (k == SideKind::ideal) return ideal_phase(admin, per_round, phase_seed, ideal_op, ideal_counters);
                if (k == SideKind::ideal_threads) {
                    IdealGather gather(ideal_threads.get(), static_cast<std::size_t>(threads));
                    IdealThreadsOp op{gather, fp_bytes, kind, keys};
                    return run_phase(admin, threads, per_round, phase_seed, op, ideal_threads_counters);
                }
                const LibrarySide& lib =
                    *std::find_if(libs.begin(), libs.end(), [&](const LibrarySide& l) { return l.kind == k; });
                LibraryOp lib_op{lib.for_case(kind), fp, kind, keys};
                return run_phase(admin, threads, per_round, phase_seed, lib_op,
                                 [&lib]() noexcept { return lib.counters(); });
            });
            runs.push_back(std::move(run));
        }
        // pgbench (informational) after every case of this thread count, not between them: the
        // rounds of a case never follow another program's load (with pgbench between the cases,
        // replay/conflict ratios at 16 threads came out ~0.1 lower than without).
        for (std::size_t i = runs.size() - o.cases.size(); i < runs.size(); ++i) {
            Run& run = runs[i];
            if (pgbench && run.kind != Case::replay_cached) {
                if (o.checkpoint) admin.checkpoint();
                run.pgbench_tps = run_pgbench(PgbenchRun{o.pgbench, o.db, pgb_table, case_name(run.kind), threads,
                                                         std::max(1, static_cast<int>(std::lround(o.seconds / 2))),
                                                         o.preload, hex(fp_bytes)});
            }
            print_run(run);
        }
    }
#ifdef IDEM_BENCH_ASYNC
    // The async points: for each N in flight, every case but replay-cached, with the floor at
    // min(N, kAsyncFloorThreads) threads and ideal in rounds of N in the same alternating rounds.
    if (!o.in_flight.empty()) {
        std::printf(
            "async points (@N: N requests in flight on one io_context thread, one AsyncPostgresStore with a "
            "pool of %d; floor at min(N, %d) threads; ideal in rounds of N)\n",
            o.async_pool, kAsyncFloorThreads);
        if (std::find(o.cases.begin(), o.cases.end(), Case::replay_cached) != o.cases.end()) {
            std::printf(
                "note: no replay-cached at the async points (no replay cache in front of AsyncPostgresStore)\n");
        }
    }
    for (const int n : o.in_flight) {
        const int floor_threads = std::min(n, kAsyncFloorThreads);
        AsyncSide async(o.db, async_table, o.async_pool, o.fingerprint_secret);
        std::vector<std::unique_ptr<FloorClient>> clients;
        for (int t = 0; t < floor_threads; ++t) clients.push_back(std::make_unique<FloorClient>(o.db, floor_table));
        const std::unique_ptr<IdealClient> ideal = o.ideal ? std::make_unique<IdealClient>(o.db, ideal_table) : nullptr;
        const auto floor_counters = [&clients]() noexcept {
            Counters c;
            for (const auto& client : clients) c.round_trips += client->round_trips();
            return c;
        };
        const auto ideal_counters = [&ideal]() noexcept {
            Counters c;
            c.round_trips = ideal ? ideal->round_trips() : 0;
            return c;
        };
        std::vector<std::string> ideal_keys;
        std::vector<std::int64_t> ideal_fences;
        for (const Case kind : o.cases) {
            if (kind == Case::replay_cached) continue;
            Run run;
            run.threads = 1;
            run.pool = o.async_pool;
            run.in_flight = n;
            run.floor_threads = floor_threads;
            run.kind = kind;
            std::vector<SideKind> order{SideKind::floor};
            if (ideal) order.push_back(SideKind::ideal);
            order.push_back(SideKind::async);
            add_sides(run, order, o);
            FloorOp floor_op{clients, fp_bytes, kind, o.preload};
            IdealOp ideal_op{ideal.get(), fp_bytes,    kind, o.preload, static_cast<std::size_t>(n),
                             ideal_keys,  ideal_fences};
            vacuum_all();
            alternate(o, admin, walinspect, seed, run, [&](SideKind k, double per_round, std::uint64_t phase_seed) {
                if (k == SideKind::floor) {
                    return run_phase(admin, floor_threads, per_round, phase_seed, floor_op, floor_counters);
                }
                if (k == SideKind::ideal) return ideal_phase(admin, per_round, phase_seed, ideal_op, ideal_counters);
                return async.phase(admin, kind, n, per_round, phase_seed, fp, o.preload);
            });
            print_run(run);
            runs.push_back(std::move(run));
        }
    }
#endif
    return runs;
}

}  // namespace bench
