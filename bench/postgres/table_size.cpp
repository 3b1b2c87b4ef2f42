// The table-size check (see table_size.hpp).
#include "table_size.hpp"

#include <fmt/format.h>
#include <openssl/evp.h>
#include <idem/postgres_store.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <thread>

#include "cases.hpp"
#include "floor.hpp"
#include "phase.hpp"
#include "sides.hpp"

namespace bench {
namespace {

// The "empty" tables hold this many completed keys, for the replays to find: about as many as the
// check's new keys add to them while it runs.
constexpr std::int64_t kSmallRows = 10'000;
// The generational layout: generations of 6 h (a quarter of the default 24 h retention), the rows
// spread evenly over the current one and kOlder older ones (all still live), 2 ahead (empty).
constexpr std::chrono::milliseconds kLength = std::chrono::hours(6);
constexpr int kOlder = 3;

std::uint64_t thread_cpu_ns() {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(ts.tv_nsec);
}

// md5(i::text) in hex, as Admin::preload names its md5 keys.
std::string md5_key(std::uint64_t i) {
    const std::string text = std::to_string(i);
    std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
    unsigned int size = 0;
    if (EVP_Digest(text.data(), text.size(), digest.data(), &size, EVP_md5(), nullptr) != 1) {
        throw std::runtime_error("md5 failed");
    }
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (unsigned int b = 0; b < size; ++b) {
        out += digits[digest[b] >> 4];
        out += digits[digest[b] & 0xF];
    }
    return out;
}

// One call: a claim of a new key (then its save), of a preloaded completed key (a replay), or of
// one of the last quarter preloaded (a recent replay: in the generational layout, the keys of the
// current generation). The claim alone is timed and its thread CPU time counted.
struct TableOp {
    enum class Kind { claim, replay, recent };
    idem::PostgresStore& store;
    const idem::Fingerprint& fp;
    Kind kind;
    TableSizeFigures& f;

    bool operator()(int, Rng& rng) const {
        const auto rows = static_cast<std::uint64_t>(f.rows);
        const std::uint64_t recent_first = rows - rows / 4;
        const idem::Key key(kScope, kind == Kind::claim    ? random_hex_key(rng)
                                    : kind == Kind::replay ? md5_key(rng.below(rows))
                                                           : md5_key(recent_first + rng.below(rows - recent_first)));
        const auto cpu0 = thread_cpu_ns();
        const auto t0 = Clock::now();
        const idem::Claim c = store.claim(key, fp);
        const auto ns = static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count());
        const auto cpu = thread_cpu_ns() - cpu0;
        if (kind == Kind::recent) {
            f.recent_replay.record(ns);
            return c.status == idem::ClaimStatus::completed;
        }
        if (kind == Kind::replay) {
            f.replay.record(ns);
            f.replay_cpu_ns += cpu;
            ++f.replay_calls;
            return c.status == idem::ClaimStatus::completed;
        }
        f.claim.record(ns);
        f.claim_cpu_ns += cpu;
        ++f.claim_calls;
        if (c.status != idem::ClaimStatus::claimed) return false;
        store.save(key, c.fence, kResult);
        return true;
    }
};

// A replay sent by the floor (FloorClient: the library's statements over raw libpq), timed as
// TableOp times the library's.
struct FloorReplayOp {
    FloorClient& client;
    std::string_view fp;
    TableSizeFigures& f;

    bool operator()(int, Rng& rng) const {
        const std::string key = md5_key(rng.below(static_cast<std::uint64_t>(f.rows)));
        const auto t0 = Clock::now();
        const auto answer = client.claim(kScope, key, fp, 1, 1, kLeaseMs, kRetentionS);
        f.floor_replay.record(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count()));
        return answer == FloorClient::Answer::completed;
    }
};

