// The retention check (see retention.hpp).
#include "retention.hpp"

#include <sys/wait.h>

#include <fmt/format.h>
#include <idem/postgres_store.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../common/util.hpp"
#include "cases.hpp"
#include "floor.hpp"
#include "sides.hpp"

namespace bench {
namespace {

struct Sample {
    double t = 0;  ///< seconds since the calls began, at the window's end
    std::uint64_t calls = 0, errors = 0, purged = 0, wal_bytes = 0;
    double seconds = 0, p50_us = 0, p99_us = 0;
    std::int64_t size_bytes = 0;
    int partitions = 0;
};

// One worker's figures since the last sample; the sampler takes them under the lock.
struct Slot {
    std::mutex m;
    Histogram h;
    std::uint64_t calls = 0, errors = 0;
};

// One line of pg_waldump --stats=record: a record type with its count and bytes.
struct WalType {
    std::string type;
    std::uint64_t n = 0, record = 0, fpi = 0, combined = 0;
};

// A purge_expired() call alone (after the calls stopped), bracketed by the WAL position.
struct QuietPurge {
    double t = 0;
    std::uint64_t rows = 0, wal_bytes = 0;
};

std::string lsn_text(std::uint64_t lsn) { return fmt::format("{:X}/{:X}", lsn >> 32, lsn & 0xFFFFFFFFu); }

std::vector<WalType> parse_waldump(const std::string& text) {
    std::vector<WalType> out;
    const std::regex pct(R"(\([^)]*\))");
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
        std::istringstream in(std::regex_replace(line, pct, " "));
        WalType w;
        if (!(in >> w.type >> w.n >> w.record >> w.fpi >> w.combined)) continue;
        if (w.type.find('/') == std::string::npos) continue;  // headers, "Total"
        out.push_back(w);
    }
    return out;
}

std::int64_t table_bytes(Admin& admin, const std::string& table, int& partitions) {
    // pg_partition_tree() of a plain table is empty; a partition dropped meanwhile counts nothing.
    const std::string qt = quote_ident(table);
    partitions = std::stoi(admin.exec("SELECT count(*) FROM pg_partition_tree($1::regclass) WHERE isleaf", {qt}));
    return std::stoll(
        admin.exec("SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass)), "
                   "pg_total_relation_size($1::regclass))",
                   {qt}));
}

}  // namespace

