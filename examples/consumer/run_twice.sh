#!/usr/bin/env bash
# CTest for examples/consumer: runs the consumer twice over events.ndjson, in a scope of its own.
#   scripts/with-postgres.sh examples/consumer/run_twice.sh build/dev/examples/consumer/consumer \
#       examples/consumer/events.ndjson
# The first run applies the 12 distinct events and skips the 5 duplicates; the second applies 0 and
# finds all 12 already applied; the balances are the same after both.
set -euo pipefail
consumer="$1"
events="$2"
: "${IDEM_TEST_DATABASE_URL:?run under scripts/with-postgres.sh}"
scope="consumer-test-$$-$RANDOM"

run() {
    "$consumer" --db "$IDEM_TEST_DATABASE_URL" --scope "$scope" "$events"
}
expect() {  # expect NAME OUTPUT LINE
    if ! grep -qxF -- "$3" <<<"$2"; then
        echo "FAIL ($1): expected the line: $3" >&2
        exit 1
    fi
}

first="$(run)"
echo "--- first run"
echo "$first"
second="$(run)"
echo "--- second run"
echo "$second"

balances="balances: alice 8800, bob 4600, carol 7050, dave 4000"
expect first "$first" "applied 12, skipped 5 (duplicates 5, already applied 0), failed 1, invalid 2"
expect first "$first" "$balances"
expect second "$second" "applied 0, skipped 17 (duplicates 5, already applied 12), failed 1, invalid 2"
expect second "$second" "$balances"
echo "OK"
