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

// "16", or "64/8" for 64 threads on a pool of 8, or "@64" for 64 requests in flight (async points).
std::string load_name(const Run& r) {
    if (r.in_flight > 0) return fmt::format("@{}", r.in_flight);
    return r.pool > 0 && r.pool != r.threads ? fmt::format("{}/{}", r.threads, r.pool) : std::to_string(r.threads);
}

// The side's label in the table: at an async point the floor says on how many threads it ran.
std::string side_label(const Run& r, const Side& side) {
    if (r.in_flight > 0 && side.kind == SideKind::floor) return fmt::format("floor {} thr", r.floor_threads);
    return side_name(side.kind);
}

// The floor's best ops/s for `kind` over every run (any thread count, the async points' floors too).
const Run* best_floor(const std::vector<Run>& runs, Case kind) {
    const Run* best = nullptr;
    for (const Run& r : runs) {
        const Side* f = r.find(SideKind::floor);
        if (r.kind == kind && f && (!best || f->ops() > best->find(SideKind::floor)->ops())) best = &r;
    }
    return best;
}

// The floor's p99 at 16 threads for `at`'s case: its own floor when it ran on 16 threads (@64 by
// default), else the matrix's 16-thread run, else another async point whose floor ran on 16.
const Side* floor_at_16(const std::vector<Run>& runs, const Run& at) {
    if (at.floor_threads == 16 && at.find(SideKind::floor)) return at.find(SideKind::floor);
    const Side* other = nullptr;
    for (const Run& r : runs) {
        const Side* f = r.find(SideKind::floor);
        if (r.kind != at.kind || !f || r.floor_threads != 16) continue;
        if (r.in_flight == 0) return f;
        other = other ? other : f;
    }
    return other;
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
                    load_name(r).c_str(), case_name(r.kind), side_label(r, side).c_str(), side.ops(),
                    r.ratio(side.kind), side.hist.percentile_us(0.50), side.hist.percentile_us(0.99),
                    side.rt_per_call(), side.cpu_us_per_call(), commits.c_str(), side.wal_bytes_per_call(),
                    claim_grp.c_str(), save_grp.c_str());
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

std::vector<AsyncTarget> async_targets(const std::vector<Run>& runs) {
    std::vector<AsyncTarget> out;
    for (const Run& r : runs) {
        const Side* a = r.find(SideKind::async);
        if (r.in_flight == 0 || !a) continue;
        const Run* best = best_floor(runs, r.kind);
        const double best_ops = best ? best->find(SideKind::floor)->ops() : NAN;
        const std::string best_at =
            best ? fmt::format(" ({:.0f} ops/s, {} threads)", best_ops, best->floor_threads) : "";
        if (r.kind == Case::fresh || r.kind == Case::replay) {
            out.push_back({"ops/s vs the floor's best" + best_at, r.in_flight, r.kind, a->ops() / best_ops,
                           r.kind == Case::fresh ? 3.0 : 2.0, true});
        }
        if (const Side* ideal = r.find(SideKind::ideal); ideal && r.kind == Case::fresh) {
            out.push_back({fmt::format("ops/s vs ideal in rounds of {} ({:.0f} ops/s)", r.in_flight, ideal->ops()),
                           r.in_flight, r.kind, a->ops() / ideal->ops(), 0.8, true});
        }
        if (const Side* f16 = floor_at_16(runs, r); f16 && r.in_flight == 64) {
            out.push_back({fmt::format("p99 vs the floor's p99 at 16 threads ({:.0f} vs {:.0f} us)",
                                       a->hist.percentile_us(0.99), f16->hist.percentile_us(0.99)),
                           r.in_flight, r.kind, a->hist.percentile_us(0.99) / f16->hist.percentile_us(0.99), 1.0,
                           false});
        }
    }
    return out;
}

