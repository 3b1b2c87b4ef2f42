#!/usr/bin/env bash
# The README's demo: the reference article's closing test, against two payments-server instances
# sharing one throwaway PostgreSQL database.
#
# Usage: scripts/payments-demo.sh [--build-dir DIR]
#
#   1. one payment, sent twice one second apart with the same Idempotency-Key (the first answer
#      "got lost"), the two requests landing on different instances;
#   2. a burst of 10 simultaneous double clicks (20 requests, one key) spread over both instances;
# then the fake gateway's own ledger shows one charge per payment and every answer is identical.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=build/debug
inner=0
while (($# > 0)); do
    case "$1" in
        --build-dir) build_dir="${2:?--build-dir needs a value}"; shift ;;
        --build-dir=*) build_dir="${1#--build-dir=}" ;;
        --inner) inner=1 ;;
        -h | --help) sed -n '2,11s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "payments-demo: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

step() { printf '\n==> %s\n' "$*"; }

if ((!inner)); then
    step "Building payments-server, payments-client and the quickstart examples ($build_dir)"
    scripts/install-deps.sh --with-examples --with-asio  # payments-server is on Beast + idem::asio
    # Same configuration as scripts/test.sh, so the build directory is shared.
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DIDEM_WERROR=ON -DIDEM_BUILD_TESTS=ON \
        -DIDEM_BUILD_EXAMPLES=ON >/dev/null
    # quickstart and quickstart-http too: the README's next commands after the demo run them.
    cmake --build "$build_dir" -j"$(nproc)" --target payments-server payments-client quickstart quickstart-http
    exec scripts/with-postgres.sh "$0" --inner --build-dir "$build_dir"
fi

# ---- inside scripts/with-postgres.sh: IDEM_TEST_DATABASE_URL points at a throwaway cluster ----
server="$build_dir/examples/payments/payments-server"
client="$build_dir/examples/payments/payments-client"
work="$(mktemp -d "${TMPDIR:-/tmp}/payments-demo.XXXXXX")"
pids=()
cleanup() {
    local rc=$?
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

# Starts an instance on a free loopback port; sets $url.
start_instance() {
    local name=$1 out="$work/$1.out"
    "$server" --listen 127.0.0.1:0 --db "$IDEM_TEST_DATABASE_URL" --lease-ms 5000 --gateway-latency-ms 300 \
        --reconcile-every-ms 200 >"$out" 2>"$work/$name.log" &
    pids+=($!)
    for _ in $(seq 100); do
        if grep -q '^listening on ' "$out" 2>/dev/null; then
            url="$(sed -n 's/^listening on //p' "$out")"
            return 0
        fi
        sleep 0.1
    done
    echo "payments-demo: instance $name did not start:" >&2
    cat "$work/$name.log" >&2
    exit 1
}

# The gateway ledger's count for a key (GET /gateway/charges?idempotency_key=K).
charges() {
    local host_port=${1#http://} key=$2 reply
    exec 3<>"/dev/tcp/${host_port%:*}/${host_port##*:}"
    printf 'GET /gateway/charges?idempotency_key=%s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' \
        "$key" "$host_port" >&3
    reply="$(cat <&3)"
    exec 3<&-
    sed -n 's/.*"count":\([0-9]*\).*/\1/p' <<<"$reply"
}

pay() { # pay URL KEY ORDER [STDERR]  → prints the client's stdout (status line + body)
    "$client" --url "$1" --account acct_demo --key "$2" --order "$3" --amount 25000 --currency BRL \
        --card tok_ok 2>"${4:-/dev/null}"
}

step "Starting two payments-server instances on one database (fake card gateway: 300 ms per charge)"
start_instance a
A=$url
start_instance b
B=$url
echo "instance A: $A"
echo "instance B: $B"

step "1. Pay, lose the answer, retry one second later with the same key (on the other instance)"
key1="demo-$(date +%s)-$RANDOM-retry"
echo "\$ payments-client --url $A --account acct_demo --key $key1 --order 1001 --amount 25000 --currency BRL --card tok_ok"
first="$(pay "$A" "$key1" 1001)"
echo "$first"
sleep 1
echo "\$ (1 s later, same key) payments-client --url $B ..."
second="$(pay "$B" "$key1" 1001)"
echo "$second"
count1="$(charges "$A" "$key1")"
echo "gateway charges for this key: $count1"
body1="$(sed -n 2p <<<"$first")"
body2="$(sed -n 2p <<<"$second")"

step "2. Ten simultaneous double clicks (20 requests, one key) across both instances"
key2="demo-$(date +%s)-$RANDOM-burst"
for i in $(seq 20); do
    if ((i % 2)); then target=$A; else target=$B; fi
    pay "$target" "$key2" 1002 "$work/burst.$i.err" >"$work/burst.$i" &
done
wait_for_burst() { # wait only for the 20 clients, not the servers
    local pid
    for pid in $(jobs -p); do
        if [[ " ${pids[*]} " != *" $pid "* ]]; then wait "$pid" || true; fi
    done
}
wait_for_burst
busy="$(cat "$work"/burst.*.err | grep -c 'HTTP 409' || true)"
echo "answers while the first request was still running: $busy x 409 + Retry-After (the clients retried)"
echo "final answers:"
for i in $(seq 20); do head -n1 "$work/burst.$i"; done | sort | uniq -c | sed 's/^ */  /'
distinct="$(for i in $(seq 20); do sed -n 2p "$work/burst.$i"; done | sort -u | wc -l)"
count2="$(charges "$B" "$key2")"
echo "distinct response bodies: $distinct"
sed -n 2p "$work/burst.1"
echo "gateway charges for this key: $count2"

step "Stopping the instances (SIGTERM)"
status=0
for pid in "${pids[@]}"; do
    kill -TERM "$pid"
    wait "$pid" || status=$?
done
pids=()
echo "instances exited with status $status"

step "Result"
ok=1
[[ "$count1" == 1 && "$count2" == 1 ]] || ok=0
[[ -n "$body1" && "$body1" == "$body2" ]] || ok=0
[[ "$(head -n1 <<<"$second")" == "HTTP 201 (replayed)" ]] || ok=0
[[ "$distinct" == 1 ]] || ok=0
((status == 0)) || ok=0
if ((ok)); then
    echo "OK: one charge per payment at the gateway; every retry got the identical response."
    echo "next (README): scripts/with-postgres.sh $build_dir/examples/quickstart/quickstart"
else
    echo "FAILED: see above (server logs: instance stderr)" >&2
    cat "$work"/*.log >&2 || true
    exit 1
fi