// Loads `rows` completed md5 keys into the generational table `table`: a quarter into each of
// kOlder generations made here (named as the library names them, created, loaded, then attached
// — attaching builds their indexes) and the rest into the current one, which ensure_schema() made.
void load_generations(Admin& admin, const std::string& table, std::int64_t rows, std::string_view fp) {
    // The current generation: the oldest that ensure_schema() created.
    const std::int64_t current =
        std::stoll(admin.exec("SELECT min(substring(c.relname FROM '_g([0-9]+)$')::bigint) FROM pg_inherits i "
                              "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass",
                              {quote_ident(table)}));
    const std::int64_t per = rows / (kOlder + 1);
    std::int64_t first = 0;
    for (int k = kOlder; k >= 1; --k, first += per) {
        const std::int64_t start = current - k * kLength.count();
        const std::string part = table + "_g" + std::to_string(start);
        admin.exec(
            fmt::format("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = 90)",
                        quote_ident(part), quote_ident(table)));
        admin.preload(part, Admin::Preload::completed, 0, per, fp, true, first, start);
        admin.exec(fmt::format("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})", quote_ident(table),
                               quote_ident(part), start));
    }
    admin.preload(table, Admin::Preload::completed, 0, rows - first, fp, true, first, current);
}

// Sequential scans so far of `table` and its partitions (pg_partition_tree() of a plain table is
// empty).
long long seq_scans(Admin& admin, const std::string& table) {
    // Statistics reach pg_stat_* up to a second late: wait that long first.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    return std::stoll(
        admin.exec("SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables WHERE relid = $1::regclass "
                   "OR relid IN (SELECT relid FROM pg_partition_tree($1::regclass))",
                   {quote_ident(table)}));
}

std::string total_size(Admin& admin, const std::string& table) {
    return admin.exec(
        "SELECT pg_size_pretty(coalesce((SELECT sum(pg_total_relation_size(relid)) "
        "FROM pg_partition_tree($1::regclass)), pg_total_relation_size($1::regclass)))",
        {quote_ident(table)});
}

// Reads `table`, its partitions and all their indexes into shared_buffers (pg_prewarm, mode
// "buffer"); returns the bytes read. Throws if the extension cannot be created.
long long prewarm_relations(Admin& admin, const std::string& table) {
    admin.exec("CREATE EXTENSION IF NOT EXISTS pg_prewarm");
    const std::string blocks = admin.exec(
        "WITH t AS (SELECT $1::regclass AS relid UNION SELECT relid FROM pg_partition_tree($1::regclass)), "
        "r AS (SELECT relid FROM t UNION SELECT indexrelid FROM pg_index WHERE indrelid IN (SELECT relid FROM t)) "
        "SELECT coalesce(sum(pg_prewarm(r.relid, 'buffer')), 0) FROM r JOIN pg_class c ON c.oid = r.relid "
        "WHERE c.relkind IN ('r', 'i')",
        {quote_ident(table)});
    return std::stoll(blocks) * std::stoll(admin.exec("SELECT current_setting('block_size')"));
}

double mb(long long bytes) { return static_cast<double>(bytes) / 1048576.0; }

double per_call_us(std::uint64_t ns, std::uint64_t calls) {
    return calls ? static_cast<double>(ns) / 1000.0 / static_cast<double>(calls) : 0;
}

}  // namespace

double TableSizeFigures::claim_cpu_us() const { return per_call_us(claim_cpu_ns, claim_calls); }
double TableSizeFigures::replay_cpu_us() const { return per_call_us(replay_cpu_ns, replay_calls); }

TableSizeRatios table_size_ratios(const TableSizeLayout& l) {
    return {l.full.claim.percentile_us(0.5) / l.empty.claim.percentile_us(0.5),
            l.full.replay.percentile_us(0.5) / l.empty.replay.percentile_us(0.5),
            l.full.claim_cpu_us() / l.empty.claim_cpu_us(),
            l.full.replay_cpu_us() / l.empty.replay_cpu_us(),
            l.empty.floor_replay.count() > 0
                ? l.full.floor_replay.percentile_us(0.5) / l.empty.floor_replay.percentile_us(0.5)
                : 0.0,
            l.full.recent_replay.percentile_us(0.5) / l.empty.recent_replay.percentile_us(0.5)};
}

