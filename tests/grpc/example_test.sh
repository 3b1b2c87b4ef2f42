#!/usr/bin/env bash
# examples/grpc-payments as a user runs it: the server on the test database (under
# scripts/with-postgres.sh, IDEM_TEST_DATABASE_URL), then the client, whose four scenarios must all
# come out as expected; the server must have charged exactly once per key (two keys: the declined
# card charges nothing).
#
# Usage: tests/grpc/example_test.sh SERVER CLIENT
set -euo pipefail
server="$1"
client="$2"
: "${IDEM_TEST_DATABASE_URL:?run under scripts/with-postgres.sh}"

out="$(mktemp)"
pid=""
cleanup() {
    local rc=$?
    if [[ -n "$pid" ]]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -f "$out"
    exit "$rc"
}
trap cleanup EXIT

"$server" "$IDEM_TEST_DATABASE_URL" 0 >"$out" &
pid=$!
for _ in $(seq 1 600); do
    grep -q '^listening on ' "$out" && break
    kill -0 "$pid" 2>/dev/null || { echo "example test: the server exited" >&2; exit 1; }
    sleep 0.1
done
port="$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9][0-9]*\)$/\1/p' "$out")"
[[ -n "$port" ]] || { echo "example test: the server printed no port" >&2; cat "$out" >&2; exit 1; }

"$client" "127.0.0.1:$port"

charged="$(grep '^charged ' "$out" || true)"
echo "example test: the server's charges:"
echo "$charged"
lines="$(grep -c . <<<"$charged" || true)"
keys="$(awk '{print $3}' <<<"$charged" | sort -u | grep -c . || true)"
[[ "$lines" == 2 && "$keys" == 2 ]] ||
    { echo "example test: expected one charge for each of 2 keys, got $lines charges of $keys keys" >&2; exit 1; }
echo "example test: ok"
