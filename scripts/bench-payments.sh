#!/usr/bin/env bash
# Speed comparison: payments-server (C++/idem) against the reference article's Express + pg server,
# same machine, same throwaway database, one run.
#
# Usage: scripts/bench-payments.sh [--duration SECONDS] [--rounds N] [--peer DIR] [--build-dir DIR]
#                                  [--server-args "ARGS"]
#
#   --duration   seconds per wrk run (default 8)
#   --rounds     runs per figure, alternating the two servers; the median is reported (default 3)
#   --peer       the Express peer (default ../shared/peers/express-seed003, relative to the repo)
#   --build-dir  release build directory (default build/release)
#   --server-args  extra payments-server options, e.g. "--replay-cache-mb 0 --group-commit off"
#
# For each server: the new-payment path (wrk new.lua: a fresh key per request) and the replay path
# (wrk replay.lua: keys replay-1..100, each sent once first), at 1, 16 and 64 connections (wrk -t1,
# gateway latency 0). Targets: new payments 1.5x Express at 1 connection and 2x at 16 and 64,
# replays 4x at each. The two servers take turns (Express, ours, Express, ours, ...) so that a change
# in the machine's load during the run hits both alike. Prints the figures as Markdown for
# docs/benchmarks.md on stdout (progress on stderr), with the CPU time per request of each server
# process and of the PostgreSQL cluster (where the two cores went) and the transactions that wrote
# per request (how many commits group commit saved); exits 1 if a target ratio was missed.
# Needs wrk, node and npm (the Express side is skipped if npm or node is missing).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$(pwd)"

duration=8
rounds=3
peer="$repo/../shared/peers/express-seed003"
build_dir=build/release
server_args=""
inner=0
while (($# > 0)); do
    case "$1" in
        --duration) duration="${2:?}"; shift ;;
        --duration=*) duration="${1#*=}" ;;
        --rounds) rounds="${2:?}"; shift ;;
        --rounds=*) rounds="${1#*=}" ;;
        --peer) peer="${2:?}"; shift ;;
        --peer=*) peer="${1#*=}" ;;
        --build-dir) build_dir="${2:?}"; shift ;;
        --build-dir=*) build_dir="${1#*=}" ;;
        --server-args) server_args="${2?}"; shift ;;
        --server-args=*) server_args="${1#*=}" ;;
        --inner) inner=1 ;;
        -h | --help) sed -n '2,22s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "bench-payments: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

step() { printf '\n==> %s\n' "$*" >&2; }

if ((!inner)); then
    command -v wrk >/dev/null || { echo "bench-payments: wrk not found (apt-get install wrk)" >&2; exit 1; }
    [[ -f "$peer/server.js" ]] || { echo "bench-payments: Express peer not found at $peer" >&2; exit 1; }
    step "Building payments-server (Release, $build_dir)"
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_BENCH=OFF \
        -DIDEM_BUILD_EXAMPLES=ON >/dev/null
    cmake --build "$build_dir" -j"$(nproc)" --target payments-server payments-client >/dev/null

    peer_dir="$(mktemp -d "${TMPDIR:-/tmp}/express-peer.XXXXXX")"
    trap 'rm -rf "$peer_dir"' EXIT
    cp -r "$peer"/. "$peer_dir"/
    if command -v npm >/dev/null && command -v node >/dev/null; then
        step "npm install (Express peer, in $peer_dir)"
        if ! (cd "$peer_dir" && npm install --no-audit --no-fund --loglevel=error >&2); then
            echo "bench-payments: npm install failed; the Express side is skipped" >&2
            rm -rf "$peer_dir/node_modules"
        fi
    else
        echo "bench-payments: npm or node not found; the Express side is skipped" >&2
    fi
    scripts/with-postgres.sh "$0" --inner --duration "$duration" --rounds "$rounds" --peer "$peer_dir" \
        --build-dir "$build_dir" --server-args "$server_args"
    exit $?
fi

