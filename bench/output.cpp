// idem-bench's table and JSON (see output.hpp).
#include "output.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace bench {
namespace {

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

std::string json_side(const Side& side, const Run& run) {
    return fmt::format(
        "{{\"ops_per_s\": {}, \"ratio_to_floor\": {}, \"p50_us\": {}, \"p99_us\": {}, \"calls\": {}, "
        "\"unexpected_outcomes\": {}, \"round_trips_per_call\": {}, \"client_cpu_us_per_call\": {}, "
        "\"commits_per_call\": {}, \"wal_bytes_per_call\": {}, \"claim_group_mean\": {}, "
        "\"claim_group_max\": {}, \"save_group_mean\": {}, \"save_group_max\": {}}}",
        json_number(side.ops()), json_number(run.ratio(side.kind)), json_number(side.hist.percentile_us(0.5)),
        json_number(side.hist.percentile_us(0.99)), side.calls, side.unexpected, json_number(side.rt_per_call()),
        json_number(side.cpu_us_per_call()),
        side.commits ? json_number(side.per_call(static_cast<double>(*side.commits))) : "null",
        json_number(side.wal_bytes_per_call()), json_number(side.mean_claim_group()), side.counters.largest_claim_group,
        json_number(side.mean_save_group()), side.counters.largest_save_group);
}

// "16", or "64/8" for 64 threads on a pool of 8.
std::string load_name(const Run& r) {
    return r.pool > 0 && r.pool != r.threads ? fmt::format("{}/{}", r.threads, r.pool) : std::to_string(r.threads);
}

}  // namespace

void print_header() {
    std::printf("%-7s %-13s %-13s %11s %6s %8s %8s %7s %7s %9s %10s %11s %11s\n", "threads", "case", "side", "ops/s",
                "/floor", "p50 us", "p99 us", "RT/call", "cpu us", "commits", "WAL B", "claim grp", "save grp");
}

void print_run(const Run& r) {
    for (const Side& side : r.sides) {
        if (!side.ran()) continue;
        const std::string commits =
            side.commits ? fmt::format("{:.3f}", side.per_call(static_cast<double>(*side.commits))) : "-";
        const std::string claim_grp = side.counters.claim_groups ? fmt::format("{:.1f}/{}", side.mean_claim_group(),
                                                                               side.counters.largest_claim_group)
                                                                 : "-";
        const std::string save_grp = side.counters.save_groups ? fmt::format("{:.1f}/{}", side.mean_save_group(),
                                                                             side.counters.largest_save_group)
                                                               : "-";
        std::printf("%-7s %-13s %-13s %11.0f %6.3f %8.0f %8.0f %7.3f %7.1f %9s %10.0f %11s %11s\n",
                    load_name(r).c_str(), case_name(r.kind), side_name(side.kind), side.ops(), r.ratio(side.kind),
                    side.hist.percentile_us(0.50), side.hist.percentile_us(0.99), side.rt_per_call(),
                    side.cpu_us_per_call(), commits.c_str(), side.wal_bytes_per_call(), claim_grp.c_str(),
                    save_grp.c_str());
        if (side.unexpected || side.counters.retries || side.counters.opened) {
            std::printf("        note: %s: unexpected outcomes %llu; retries %llu; connections opened %llu\n",
                        side_name(side.kind), static_cast<unsigned long long>(side.unexpected),
                        static_cast<unsigned long long>(side.counters.retries),
                        static_cast<unsigned long long>(side.counters.opened));
        }
    }
    if (r.pgbench_tps)
        std::printf("%-7s %-13s %-13s %11.0f  (informational)\n", load_name(r).c_str(), case_name(r.kind), "pgbench",
                    *r.pgbench_tps);
    std::fflush(stdout);
}

