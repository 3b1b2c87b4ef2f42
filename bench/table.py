#!/usr/bin/env python3
"""Prints the "Latest figures" table of docs/benchmarks.md from idem-bench's --json output.

Usage: bench/table.py FILE.json [FILE2.json ...]
With several files (repeated runs of the same command) it prints one table per file and then
one line per (threads, case) with every run's ratio, so the run-to-run spread is visible, the
pooled ratio (all runs' idem calls / all runs' floor calls: both sides ran equally long) and the
mean client CPU per call of each side.
"""
import json
import sys


def fmt_int(x):
    return f"{round(x):,}".replace(",", " ") if x >= 10000 else f"{round(x)}"


def table(runs):
    print("| threads | case | idem ops/s | floor ops/s | ratio | pgbench tps | idem p50 / p99 µs | "
          "floor p50 / p99 µs | round trips / call | client CPU µs / call, idem / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        pgb = r.get("pgbench_tps")
        print(f"| {r['threads']} | {r['case']} | {fmt_int(r['ops_per_s'])} | {fmt_int(r['floor_ops_per_s'])} | "
              f"**{r['ratio']:.2f}** | {fmt_int(pgb) if pgb else '—'} | "
              f"{round(r['p50_us'])} / {round(r['p99_us'])} | {round(r['floor_p50_us'])} / {round(r['floor_p99_us'])} | "
              f"{r['round_trips_per_call']:g} | {r['client_cpu_us_per_call']:.1f} / {r['floor_client_cpu_us_per_call']:.1f} |")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    docs = [json.load(open(p)) for p in sys.argv[1:]]
    for path, d in zip(sys.argv[1:], docs):
        print(f"{path}: peak RSS {d.get('rss_mb', 0):.1f} MB")
        table(d["runs"])
        print()
    if len(docs) > 1:
        print("| threads | case | ratio per run | pooled | CPU µs, idem / floor |")
        print("|---|---|---|---|---|")
        for i, r in enumerate(docs[0]["runs"]):
            same = [d["runs"][i] for d in docs]
            ratios = " / ".join(f"{x['ratio']:.2f}" for x in same)
            pooled = sum(x["calls"] for x in same) / sum(x["floor_calls"] for x in same)
            cpu = sum(x["client_cpu_us_per_call"] for x in same) / len(same)
            floor_cpu = sum(x["floor_client_cpu_us_per_call"] for x in same) / len(same)
            print(f"| {r['threads']} | {r['case']} | {ratios} | **{pooled:.2f}** | {cpu:.1f} / {floor_cpu:.1f} |")


if __name__ == "__main__":
    main()