# ---- inside scripts/with-postgres.sh: a throwaway cluster, IDEM_PG_HOST / IDEM_PG_PORT ----
server="$build_dir/examples/payments/payments-server"
client="$build_dir/examples/payments/payments-client"
work="$(mktemp -d "${TMPDIR:-/tmp}/bench-payments.XXXXXX")"
pids=()
cleanup() {
    local rc=$?
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT

free_port() {
    local port
    while :; do
        port=$((20000 + RANDOM % 20000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
    done
}

wait_http() { # wait_http PORT NAME: until something answers HTTP on the port
    for _ in $(seq 200); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        sleep 0.05
    done
    echo "bench-payments: $2 did not start" >&2
    cat "$work/$2.log" >&2 || true
    exit 1
}

have_express=0
[[ -d "$peer/node_modules" ]] && have_express=1

declare -A url
step "Starting payments-server (Release)"
port="$(free_port)"
read -r -a extra_args <<<"$server_args"
"$server" --listen "127.0.0.1:$port" --db "$IDEM_TEST_DATABASE_URL" --gateway-latency-ms 0 "${extra_args[@]}" \
    >"$work/idem.out" 2>"$work/idem.log" &
pids+=($!)
declare -A pid_of
pid_of[idem]=$!
wait_http "$port" idem
url[idem]="http://127.0.0.1:$port"

if ((have_express)); then
    step "Starting the Express peer"
    psql "$IDEM_TEST_DATABASE_URL" -q -v ON_ERROR_STOP=1 -f "$peer/schema.sql" >/dev/null
    port="$(free_port)"
    (cd "$peer" && PGHOST="$IDEM_PG_HOST" PGPORT="$IDEM_PG_PORT" PGUSER=postgres PGDATABASE=postgres \
        PORT="$port" exec node server.js) >"$work/express.log" 2>&1 &
    pids+=($!)
    pid_of[express]=$!
    wait_http "$port" express
    url[express]="http://127.0.0.1:$port"
fi

declare -A identical
servers=(idem)
((have_express)) && servers=(express idem)

step "Warming the replay keys (replay-1..100) on each server"
for s in "${servers[@]}"; do
    for i in $(seq 100); do
        "$client" --url "${url[$s]}" --account acct_bench --key "replay-$i" --order 123 --amount 25000 \
            --currency BRL --card tok_ok --max-retries 3 >"$work/$s.warm.$i" 2>/dev/null
    done
    # Byte-identity of a replay: the first answer vs. a later replay of the same key.
    "$client" --url "${url[$s]}" --account acct_bench --key replay-1 --order 123 --amount 25000 \
        --currency BRL --card tok_ok >"$work/$s.replay.1" 2>/dev/null || true
    if [[ "$(sed -n 2p "$work/$s.warm.1")" == "$(sed -n 2p "$work/$s.replay.1")" ]]; then
        identical[$s]=yes
    else
        identical[$s]=no
    fi
    echo "$s: first  $(sed -n 2p "$work/$s.warm.1")" >&2
    echo "$s: replay $(sed -n 2p "$work/$s.replay.1")" >&2
done

# CPU time (clock ticks, user + system) used so far by the given pids and their threads.
ticks_of() {
    local t=0 p v
    for p in "$@"; do
        v="$(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)"
        t=$((t + v))
    done
    echo "$t"
}
# CPU time used so far by the PostgreSQL cluster: the postmaster, the processes under it now, and
# those it has reaped (a backend that ended: the Express peer's pool closes a connection idle for
# 10 s, and opens a new one at its next run).
postgres_ticks() {
    local pm
    pm="$(head -n1 "$IDEM_PG_DATA/postmaster.pid")"
    echo $(($(awk '{ print $14 + $15 + $16 + $17 }' "/proc/$pm/stat") + $(ticks_of $(pgrep -P "$pm"))))
}
# Transactions that wrote so far: for payments-server, idem's claim and save transactions (its
# /metrics: a call that went alone is one, a group commit one for all its calls) and the gateway's
# ledger rows (one commit each); for Express, three per payment (its claim INSERT, its charge
# INSERT, its UPDATE, each a statement of its own) — its peer_charges rows times three.
writes_of() {
    if [[ $1 == idem ]]; then
        local ledger
        ledger="$(psql "$IDEM_TEST_DATABASE_URL" -Atc 'SELECT count(*) FROM gateway_charges')"
        curl -s "${url[idem]}/metrics" | awk -v ledger="$ledger" '
            $1 == "idem_store_claims_total" { c = $2 } $1 == "payments_store_saves_total" { s = $2 }
            $1 == "payments_group_commit_claim_groups_total" { cg = $2 }
            $1 == "payments_group_commit_grouped_claims_total" { gc = $2 }
            $1 == "payments_group_commit_save_groups_total" { sg = $2 }
            $1 == "payments_group_commit_grouped_saves_total" { gs = $2 }
            END { print c - gc + cg + s - gs + sg + ledger }'
    else
        psql "$IDEM_TEST_DATABASE_URL" -Atc 'SELECT 3 * count(*) FROM peer_charges'
    fi
}
hz="$(getconf CLK_TCK)"

# run_wrk SERVER SCRIPT CONNECTIONS ROUND
#   → "req/s p50_ms non2xx server_cpu_us_per_req pg_cpu_us_per_req writes_per_req"
# (CPU per request: the server process's and the PostgreSQL cluster's CPU time during the wrk run,
# divided by the requests wrk completed — where the two cores went; writes: writes_of)
run_wrk() {
    local out="$work/wrk.$1.$2.$3.$4" s0 s1 p0 p1 w0 w1
    # Every run starts right after a checkpoint: the first change to each page after one writes the
    # whole page to the WAL, so throughput climbs for minutes after a checkpoint; starting each run
    # at the same point of that cycle gives both servers the same conditions.
    psql "$IDEM_TEST_DATABASE_URL" -qc CHECKPOINT
    w0="$(writes_of "$1")"
    s0="$(ticks_of "${pid_of[$1]}")"; p0="$(postgres_ticks)"
    wrk -t1 -c"$3" -d"${duration}s" --latency -s "$peer/$2.lua" "${url[$1]}" >"$out" 2>&1 || true
    s1="$(ticks_of "${pid_of[$1]}")"; p1="$(postgres_ticks)"
    w1="$(writes_of "$1")"
    awk -v st=$((s1 - s0)) -v pt=$((p1 - p0)) -v wr=$((w1 - w0)) -v hz="$hz" '
        function ms(v) { if (v ~ /us$/) return v / 1000; if (v ~ /ms$/) return v + 0; if (v ~ /s$/) return v * 1000; return v }
        /^Requests\/sec:/ { rps = $2 }
        / requests in / { n = $1 }
        $1 == "50%" { p50 = ms($2) }
        /Non-2xx or 3xx responses:/ { bad = $5 }
        END { n = n > 0 ? n : 1
              printf "%d %.2f %d %d %d %.2f\n", rps + 0.5, p50, bad + 0, st * 1e6 / hz / n, pt * 1e6 / hz / n, wr / n }' "$out"
}
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { print (NR ? v[int((NR + 1) / 2)] : 0) }'; }

declare -A runs_rps runs_p50 runs_scpu runs_pcpu runs_writes bad
load_start="$(cut -d' ' -f1 /proc/loadavg)"
for c in 1 16 64; do
    for path in new replay; do
        for round in $(seq "$rounds"); do
            for s in "${servers[@]}"; do
                read -r r p b sc pc w < <(run_wrk "$s" "$path" "$c" "$round")
                runs_rps[$s.$path.$c]+=" $r"
                runs_p50[$s.$path.$c]+=" $p"
                runs_scpu[$s.$path.$c]+=" $sc"
                runs_pcpu[$s.$path.$c]+=" $pc"
                runs_writes[$s.$path.$c]+=" $w"
                bad[$s.$path.$c]=$((${bad[$s.$path.$c]:-0} + b))
                printf '   %-7s %-6s -c%-2s round %d: %6d req/s, p50 %s ms, non-2xx %d, CPU/req: server %d us, postgres %d us, writes/req %s\n' \
                    "$s" "$path" "$c" "$round" "$r" "$p" "$b" "$sc" "$pc" "$w" >&2
            done
        done
    done
done
declare -A rps p50 scpu pcpu writes
for k in "${!runs_rps[@]}"; do
    writes[$k]="$(median <<<"${runs_writes[$k]}")"
    rps[$k]="$(median <<<"${runs_rps[$k]}")"
    p50[$k]="$(median <<<"${runs_p50[$k]}")"
    scpu[$k]="$(median <<<"${runs_scpu[$k]}")"
    pcpu[$k]="$(median <<<"${runs_pcpu[$k]}")"
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }'; }
fmt() { awk -v a="$1" 'BEGIN { printf "%d", a + 0.5 }'; }

load_end="$(cut -d' ' -f1 /proc/loadavg)"
cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)"
pg="$(psql "$IDEM_TEST_DATABASE_URL" -Atc 'show server_version' 2>/dev/null || echo '?')"
echo
echo "## payments-server vs. the article's Express server ($(date -u +%Y-%m-%d))"
echo
echo "Machine: $(nproc) cores ($cpu), PostgreSQL $pg on a Unix socket (fsync on, synchronous_commit on),"
echo "wrk -t1 -d${duration}s, gateway latency 0, both servers and wrk on the same machine and database;"
echo "each figure is the median of $rounds runs, the servers taking turns, each run right after a CHECKPOINT."
echo "Load average (1 min) at start / end: $load_start / $load_end."
echo "Express: node $(node --version 2>/dev/null || echo '-'), express 5, pg 8, pool 8."
echo "payments-server: Release build, defaults (one event-loop thread, Beast + idem::asio, 2 database connections for idem"
echo "and 32 for the gateway, group commit on, replay cache 64 MiB)${server_args:+, $server_args}. Writes/req: transactions that wrote, per request (Express: three per"
echo "payment; payments-server: idem's claim and save transactions, shared by group commit, and one ledger commit per payment)."
echo
echo "| path | connections | Express req/s (p50) | payments-server req/s (p50) | ratio | target | CPU µs/req Express / PostgreSQL | CPU µs/req payments-server / PostgreSQL | writes/req Express / payments-server |"
echo "|---|---|---|---|---|---|---|---|---|"
verdict=0
for path in new replay; do
    for c in 1 16 64; do
        target=2; [[ $path == new && $c == 1 ]] && target=1.5; [[ $path == replay ]] && target=4
        e="${rps[express.$path.$c]:-0}"
        i="${rps[idem.$path.$c]:-0}"
        r="$(ratio "$i" "$e")"
        ok="$(awk -v a="$i" -v b="$e" -v t="$target" 'BEGIN { if (b == 0) print "n/a"; else if (a >= t * b) print "met"; else print "MISSED" }')"
        [[ $ok == MISSED ]] && verdict=1
        label="new payment"; [[ $path == replay ]] && label="replay"
        echo "| $label | $c | $(fmt "$e") (${p50[express.$path.$c]:--} ms) | $(fmt "$i") (${p50[idem.$path.$c]:--} ms) | $r | ${target}x $ok | ${scpu[express.$path.$c]:--} / ${pcpu[express.$path.$c]:--} | ${scpu[idem.$path.$c]:--} / ${pcpu[idem.$path.$c]:--} | ${writes[express.$path.$c]:--} / ${writes[idem.$path.$c]:--} |"
    done
done
echo
for s in "${servers[@]}"; do
    for k in "${!bad[@]}"; do
        if [[ $k == "$s".* && "${bad[$k]}" != 0 ]]; then echo "Note: $s returned ${bad[$k]} non-2xx responses in run $k."; fi
    done
done
echo "Replay byte-identical to the first response: Express ${identical[express]:-n/a}, payments-server ${identical[idem]}."
exit "$verdict"