void write_json(const std::string& path, const Options& o, const std::string& server, const std::vector<Run>& runs,
                const std::optional<TableSizeResult>& ts, const std::optional<RssResult>& rss, double rss_mb) {
    std::string s = "{\n  \"runs\": [";
    const Side none;
    for (std::size_t i = 0; i < runs.size(); ++i) {
        const Run& r = runs[i];
        // The flat fields (idem = group commit off, vs the floor) as before; every side in "sides".
        const Side& lib = r.lib() ? *r.lib() : none;
        const Side& floor = r.find(SideKind::floor) ? *r.find(SideKind::floor) : none;
        s += i ? ",\n    " : "\n    ";
        s += fmt::format(
            "{{\"threads\": {}, \"pool\": {}, \"case\": \"{}\", \"ops_per_s\": {}, \"floor_ops_per_s\": {}, \"ratio\": "
            "{}, "
            "\"p50_us\": {}, \"p99_us\": {}, \"round_trips_per_call\": {}, \"floor_p50_us\": {}, "
            "\"floor_p99_us\": {}, \"floor_round_trips_per_call\": {}, \"pgbench_tps\": {}, \"calls\": {}, "
            "\"floor_calls\": {}, \"unexpected_outcomes\": {}, \"client_cpu_us_per_call\": {}, "
            "\"floor_client_cpu_us_per_call\": {}, \"sides\": {{",
            r.threads, r.pool, case_name(r.kind), json_number(lib.ops()), json_number(floor.ops()),
            json_number(floor.ops() > 0 ? lib.ops() / floor.ops() : NAN), json_number(lib.hist.percentile_us(0.5)),
            json_number(lib.hist.percentile_us(0.99)), json_number(lib.rt_per_call()),
            json_number(floor.hist.percentile_us(0.5)), json_number(floor.hist.percentile_us(0.99)),
            json_number(floor.rt_per_call()), r.pgbench_tps ? json_number(*r.pgbench_tps) : "null", lib.calls,
            floor.calls, lib.unexpected + floor.unexpected, json_number(lib.cpu_us_per_call()),
            json_number(floor.cpu_us_per_call()));
        bool first = true;
        for (const Side& side : r.sides) {
            if (!side.ran()) continue;
            s += fmt::format("{}\"{}\": {}", first ? "" : ", ", side_name(side.kind), json_side(side, r));
            first = false;
        }
        s += "}}";
    }
    s += runs.empty() ? "],\n" : "\n  ],\n";
    s += fmt::format("  \"rss_mb\": {},\n", json_number(rss_mb));
    if (ts) {
        s += fmt::format(
            "  \"table_size_check\": {{\"rows\": {}, \"load_seconds\": {}, \"empty_claim_p50_us\": {}, "
            "\"full_claim_p50_us\": {}, \"ratio\": {}, \"empty_claim_p99_us\": {}, \"full_claim_p99_us\": {}}},\n",
            ts->rows, json_number(ts->load_seconds), json_number(ts->empty_claim.percentile_us(0.5)),
            json_number(ts->full_claim.percentile_us(0.5)),
            json_number(ts->full_claim.percentile_us(0.5) / ts->empty_claim.percentile_us(0.5)),
            json_number(ts->empty_claim.percentile_us(0.99)), json_number(ts->full_claim.percentile_us(0.99)));
    }
    if (rss) {
        s += fmt::format(
            "  \"rss_check\": {{\"threads\": {}, \"calls_first\": {}, \"rss_mb_first\": {}, \"calls_total\": {}, "
            "\"rss_mb_total\": {}, \"ratio\": {}, \"peak_mb\": {}}},\n",
            o.rss_threads, rss->first, json_number(rss->at_first.rss_mb), rss->total, json_number(rss->at_total.rss_mb),
            json_number(rss->at_total.rss_mb / rss->at_first.rss_mb), json_number(rss->at_total.peak_mb));
    }
    s += fmt::format("  \"seconds_per_case\": {}, \"rounds\": {}, \"server\": \"{}\"\n}}\n", json_number(o.seconds),
                     o.rounds, server);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + path);
    }
}

}  // namespace bench
