#!/usr/bin/env python3
"""Prints the figures table of docs/benchmarks.md from idem-bench's --json output.

Usage: bench/table.py FILE.json [FILE2.json ...]
       bench/table.py --update-doc DOC.md FILE.json   (replaces the tables between DOC's
                      <!-- summary-table:begin/end --> and <!-- figures-table:begin/end --> lines)
The summary: one row per point, ops/s of floor, ideal, idem, idem + gc and async, and the ratio of the
library's default side (idem + gc; async at the in-flight points) to the floor.
One row per (threads or threads/pool, case): ops/s of every side (floor, ideal grouping on one thread, ideal
grouping with a thread per call, idem, idem + group commit), the ratios that matter, commit records and WAL bytes per call, the claim group sizes seen
(mean / max), p99 latency. A side that did not run shows "—".
The async points (runs with "in_flight": idem::asio, N requests in flight on one thread) follow in a
table of their own: async ops/s next to the floor of the same point (min(N, 16) threads), the
floor's best (its most ops/s at any thread count in the file) and ideal in rounds of N.
With several files (repeated runs of the same command) it prints one table per file and then one
line per (threads, case) with every run's idem / floor ratio, so the run-to-run spread is visible,
and the pooled ratio (all runs' idem calls / all runs' floor calls: both sides ran equally long).
"""
import contextlib
import io
import json
import sys

DASH = "—"


def fmt_int(x):
    return f"{round(x):,}".replace(",", " ") if x >= 10000 else f"{round(x)}"


def load(run):
    """The run's load: "16" threads, "64/8" for 64 threads on a pool of 8 connections, or "64 in flight"."""
    if run.get("in_flight"):
        return f"{run['in_flight']} in flight"
    pool = run.get("pool") or run["threads"]
    return f"{run['threads']}/{pool}" if pool != run["threads"] else f"{run['threads']}"


def side(run, name):
    return run.get("sides", {}).get(name)


def ops(run, name):
    s = side(run, name)
    return fmt_int(s["ops_per_s"]) if s else DASH


def ratio(run, a, b):
    sa, sb = side(run, a), side(run, b)
    if not sa or not sb or not sb["ops_per_s"]:
        return DASH
    return f"**{sa['ops_per_s'] / sb['ops_per_s']:.2f}**"


def per_side(run, names, field, fmt):
    vals = []
    for n in names:
        s = side(run, n)
        vals.append(fmt(s[field]) if s and s.get(field) is not None else DASH)
    return " / ".join(vals)


def groups(run, name="idem_gc"):
    s = side(run, name)
    if not s or not s.get("claim_group_max"):
        return DASH
    return f"{s['claim_group_mean']:.1f} / {s['claim_group_max']}"


def floor_best(runs, case):
    """The floor's most ops/s for `case` in any run (any thread count, the async points' floors too)."""
    best = None
    for r in runs:
        f = side(r, "floor")
        if r["case"] == case and f and (best is None or f["ops_per_s"] > side(best, "floor")["ops_per_s"]):
            best = r
    return best