void print_async_targets(const std::vector<Run>& runs) {
    const std::vector<AsyncTarget> targets = async_targets(runs);
    if (targets.empty()) return;
    std::printf("async targets (async side / the floor or ideal; the floor's best: its most ops/s in this run):\n");
    for (const AsyncTarget& t : targets) {
        std::printf("  @%-4d %-9s %-70s %6.2f  %s %.1f  %s\n", t.in_flight, case_name(t.kind), t.what.c_str(), t.value,
                    t.at_least ? ">=" : "<=", t.target, t.met() ? "met" : "MISSED");
    }
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
        s += "}";
        if (r.in_flight > 0)
            s += fmt::format(", \"in_flight\": {}, \"floor_threads\": {}", r.in_flight, r.floor_threads);
        s += "}";
    }
    s += runs.empty() ? "],\n" : "\n  ],\n";
    const std::vector<AsyncTarget> targets = async_targets(runs);
    if (!targets.empty()) {
        s += "  \"async_targets\": [";
        for (std::size_t i = 0; i < targets.size(); ++i) {
            const AsyncTarget& t = targets[i];
            s += fmt::format(
                "{}\n    {{\"what\": \"{}\", \"in_flight\": {}, \"case\": \"{}\", \"value\": {}, \"target\": {}, "
                "\"at_least\": {}, \"met\": {}}}",
                i ? "," : "", t.what, t.in_flight, case_name(t.kind), json_number(t.value), json_number(t.target),
                t.at_least, t.met());
        }
        s += "\n  ],\n";
    }
    s += fmt::format("  \"rss_mb\": {},\n", json_number(rss_mb));
    if (ts) {
        // One entry per layout: both tables' figures and the ratios full / empty.
        const auto figures = [](const TableSizeFigures& f) {
            return fmt::format(
                "{{\"rows\": {}, \"size\": \"{}\", \"claim_p50_us\": {}, \"claim_p99_us\": {}, "
                "\"replay_p50_us\": {}, \"replay_p99_us\": {}, \"claim_cpu_us\": {}, \"replay_cpu_us\": {}, "
                "\"claims\": {}, \"replays\": {}, \"seq_scans\": {}, \"floor_replay_p50_us\": {}, "
                "\"recent_replay_p50_us\": {}}}",
                f.rows, f.size, json_number(f.claim.percentile_us(0.5)), json_number(f.claim.percentile_us(0.99)),
                json_number(f.replay.percentile_us(0.5)), json_number(f.replay.percentile_us(0.99)),
                json_number(f.claim_cpu_us()), json_number(f.replay_cpu_us()), f.claim.count(), f.replay.count(),
                f.seq_scans,
                f.floor_replay.count() > 0 ? json_number(f.floor_replay.percentile_us(0.5)) : std::string("null"),
                json_number(f.recent_replay.percentile_us(0.5)));
        };
        s += fmt::format("  \"table_size_check\": {{\"rows\": {}, \"target\": {}, \"prewarmed_mb\": {}, \"layouts\": [",
                         ts->rows, json_number(kTableSizeTarget),
                         json_number(static_cast<double>(ts->prewarmed_bytes) / 1048576.0));
        for (std::size_t i = 0; i < ts->layouts.size(); ++i) {
            const TableSizeLayout& l = ts->layouts[i];
            const TableSizeRatios q = table_size_ratios(l);
            s += fmt::format(
                "{}\n    {{\"layout\": \"{}\", \"shape\": \"{}\", \"load_seconds\": {}, \"empty\": {}, "
                "\"full\": {}, \"ratio_claim_p50\": {}, \"ratio_replay_p50\": {}, \"ratio_claim_cpu\": {}, "
                "\"ratio_replay_cpu\": {}, \"ratio_floor_replay_p50\": {}, \"ratio_recent_replay_p50\": {}}}",
                i ? "," : "", l.name, l.shape, json_number(l.load_seconds), figures(l.empty), figures(l.full),
                json_number(q.claim_p50), json_number(q.replay_p50), json_number(q.claim_cpu),
                json_number(q.replay_cpu),
                q.floor_replay_p50 > 0 ? json_number(q.floor_replay_p50) : std::string("null"),
                json_number(q.recent_replay_p50));
        }
        s += "\n  ]},\n";
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