TableSizeResult table_size_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                                 const idem::Fingerprint& fp, std::uint64_t seed) {
    TableSizeResult r;
    r.rows = o.table_size_check;
    struct Setup {
        std::string table[2];  // empty, full
        std::unique_ptr<idem::PostgresStore> store[2];
        std::unique_ptr<FloorClient> floor[2];  // the plain layout only
    };
    Setup setups[2];
    for (int g = 0; g < 2; ++g) {
        const bool gen = g == 1;
        TableSizeLayout& l = r.layouts.emplace_back();
        l.name = gen ? "generations" : "plain";
        l.shape = gen ? fmt::format("generations of {} h, rows spread over the current and {} older, 2 ahead",
                                    std::chrono::duration_cast<std::chrono::hours>(kLength).count(), kOlder)
                      : "one table";
        const auto length = gen ? kLength : std::chrono::milliseconds(0);
        for (int full = 0; full < 2; ++full) {
            TableSizeFigures& f = full ? l.full : l.empty;
            f.rows = full ? r.rows : kSmallRows;
            const std::string name =
                tables.add(fmt::format("{}_ts_{}_{}", prefix, gen ? "gen" : "plain", full ? "full" : "empty"), length);
            setups[g].table[full] = name;
            std::fprintf(stderr, "table-size check: loading %lld completed rows (md5 keys) into %s (%s)...\n",
                         static_cast<long long>(f.rows), name.c_str(), l.shape.c_str());
            const auto t0 = Clock::now();
            if (gen) {
                load_generations(admin, name, f.rows, fp.bytes());
            } else {
                admin.preload(name, Admin::Preload::completed, 0, f.rows, fp.bytes(), true);
            }
            admin.exec("VACUUM (ANALYZE) " + quote_ident(name));
            admin.checkpoint();
            if (full) l.load_seconds = seconds_between(t0, Clock::now());
            f.size = total_size(admin, name);
            std::fprintf(stderr, "  loaded in %.0f s; %s with indexes\n", seconds_between(t0, Clock::now()),
                         f.size.c_str());
            idem::PostgresOptions options;
            options.pool_size = 1;
            options.table = name;
            if (gen) options.generations = idem::PostgresOptions::Generations{kLength, 2};
            setups[g].store[full] = std::make_unique<idem::PostgresStore>(o.db, options);
            prewarm(*setups[g].store[full], 1);
            if (!gen) setups[g].floor[full] = std::make_unique<FloorClient>(o.db, name);
        }
    }
    if (o.table_size_prewarm) {
        const long long buffers =
            std::stoll(admin.exec("SELECT setting::bigint * current_setting('block_size')::bigint FROM pg_settings "
                                  "WHERE name = 'shared_buffers'"));
        long long& total = r.prewarmed_bytes;
        for (const Setup& s : setups) {
            for (const std::string& table : s.table) total += prewarm_relations(admin, table);
        }
        std::fprintf(stderr, "table-size check: read %.0f MB into shared_buffers (%.0f MB)\n", mb(total), mb(buffers));
        if (total > buffers * 9 / 10) {
            std::printf("  WARNING: --prewarm: the tables (%.0f MB) do not fit in shared_buffers (%.0f MB)\n",
                        mb(total), mb(buffers));
        }
    }
    long long seq_before[2][2];
    for (int g = 0; g < 2; ++g) {
        for (int full = 0; full < 2; ++full) seq_before[g][full] = seq_scans(admin, setups[g].table[full]);
    }

    const auto none = []() noexcept { return Counters{}; };
    const double per_round = o.seconds / o.rounds;
    std::uint64_t unexpected = 0;
    for (int round = 0; round < o.rounds; ++round) {
        for (int g = 0; g < 2; ++g) {
            for (const int kind : {0, 1, 2, 3}) {  // claims, replays, recent replays, the floor's replays
                if (kind == 3 && !setups[g].floor[0]) continue;
                for (int half = 0; half < 2; ++half) {
                    const int full = (half == 0) == (round % 2 == 0) ? 1 : 0;  // ABBA
                    TableSizeLayout& l = r.layouts[static_cast<std::size_t>(g)];
                    TableSizeFigures& f = full ? l.full : l.empty;
                    seed += 0x632BE59BD9B4E019ull;
                    if (kind == 3) {
                        FloorReplayOp op{*setups[g].floor[full], fp.bytes(), f};
                        unexpected += run_phase(admin, 1, per_round, seed, op, none).unexpected;
                    } else {
                        const auto k = kind == 0   ? TableOp::Kind::claim
                                       : kind == 1 ? TableOp::Kind::replay
                                                   : TableOp::Kind::recent;
                        TableOp op{*setups[g].store[full], fp, k, f};
                        unexpected += run_phase(admin, 1, per_round, seed, op, none).unexpected;
                    }
                }
            }
        }
    }
    for (int g = 0; g < 2; ++g) {
        for (int full = 0; full < 2; ++full) {
            TableSizeLayout& l = r.layouts[static_cast<std::size_t>(g)];
            (full ? l.full : l.empty).seq_scans = seq_scans(admin, setups[g].table[full]) - seq_before[g][full];
        }
    }

    std::printf(
        "table-size check (1 thread, %d x %.1f s per table and case, alternating; claim = new key, then its "
        "save; replay = a preloaded completed key; recent = one of the last quarter loaded (generations: the "
        "current one's); the claim alone timed; cpu = the calling thread's; floor rpl = the same replays over raw "
        "libpq; %s):\n",
        o.rounds, per_round,
        r.prewarmed_bytes > 0 ? fmt::format("{:.0f} MB read into shared_buffers first", mb(r.prewarmed_bytes)).c_str()
                              : "no prewarm");
    std::printf("  %-12s %-22s %10s %10s %10s %10s %10s %9s %9s %8s %8s %5s %10s\n", "layout", "table", "claim p50",
                "claim p99", "replay p50", "replay p99", "recent p50", "cpu claim", "cpu rpl", "claims", "replays",
                "seq", "floor rpl");
    for (const TableSizeLayout& l : r.layouts) {
        for (const TableSizeFigures* f : {&l.empty, &l.full}) {
            std::printf(
                "  %-12s %-22s %10.0f %10.0f %10.0f %10.0f %10.0f %9.1f %9.1f %8llu %8llu %5lld %10s\n", l.name.c_str(),
                fmt::format("{} rows, {}", f->rows, f->size).c_str(), f->claim.percentile_us(0.5),
                f->claim.percentile_us(0.99), f->replay.percentile_us(0.5), f->replay.percentile_us(0.99),
                f->recent_replay.percentile_us(0.5), f->claim_cpu_us(), f->replay_cpu_us(),
                static_cast<unsigned long long>(f->claim.count()), static_cast<unsigned long long>(f->replay.count()),
                f->seq_scans,
                f->floor_replay.count() > 0 ? fmt::format("{:.0f}", f->floor_replay.percentile_us(0.5)).c_str() : "-");
        }
    }
    const auto verdict = [](double v) { return v <= kTableSizeTarget ? "met" : "MISSED"; };
    for (const TableSizeLayout& l : r.layouts) {
        const TableSizeRatios q = table_size_ratios(l);
        std::printf(
            "  %s, full / empty (target <= %.2f each): claim p50 %.3f %s, replay p50 %.3f %s, cpu claim %.3f %s, "
            "cpu replay %.3f %s; load %.0f s\n",
            l.name.c_str(), kTableSizeTarget, q.claim_p50, verdict(q.claim_p50), q.replay_p50, verdict(q.replay_p50),
            q.claim_cpu, verdict(q.claim_cpu), q.replay_cpu, verdict(q.replay_cpu), l.load_seconds);
        std::printf("  %s, recent replays' p50, full / empty: %.3f\n", l.name.c_str(), q.recent_replay_p50);
        if (q.floor_replay_p50 > 0) {
            std::printf("  %s, the floor's replay p50 (no library), full / empty: %.3f\n", l.name.c_str(),
                        q.floor_replay_p50);
        }
    }
    const TableSizeLayout& plain = r.layouts[0];
    const TableSizeLayout& gen = r.layouts[1];
    std::printf(
        "  generations / plain at %lld rows: claim p50 %.3f, replay p50 %.3f, cpu claim %.3f, cpu replay %.3f\n",
        static_cast<long long>(r.rows), gen.full.claim.percentile_us(0.5) / plain.full.claim.percentile_us(0.5),
        gen.full.replay.percentile_us(0.5) / plain.full.replay.percentile_us(0.5),
        gen.full.claim_cpu_us() / plain.full.claim_cpu_us(), gen.full.replay_cpu_us() / plain.full.replay_cpu_us());
    for (const TableSizeLayout& l : r.layouts) {
        for (const TableSizeFigures* f : {&l.empty, &l.full}) {
            if (f->seq_scans > 0) {
                std::printf("  WARNING: %s, %lld rows: %lld sequential scans: a cached plan scans the table\n",
                            l.name.c_str(), static_cast<long long>(f->rows), f->seq_scans);
            }
        }
    }
    if (unexpected > 0)
        std::printf("  WARNING: %llu calls had an unexpected outcome\n", static_cast<unsigned long long>(unexpected));
    std::fflush(stdout);
    return r;
}

}  // namespace bench
