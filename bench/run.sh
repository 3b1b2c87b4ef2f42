#!/usr/bin/env bash
# Build idem-bench in Release and run it with the given arguments.
#
# Usage: bench/run.sh [IDEM-BENCH ARGS...]
#   bench/run.sh                                   the matrix (1,4,16 threads, 6 s) on a throwaway cluster
#   bench/run.sh --json /tmp/bench.json            same, figures also as JSON
#   bench/run.sh --db "host=/run/postgresql dbname=app"   against an existing database
#   bench/run.sh --help                            every option
# Without --db, idem-bench uses $IDEM_TEST_DATABASE_URL if set, else re-executes itself under
# scripts/with-postgres.sh (a private PostgreSQL 15 cluster, removed afterwards).
# Build directory: $IDEM_BENCH_BUILD_DIR, default build/bench-release (its own, so that its
# options — Release, bench on, tests and examples off — never fight another build's cache).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir="${IDEM_BENCH_BUILD_DIR:-build/bench-release}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_BENCH=ON -DIDEM_BUILD_TESTS=OFF \
    -DIDEM_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build_dir" --target idem-bench -j"$(nproc)" >/dev/null
exec "$build_dir/bench/idem-bench" "$@"
