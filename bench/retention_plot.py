#!/usr/bin/python3
"""Draws docs/retention.svg from two runs of idem-bench --retention-check (plain and generations,
run at once by bench/retention.sh) and prints the summary tables (Markdown) that
docs/benchmarks.md ("Retention under load") quotes.

Usage: bench/retention_plot.py PLAIN.json GENERATIONS.json [OUT.svg]   (default docs/retention.svg)
Needs matplotlib (Debian: apt-get install -y python3-matplotlib; hence /usr/bin/python3).

WAL per expired key, from each run's pg_waldump --stats=record over its steady-state window (record
types as pg_waldump names them; "+INIT" variants count with their base type unless named):
  plain:       Heap/DELETE and Heap/LOCK (the purge's DELETE and its FOR UPDATE SKIP LOCKED: no
               other statement of this workload writes either), plus the vacuum and pruning records
               (VACUUM_TYPES) beyond what the generational run wrote per call for the same calls —
               its inserts and updates are the same and it deletes nothing, so its vacuum records
               per call are the workload's own; only the plain run's excess is charged to expiry
               (none when it has less).
  generations: its DDL, measured two ways. In the window, the record types that here come from DDL
               (DDL_TYPES: catalog row deletes, locks, updates and multi-inserts, in-place catalog
               updates, storage and index-build records, lock and invalidation records) — an
               estimate: the single-row catalog inserts of a new partition are Heap/INSERT and
               Btree/INSERT_LEAF records that pg_waldump's statistics do not tell from the calls'
               own, and a few Heap/UPDATE records may be the calls' own. And the upper bound held to
               the target: the WAL between the positions before and after each purge_expired() of
               the 45 s of purges after the calls stopped (every closed, dropped and created
               generation, plus whatever the server wrote meanwhile), per key removed.
  Filling fresh partitions: a new generation starts with empty heap pages and empty indexes, which
               grow by page initialisations and splits (GROWTH_TYPES), while the plain table reuses
               the space its vacuum frees. The generational run's excess of these per call over the
               plain run's is reported on its own, per expired key, next to the DDL.
"""
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "idem-bench-retention"
import matplotlib.pyplot as plt  # noqa: E402

VACUUM_TYPES = {
    "Heap2/PRUNE", "Heap2/VACUUM", "Heap2/FREEZE_PAGE", "Heap2/VISIBLE", "Btree/VACUUM", "Btree/DELETE",
    "Btree/UNLINK_PAGE", "Btree/UNLINK_PAGE_META", "Btree/MARK_PAGE_HALFDEAD", "Btree/REUSE_PAGE",
}
DELETE_TYPES = {"Heap/DELETE", "Heap/LOCK"}
DDL_TYPES = {
    "Heap/DELETE", "Heap/LOCK", "Heap/UPDATE", "Heap/INPLACE", "Heap/TRUNCATE", "Heap2/MULTI_INSERT",
    "Heap2/NEW_CID", "Standby/LOCK", "Standby/INVALIDATIONS", "Storage/CREATE", "Storage/TRUNCATE",
    "RelMap/UPDATE", "XLOG/FPI",
}
GROWTH_TYPES = {"Heap/INSERT+INIT", "Btree/SPLIT_L", "Btree/SPLIT_R", "Btree/NEWROOT", "Btree/INSERT_UPPER"}
COLORS = {"plain": "#d62728", "generations": "#1f77b4"}
LABELS = {"plain": "plain table (DELETE in batches)", "generations": "generations (DROP whole partitions)"}


def load(path):
    with open(path) as f:
        return json.load(f)


def by_type(run):
    return {w["type"]: w["combined"] for w in run["steady"]["waldump"]}


def total(types, names, base=True):
    """Bytes of the record types in `names`; with `base`, "X+INIT" counts as "X"."""
    return sum(v for k, v in types.items() if (k.split("+")[0] if base else k) in names)


