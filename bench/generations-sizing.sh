#!/usr/bin/env bash
# Generations sizing: can purge_expired() keep up, at which generation length? idem-bench
# --generations-sizing with 64 threads of new calls on a throwaway cluster (scripts/with-postgres.sh),
# one run per length; docs/design.md ("Generations", sizing) quotes its table.
#
# Usage: bench/generations-sizing.sh [LENGTHS_MS [SECONDS [THREADS]]]   default 100,250,500,1000,2000 60 64
# Env: IDEM_BENCH_BUILD_DIR (default build/bench-release), SIZING_RETENTION (s, default 10),
#      SIZING_AHEAD (default 4).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
lengths="${1:-100,250,500,1000,2000}"
seconds="${2:-60}"
threads="${3:-64}"
build_dir="${IDEM_BENCH_BUILD_DIR:-build/bench-release}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_BENCH=ON -DIDEM_BUILD_TESTS=OFF \
    -DIDEM_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build_dir" --target idem-bench -j"$(nproc)" >/dev/null
exec scripts/with-postgres.sh "$build_dir/bench/idem-bench" --generations-sizing "$lengths" \
    --retention-duration "$seconds" --retention-threads "$threads" --retention "${SIZING_RETENTION:-10}" \
    --generation-ahead "${SIZING_AHEAD:-4}"
