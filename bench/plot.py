#!/usr/bin/python3
"""Draws docs/benchmarks.svg from idem-bench's --json output: ops/s by load (threads, or threads on a
smaller pool), one panel per
case, one line per side (floor, ideal grouping on one thread and with a thread per call, idem,
idem + group commit). The async points (runs with "in_flight") come after the thread counts on the
x axis, as their own series: idem::asio with N requests in flight on one thread.

Usage: bench/plot.py FILE.json [OUT.svg|OUT.png]      (default OUT: docs/benchmarks.svg)
Needs matplotlib (Debian: apt-get install -y python3-matplotlib; hence /usr/bin/python3).
The SVG is written deterministically (no date, fixed ids), so re-running on the same JSON changes
nothing in git.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "idem-bench"
import matplotlib.pyplot as plt  # noqa: E402

SIDES = [  # JSON side name, legend, style
    ("floor", "floor (one transaction per call)", {"color": "black", "linestyle": "--", "marker": "o"}),
    ("ideal", "ideal grouping (by hand, one thread)", {"color": "grey", "linestyle": ":", "marker": "s"}),
    ("ideal_threads", "ideal grouping (by hand, a thread per call)", {"color": "tab:green", "linestyle": ":", "marker": "D"}),
    ("idem", "idem", {"color": "tab:blue", "marker": "o"}),
    ("idem_gc", "idem + group commit", {"color": "tab:orange", "marker": "^"}),
]
ASYNC = ("async", "idem::asio (N in flight, one thread)", {"color": "tab:red", "marker": "v"})
CASES = ["new", "replay", "conflict", "replay-cached"]


def load(run):
    if run.get("in_flight"):
        return f"@{run['in_flight']}"
    pool = run.get("pool") or run["threads"]
    return f"{run['threads']}/{pool}" if pool != run["threads"] else f"{run['threads']}"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    data = json.load(open(sys.argv[1]))
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[2] if len(sys.argv) == 3 else os.path.join(here, "..", "docs", "benchmarks.svg")
    runs = data["runs"]
    cases = [c for c in CASES if any(r["case"] == c for r in runs)]
    cases += sorted({r["case"] for r in runs} - set(cases))
    if not cases:
        sys.exit("plot.py: no runs in " + sys.argv[1])
    ncols = min(2, len(cases))
    nrows = (len(cases) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows + 0.8), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(cases):]:
        ax.set_visible(False)
    # One x position per load (threads, or threads/pool), in the order of the runs.
    loads = []
    for r in sorted(runs, key=lambda r: bool(r.get("in_flight"))):
        if load(r) not in loads:
            loads.append(load(r))
    for ax, case in zip(flat, cases):
        rows = [r for r in runs if r["case"] == case and not r.get("in_flight")]
        async_rows = [r for r in runs if r["case"] == case and r.get("in_flight")]
        for (side, label, style), these in [(s, rows) for s in SIDES] + [(ASYNC, async_rows)]:
            points = [(loads.index(load(r)), r["sides"][side]["ops_per_s"]) for r in these if side in r.get("sides", {})]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)
        ax.set_title(case + (" (idem through CachedStore)" if case == "replay-cached" else ""), fontsize=10)
        ax.set_xticks(range(len(loads)))
        ax.set_xticklabels(loads)
        ax.set_xlabel("threads (T/P: a pool of P; @N: N in flight, idem::asio)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}".replace(",", " ")))
    for row in axes:
        row[0].set_ylabel("calls per second")
    handles, labels = [], []
    for ax in flat:  # every side that ran in some panel (replay-cached has no async series)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=9)
    seconds, rounds = data.get("seconds_per_case"), data.get("rounds")
    server = ", ".join(data.get("server", "").split(", ")[:2])
    fig.suptitle(f"idem-bench: {seconds} s per case and side in {rounds} rounds; {server}", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    fig.savefig(out, metadata={"Date": None} if out.endswith(".svg") else None)
    print(out)


if __name__ == "__main__":
    main()
