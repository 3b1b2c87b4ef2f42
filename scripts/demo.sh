#!/usr/bin/env bash
# The README's demo command: the payments example (two payments-server instances sharing one
# throwaway PostgreSQL, the reference article's closing test). See scripts/payments-demo.sh.
# It also builds the smaller examples the README runs next:
#   scripts/with-postgres.sh build/debug/examples/quickstart/quickstart
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec scripts/payments-demo.sh "$@"