def steady_samples(run):
    return [s for s in run["samples"] if s["t"] > run["steady"]["from_t"]]


def summary(run):
    st = steady_samples(run)
    sizes = [s["size_bytes"] / 1e6 for s in st]
    thirds = max(1, len(st) // 3)
    p99_first = statistics.median(s["p99_us"] for s in st[:thirds]) / 1000
    p99_last = statistics.median(s["p99_us"] for s in st[-thirds:]) / 1000
    calls = run["steady"]["calls"]
    # Least-squares slope of the size over the window, MB per minute.
    ts = [s["t"] for s in st]
    mt, ms = statistics.mean(ts), statistics.mean(sizes)
    slope = sum((t - mt) * (v - ms) for t, v in zip(ts, sizes)) / max(1e-9, sum((t - mt) ** 2 for t in ts)) * 60
    return {
        "calls_per_s": statistics.mean(s["calls"] / s["seconds"] for s in st),
        "p50_ms": statistics.median(s["p50_us"] for s in st) / 1000,
        "p99_ms": statistics.median(s["p99_us"] for s in st) / 1000,
        "p99_first": p99_first,
        "p99_last": p99_last,
        "size_min": min(sizes),
        "size_max": max(sizes),
        "size_first": sizes[0],
        "size_last": sizes[-1],
        "slope": slope,
        "wal_per_call": run["steady"]["wal_bytes"] / calls,
        "purged": run["steady"]["purged"],
        "calls": calls,
        "minutes": (st[-1]["t"] - run["steady"]["from_t"]) / 60,
    }


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plain, gen = load(sys.argv[1]), load(sys.argv[2])
    out = sys.argv[3] if len(sys.argv) > 3 else "docs/retention.svg"
    runs = {"plain": plain, "generations": gen}

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0][0], "table + indexes (MB)", lambda s: s["size_bytes"] / 1e6),
        (axes[0][1], "WAL bytes per call", lambda s: s["wal_bytes"] / s["calls"] if s["calls"] else float("nan")),
        (axes[1][0], "p99 latency (ms)", lambda s: s["p99_us"] / 1000),
        (axes[1][1], "calls/s", lambda s: s["calls"] / s["seconds"]),
    ]
    for ax, title, f in panels:
        for name, run in runs.items():
            xs = [s["t"] / 60 for s in run["samples"]]
            ax.plot(xs, [f(s) for s in run["samples"]], color=COLORS[name], label=LABELS[name], linewidth=1.2)
        ax.axvline(gen["steady"]["from_t"] / 60, color="#888888", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes (dotted: the steady-state window begins)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"Retention under load: {plain['threads']} threads of new calls, retention {plain['retention_s']} s, "
        f"purge_expired every {plain['purge_every_s']:g} s;\ngenerations of {gen['generation_length_s']:g} s "
        f"(both layouts at once, each on its own cluster)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    print(f"wrote {out}")

    sums = {name: summary(run) for name, run in runs.items()}
    print("\n| layout | calls/s | p50 ms | p99 ms (first → last third) | size MB (min–max; slope MB/min) "
          "| WAL B/call | keys purged |")
    print("|---|---|---|---|---|---|---|")
    for name, s in sums.items():
        print(f"| {name} | {s['calls_per_s']:.0f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} "
              f"({s['p99_first']:.1f} → {s['p99_last']:.1f}) | {s['size_min']:.0f}–{s['size_max']:.0f}; "
              f"{s['slope']:+.2f} | {s['wal_per_call']:.0f} | {s['purged']} |")
    window = sums["generations"]["minutes"]
    print(f"\n(steady-state window: {window:.1f} minutes of samples after {gen['steady']['from_t']:.0f} s)")

    # WAL per expired key.
    types = {name: by_type(run) for name, run in runs.items()}
    if not types["plain"] or not types["generations"]:
        print("\nno pg_waldump statistics (see the runs' logs)")
        return
    pc, gc = plain["steady"]["calls"], gen["steady"]["calls"]
    pk, gk = max(1, plain["steady"]["purged"]), max(1, gen["steady"]["purged"])
    tp, tg = types["plain"], types["generations"]
    plain_delete = total(tp, DELETE_TYPES)
    plain_excess = max(0.0, total(tp, VACUUM_TYPES) - total(tg, VACUUM_TYPES) / gc * pc)
    plain_key = (plain_delete + plain_excess) / pk
    gen_ddl_key = total(tg, DDL_TYPES) / gk
    growth_excess = max(0.0, total(tg, GROWTH_TYPES, base=False) - total(tp, GROWTH_TYPES, base=False) / pc * gc)
    growth_key = growth_excess / gk
    quiet = gen["quiet_purges"]
    q_rows = sum(q["rows"] for q in quiet)
    gen_quiet_key = sum(q["wal_bytes"] for q in quiet) / max(1, q_rows)
    pq = plain["quiet_purges"]
    plain_quiet = sum(q["wal_bytes"] for q in pq) / max(1, sum(q["rows"] for q in pq))

    print("\n| WAL in the steady-state window, bytes per call | plain | generations |")
    print("|---|---|---|")
    rows = [
        ("Heap/DELETE + Heap/LOCK", lambda t: total(t, DELETE_TYPES)),
        ("vacuum and pruning: " + ", ".join(sorted(VACUUM_TYPES)), lambda t: total(t, VACUUM_TYPES)),
        ("DDL record types other than those: " + ", ".join(sorted(DDL_TYPES - DELETE_TYPES)),
         lambda t: total(t, DDL_TYPES - DELETE_TYPES)),
        ("page initialisation and index growth: " + ", ".join(sorted(GROWTH_TYPES)),
         lambda t: total(t, GROWTH_TYPES, base=False)),
        ("everything", lambda t: sum(t.values())),
    ]
    for label, f in rows:
        print(f"| {label} | {f(tp) / pc:.1f} | {f(tg) / gc:.1f} |")

    print("\n| WAL per expired key | bytes |")
    print("|---|---|")
    print(f"| plain: Heap/DELETE + Heap/LOCK ({plain_delete / pk:.1f}) + vacuum beyond the generational run's "
          f"per call ({plain_excess / pk:.1f}) | {plain_key:.1f} |")
    print(f"| plain, purges alone after the calls (the DELETE and its locks, no vacuum; "
          f"{sum(q['rows'] for q in pq)} keys) | {plain_quiet:.1f} |")
    print(f"| generations: DDL record types in the window (estimate) | {gen_ddl_key:.2f} |")
    print(f"| generations: purges alone after the calls ({q_rows} keys in "
          f"{sum(1 for q in quiet if q['rows'] > 0)} generations; upper bound of the DDL) | {gen_quiet_key:.2f} |")
    print(f"| generations: filling fresh partitions, beyond the plain run's per call | {growth_key:.1f} |")
    ratio = gen_quiet_key / plain_key if plain_key else float("nan")
    with_growth = (gen_quiet_key + growth_key) / plain_key if plain_key else float("nan")
    print(f"\ngenerations' DDL / plain's expiry WAL per expired key: {ratio:.4f} "
          f"(target <= 0.1: {'met' if ratio <= 0.1 else 'MISSED'}); "
          f"with the fresh partitions' growth counted too: {with_growth:.3f}")
    g = sums["generations"]
    print(f"generations size in the window: {g['size_min']:.0f}–{g['size_max']:.0f} MB, slope {g['slope']:+.2f} MB/min; "
          f"plain: {sums['plain']['size_first']:.0f} → {sums['plain']['size_last']:.0f} MB, "
          f"slope {sums['plain']['slope']:+.2f} MB/min")
    for name, s in sums.items():
        print(f"{name}: p99 median of the first third {s['p99_first']:.1f} ms, of the last third {s['p99_last']:.1f} ms")


if __name__ == "__main__":
    main()