def async_table(runs, everything):
    print("| in flight | case | async ops/s | floor ops/s (threads) | ideal ops/s (rounds of N) | async / floor | "
          "async / floor's best (threads) | async / ideal | p99 µs: async / floor | round trips / call: async | "
          "commits / call: floor / ideal / async | claim group mean / max | client CPU µs / call: async / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        best = floor_best(everything, r["case"])
        a = side(r, "async")
        if a and best:
            best_ratio = f"**{a['ops_per_s'] / side(best, 'floor')['ops_per_s']:.2f}** ({best.get('floor_threads', best['threads'])})"
        else:
            best_ratio = DASH
        rt = f"{a['round_trips_per_call']:.2f}" if a and a.get("round_trips_per_call") is not None else DASH
        print(f"| {r['in_flight']} | {r['case']} | {ops(r, 'async')} | {ops(r, 'floor')} ({r.get('floor_threads', DASH)}) | "
              f"{ops(r, 'ideal')} | {ratio(r, 'async', 'floor')} | {best_ratio} | {ratio(r, 'async', 'ideal')} | "
              f"{per_side(r, ['async', 'floor'], 'p99_us', lambda v: f'{round(v)}')} | {rt} | "
              f"{per_side(r, ['floor', 'ideal', 'async'], 'commits_per_call', lambda v: f'{v:.2f}')} | "
              f"{groups(r, 'async')} | "
              f"{per_side(r, ['async', 'floor'], 'client_cpu_us_per_call', lambda v: f'{v:.1f}')} |")


def table(everything):
    runs = [r for r in everything if not r.get("in_flight")]
    async_runs = [r for r in everything if r.get("in_flight")]
    print("| threads | case | floor ops/s | ideal ops/s | ideal, threads ops/s | idem ops/s | idem + gc ops/s | "
          "idem / floor | idem + gc / floor | idem + gc / idem | idem + gc / ideal | idem + gc / ideal, threads | "
          "round trips / call: idem / idem + gc | "
          "commits / call: floor / ideal / ideal, threads / idem / idem + gc | "
          "client CPU µs / call: floor / idem / idem + gc | "
          "WAL bytes / call: floor / idem / idem + gc | claim group mean / max | p99 µs: floor / idem / idem + gc |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        if "sides" not in r:
            sys.exit("table.py: this JSON has no per-side figures (made by an older idem-bench)")
        print(f"| {load(r)} | {r['case']} | {ops(r, 'floor')} | {ops(r, 'ideal')} | {ops(r, 'ideal_threads')} | {ops(r, 'idem')} | "
              f"{ops(r, 'idem_gc')} | {ratio(r, 'idem', 'floor')} | {ratio(r, 'idem_gc', 'floor')} | "
              f"{ratio(r, 'idem_gc', 'idem')} | "
              f"{ratio(r, 'idem_gc', 'ideal')} | {ratio(r, 'idem_gc', 'ideal_threads')} | "
              f"{per_side(r, ['idem', 'idem_gc'], 'round_trips_per_call', lambda v: f'{v:.2f}')} | "
              f"{per_side(r, ['floor', 'ideal', 'ideal_threads', 'idem', 'idem_gc'], 'commits_per_call', lambda v: f'{v:.2f}')} | "
              f"{per_side(r, ['floor', 'idem', 'idem_gc'], 'client_cpu_us_per_call', lambda v: f'{v:.1f}')} | "
              f"{per_side(r, ['floor', 'idem', 'idem_gc'], 'wal_bytes_per_call', lambda v: f'{round(v)}')} | "
              f"{groups(r)} | "
              f"{per_side(r, ['floor', 'idem', 'idem_gc'], 'p99_us', lambda v: f'{round(v)}')} |")
    if async_runs:
        print()
        async_table(async_runs, everything)


def summary(everything):
    """The short table: one row per point, the library's default side against the floors."""
    print("| threads / in flight | case | floor ops/s | ideal ops/s | idem ops/s | idem + gc ops/s | async ops/s | "
          "library / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in everything:
        lib = "async" if r.get("in_flight") else "idem_gc"
        print(f"| {load(r)} | {r['case']} | {ops(r, 'floor')} | {ops(r, 'ideal')} | {ops(r, 'idem')} | "
              f"{ops(r, 'idem_gc')} | {ops(r, 'async')} | {ratio(r, lib, 'floor')} |")


MARKERS = {
    "summary": ("<!-- summary-table:begin -->", "<!-- summary-table:end -->", summary),
    "figures": ("<!-- figures-table:begin -->", "<!-- figures-table:end -->", table),
}


def update_doc(doc_path, json_path):
    runs = json.load(open(json_path))["runs"]
    text = open(doc_path).read()
    for begin, end, make in MARKERS.values():
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            sys.exit(f"table.py: {doc_path} needs one {begin} line and one {end} line after it")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            make(runs)
        head, rest = text.split(begin)
        tail = rest.split(end)[1]
        text = head + begin + "\n" + out.getvalue() + end + tail
    open(doc_path, "w").write(text)
    print(f"{doc_path}: tables updated from {json_path}")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--update-doc":
        return update_doc(sys.argv[2], sys.argv[3])
    if len(sys.argv) < 2 or sys.argv[1].startswith("--"):
        sys.exit(__doc__)
    docs = [json.load(open(p)) for p in sys.argv[1:]]
    for path, d in zip(sys.argv[1:], docs):
        print(f"{path}: {d.get('seconds_per_case')} s per case and side, {d.get('rounds')} rounds; "
              f"peak RSS {d.get('rss_mb', 0):.1f} MB")
        print()
        table(d["runs"])
        print()
    if len(docs) > 1:
        print("| threads | case | idem / floor per run | pooled |")
        print("|---|---|---|---|")
        for i, r in enumerate(docs[0]["runs"]):
            same = [d["runs"][i] for d in docs]
            ratios = " / ".join(f"{x['ratio']:.2f}" for x in same)
            pooled = sum(x["calls"] for x in same) / sum(x["floor_calls"] for x in same)
            print(f"| {load(r)} | {r['case']} | {ratios} | **{pooled:.2f}** |")


if __name__ == "__main__":
    main()
