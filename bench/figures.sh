#!/usr/bin/env bash
# Refreshes the figures at the top of docs/benchmarks.md: runs the matrix (bench/run.sh, Release,
# throwaway cluster unless --db), writes docs/benchmarks.json, puts its table into
# docs/benchmarks.md (bench/table.py --update-doc) and draws docs/benchmarks.svg (bench/plot.py).
#
# Usage: bench/figures.sh [IDEM-BENCH ARGS...]      default: --seconds 12 --rounds 6
#   bench/figures.sh --seconds 1 --rounds 1          a quick check that the tooling works
# Run it on a quiet machine: the figures are only as steady as the box.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
args=("$@")
((${#args[@]})) || args=(--seconds 12 --rounds 6)
bench/run.sh "${args[@]}" --json docs/benchmarks.json
bench/table.py --update-doc docs/benchmarks.md docs/benchmarks.json
/usr/bin/python3 bench/plot.py docs/benchmarks.json docs/benchmarks.svg
