#!/usr/bin/env bash
# Retention under load: idem-bench --retention-check for the plain table and for generations AT
# ONCE, each on its own throwaway cluster (scripts/with-postgres.sh), so that both see the same
# machine noise; then bench/retention_plot.py draws the figure and prints the summary table
# (docs/benchmarks.md, "Retention under load").
#
# Usage: bench/retention.sh [SECONDS [STEADY_AFTER]]     default 1200 300 (20 minutes)
#   bench/retention.sh 150 90        a quick check that the tooling works
# Env: RETENTION_OUT (directory for the JSON and logs, default build/retention),
#      RETENTION_SVG (default docs/retention.svg), IDEM_BENCH_BUILD_DIR (as bench/run.sh).
# The database servers run at normal priority, both the same: compare them with each other, not
# with figures taken on another machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds="${1:-1200}"
steady="${2:-300}"
out="${RETENTION_OUT:-build/retention}"
svg="${RETENTION_SVG:-docs/retention.svg}"
build_dir="${IDEM_BENCH_BUILD_DIR:-build/bench-release}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_BENCH=ON -DIDEM_BUILD_TESTS=OFF \
    -DIDEM_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build_dir" --target idem-bench -j"$(nproc)" >/dev/null
mkdir -p "$out"
pids=()
for layout in plain generations; do
    scripts/with-postgres.sh "$build_dir/bench/idem-bench" --retention-check "$layout" \
        --retention-duration "$seconds" --steady-after "$steady" --retention 60 --generation-length 15 \
        --purge-every 5 --sample-every 10 --retention-threads 16 --json "$out/$layout.json" \
        >"$out/$layout.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
if ((status != 0)); then
    echo "retention.sh: a run failed; see $out/plain.log and $out/generations.log" >&2
    tail -n 5 "$out/plain.log" "$out/generations.log" >&2
    exit "$status"
fi
/usr/bin/python3 bench/retention_plot.py "$out/plain.json" "$out/generations.json" "$svg"