void retention_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix,
                     const idem::Fingerprint& fp, std::uint64_t seed) {
    const bool gen = o.retention_check == "generations";
    const auto length = std::chrono::milliseconds(static_cast<std::int64_t>(o.generation_seconds * 1000));
    const std::string table = tables.add(prefix + "_ret", gen ? length : std::chrono::milliseconds(0));
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = static_cast<std::size_t>(o.retention_threads);
    if (gen) options.generations = idem::PostgresOptions::Generations{length, 2};
    idem::PostgresStore store(o.db, options);
    options.pool_size = 1;
    idem::PostgresStore purger_store(o.db, options);  // the maintenance job's own store
    prewarm(store, o.retention_threads);
    idem::ClaimOptions claim_options;
    claim_options.retention = std::chrono::seconds(o.retention_seconds);
    const std::string layout =
        gen ? fmt::format("generations of {} s, 2 ahead", o.generation_seconds) : std::string("plain table");
    std::printf(
        "retention check: %s; %d threads of new calls (retention %d s) for %.0f s; purge_expired every %.1f s%s\n",
        layout.c_str(), o.retention_threads, o.retention_seconds, o.retention_duration, o.purge_every,
        gen ? "" : " (batches of 1000)");
    std::printf("%7s %9s %8s %8s %8s %10s %11s %9s %5s %6s\n", "t s", "calls/s", "p50 us", "p99 us", "WAL B/c",
                "size MB", "purged", "errors", "parts", "");
    std::fflush(stdout);

    std::atomic<bool> stop{false}, stop_purger{false};
    std::atomic<std::uint64_t> purged{0}, purge_errors{0};
    std::mutex message_mutex;
    std::string first_error;
    const auto note_error = [&](const std::string& what) {
        std::lock_guard lock(message_mutex);
        if (first_error.empty()) {
            first_error = what;
            std::fprintf(stderr, "  first error: %s\n", what.c_str());
        }
    };
    const auto n = static_cast<std::size_t>(o.retention_threads);
    auto slots = std::make_unique<Slot[]>(n);
    std::vector<std::thread> workers;
    const auto started = Clock::now();
    for (std::size_t t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, t);
            Slot& slot = slots[t];
            const auto effect = [] { return kResult; };
            while (!stop.load(std::memory_order_relaxed)) {
                const idem::Key key(kScope, random_hex_key(rng));
                const auto t0 = Clock::now();
                bool ok = false;
                try {
                    ok = idem::execute_once(store, key, fp, effect, claim_options).outcome() == idem::Outcome::executed;
                } catch (const std::exception& e) {
                    note_error(e.what());
                }
                const auto ns = static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count());
                std::lock_guard lock(slot.m);
                slot.h.record(ns);
                ++slot.calls;
                if (!ok) ++slot.errors;
            }
        });
    }
    std::thread purger([&] {
        while (!stop_purger.load()) {
            try {
                purged += purger_store.purge_expired(1000);
            } catch (const std::exception& e) {
                ++purge_errors;
                note_error(std::string("purge_expired: ") + e.what());
            }
            const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(o.purge_every));
            while (!stop_purger.load() && Clock::now() < until)
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    });

    std::vector<Sample> samples;
    std::uint64_t last_lsn = admin.wal_lsn(), last_purged = 0;
    auto last_t = started;
    std::uint64_t steady_lsn = 0, steady_calls = 0, steady_purged = 0, total_calls = 0, total_errors = 0;
    double steady_t = -1;
    const auto end =
        started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.retention_duration));
    int k = 1;
    std::string failure;
    try {
        for (;; ++k) {
            const auto due = std::min(end, started + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(k * o.sample_every)));
            std::this_thread::sleep_until(due);
            Sample s;
            Histogram h;
            for (std::size_t t = 0; t < n; ++t) {
                std::lock_guard lock(slots[t].m);
                h.merge(slots[t].h);
                slots[t].h = Histogram{};
                s.calls += slots[t].calls;
                s.errors += slots[t].errors;
                slots[t].calls = slots[t].errors = 0;
            }
            const auto now = Clock::now();
            const std::uint64_t lsn = admin.wal_lsn();
            const std::uint64_t p = purged.load();
            s.t = seconds_between(started, now);
            s.seconds = seconds_between(last_t, now);
            s.p50_us = h.percentile_us(0.5);
            s.p99_us = h.percentile_us(0.99);
            s.wal_bytes = lsn - last_lsn;
            s.purged = p - last_purged;
            s.size_bytes = table_bytes(admin, table, s.partitions);
            last_lsn = lsn;
            last_purged = p;
            last_t = now;
            total_calls += s.calls;
            total_errors += s.errors;
            samples.push_back(s);
            std::printf("%7.0f %9.0f %8.0f %8.0f %8.0f %10.1f %11llu %9llu %5d\n", s.t,
                        static_cast<double>(s.calls) / s.seconds, s.p50_us, s.p99_us,
                        s.calls ? static_cast<double>(s.wal_bytes) / static_cast<double>(s.calls) : 0.0,
                        static_cast<double>(s.size_bytes) / 1e6, static_cast<unsigned long long>(s.purged),
                        static_cast<unsigned long long>(s.errors), s.partitions);
            std::fflush(stdout);
            if (steady_t < 0 && s.t >= o.steady_after && now < end) {
                // The window of the WAL statistics begins: a temporary slot (gone with this
                // session) keeps every WAL segment from here on.
                admin.exec("SELECT pg_create_physical_replication_slot('idem_bench_retention', true, true)");
                steady_lsn = admin.wal_lsn();
                steady_t = s.t;
                steady_calls = total_calls;
                steady_purged = p;
            }
            if (now >= end) break;
        }
    } catch (const std::exception& e) {
        failure = e.what();
    }
    stop.store(true);
    for (auto& w : workers) w.join();
    const std::uint64_t steady_end_lsn = admin.wal_lsn();
    stop_purger.store(true);
    purger.join();
    for (std::size_t t = 0; t < n; ++t) total_calls += slots[t].calls;  // after the last sample
    if (!failure.empty()) throw std::runtime_error(failure);
    const std::uint64_t window_calls = total_calls - steady_calls;
    const std::uint64_t window_purged = purged.load() - steady_purged;

    // pg_waldump over the window, while the slot still keeps it.
    std::vector<WalType> wal_types;
    std::string waldump_note;
    const char* bin = std::getenv("IDEM_PG_BIN");
    const char* data = std::getenv("IDEM_PG_DATA");
    if (steady_t < 0) {
        waldump_note = "the run ended before --steady-after";
    } else if (!bin || !data) {
        waldump_note = "no $IDEM_PG_BIN / $IDEM_PG_DATA (run under scripts/with-postgres.sh)";
    } else {
        admin.exec("SELECT pg_switch_wal()");  // the window's last segment complete on disk
        const ChildRun run =
            run_child({std::string(bin) + "/pg_waldump", "--stats=record", "-p", std::string(data) + "/pg_wal", "-s",
                       lsn_text(steady_lsn), "-e", lsn_text(steady_end_lsn)},
                      true);
        wal_types = parse_waldump(run.output);
        if (!WIFEXITED(run.status) || WEXITSTATUS(run.status) != 0 || wal_types.empty()) {
            waldump_note = "pg_waldump failed: " + run.output.substr(0, 300);
        }
    }
    if (!waldump_note.empty()) std::printf("  WAL statistics: none (%s)\n", waldump_note.c_str());

    // Purges alone: what each costs in WAL, with nothing else writing but the server's own work.
    std::vector<QuietPurge> quiet;
    const auto quiet_start = Clock::now();
    while (seconds_between(quiet_start, Clock::now()) < 45) {
        const std::uint64_t before = admin.wal_lsn();
        const std::size_t rows = purger_store.purge_expired(1000);
        const std::uint64_t after = admin.wal_lsn();
        quiet.push_back({seconds_between(quiet_start, Clock::now()), rows, after - before});
        std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    std::uint64_t quiet_rows = 0, quiet_wal = 0;
    for (const QuietPurge& q : quiet) {
        quiet_rows += q.rows;
        quiet_wal += q.wal_bytes;
    }

    std::uint64_t window_wal = 0;
    for (const WalType& w : wal_types) window_wal += w.combined;
    std::printf("  calls %llu (errors %llu, purge errors %llu); steady window from %.0f s: %llu calls, %llu purged",
                static_cast<unsigned long long>(total_calls), static_cast<unsigned long long>(total_errors),
                static_cast<unsigned long long>(purge_errors.load()), steady_t,
                static_cast<unsigned long long>(window_calls), static_cast<unsigned long long>(window_purged));
    if (window_calls > 0) {
        std::printf(", WAL %.0f B/call (LSN), %.0f B/call (pg_waldump)",
                    static_cast<double>(steady_end_lsn - steady_lsn) / static_cast<double>(window_calls),
                    static_cast<double>(window_wal) / static_cast<double>(window_calls));
    }
    std::printf("\n  purges alone for 45 s: %llu rows removed, %llu WAL bytes in their brackets (%.1f B/row)\n",
                static_cast<unsigned long long>(quiet_rows), static_cast<unsigned long long>(quiet_wal),
                quiet_rows ? static_cast<double>(quiet_wal) / static_cast<double>(quiet_rows) : 0.0);
    std::fflush(stdout);

    if (o.json.empty()) return;
    std::string s = fmt::format(
        "{{\n  \"layout\": \"{}\", \"threads\": {}, \"retention_s\": {}, \"generation_length_s\": {}, "
        "\"purge_every_s\": {}, \"duration_s\": {}, \"sample_every_s\": {}, \"server\": \"{}\",\n"
        "  \"calls\": {}, \"errors\": {}, \"purge_errors\": {},\n  \"samples\": [",
        o.retention_check, o.retention_threads, o.retention_seconds, gen ? o.generation_seconds : 0, o.purge_every,
        o.retention_duration, o.sample_every, admin.server_summary(), total_calls, total_errors, purge_errors.load());
    for (std::size_t i = 0; i < samples.size(); ++i) {
        const Sample& x = samples[i];
        s += fmt::format(
            "{}\n    {{\"t\": {:.2f}, \"seconds\": {:.3f}, \"calls\": {}, \"errors\": {}, \"p50_us\": {:.1f}, "
            "\"p99_us\": {:.1f}, \"wal_bytes\": {}, \"size_bytes\": {}, \"partitions\": {}, \"purged\": {}}}",
            i ? "," : "", x.t, x.seconds, x.calls, x.errors, x.p50_us, x.p99_us, x.wal_bytes, x.size_bytes,
            x.partitions, x.purged);
    }
    s += fmt::format(
        "\n  ],\n  \"steady\": {{\"from_t\": {:.2f}, \"lsn_from\": \"{}\", \"lsn_to\": \"{}\", \"wal_bytes\": {}, "
        "\"calls\": {}, \"purged\": {}, \"note\": \"{}\", \"waldump\": [",
        steady_t, lsn_text(steady_lsn), lsn_text(steady_end_lsn), steady_end_lsn - steady_lsn, window_calls,
        window_purged, waldump_note.empty() ? "" : "see the run's output");
    for (std::size_t i = 0; i < wal_types.size(); ++i) {
        const WalType& w = wal_types[i];
        s += fmt::format("{}\n    {{\"type\": \"{}\", \"n\": {}, \"record\": {}, \"fpi\": {}, \"combined\": {}}}",
                         i ? "," : "", w.type, w.n, w.record, w.fpi, w.combined);
    }
    s += "\n  ]},\n  \"quiet_purges\": [";
    for (std::size_t i = 0; i < quiet.size(); ++i) {
        s += fmt::format("{}{{\"t\": {:.2f}, \"rows\": {}, \"wal_bytes\": {}}}", i ? ", " : "", quiet[i].t,
                         quiet[i].rows, quiet[i].wal_bytes);
    }
    s += "]\n}\n";
    std::FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + o.json);
    }
}

}  // namespace bench
