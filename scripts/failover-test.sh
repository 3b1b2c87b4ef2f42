#!/usr/bin/env bash
# Failover test: a 2-node Patroni + etcd cluster on loopback; the leader is killed under load.
#
# Usage: scripts/failover-test.sh [--driver PATH] [--mode sync|async|both] [--rounds N]
#                                 [--threads N] [--timeout SECONDS]
#
#   sync (the test): synchronous_mode: true; N rounds (default 2) of: wait for Leader + Sync
#     Standby, load, kill -9 the leader (its Patroni and every PostgreSQL process of the node:
#     machine loss), wait for the first successful execute_once, restart the killed node (it rejoins
#     as a replica). Fails if an acknowledged save was lost, an effect ran twice, a replay was not
#     byte-identical, or the cluster did not recover.
#   async (negative control, informational, never fails): synchronous_mode: false, 1 round.
#   both (default): sync, then async.
#
# The load is tests/failover/failover_driver.cpp (8 threads, execute_once on fresh keys, plain
# and in-transaction mode, conninfo "host=127.0.0.1,127.0.0.1 port=P1,P2 ...
# target_session_attrs=read-write"); it prints the figures (calls, keys, time to recover,
# anomalies). Without --driver it is built in build/failover (cmake, g++).
# Needs root: installs patroni, etcd-server, etcd-client (apt) if missing, and runs etcd, Patroni
# and PostgreSQL 15 as the `postgres` user in a temp dir on free loopback ports. Everything is
# bounded (--timeout, default 540 s for the whole script) and always cleaned up: on any exit, and
# by a reaper in a session of its own if this script is killed outright (SIGKILL).
# Whatever ran before does not matter: every daemon starts in the temp dir (Patroni's PostgreSQL
# start fails in a working directory the postgres user cannot enter, e.g. a CI checkout in a private
# folder), with stdin from /dev/null, no inherited file descriptor above 2, in a session of its own,
# on ports outside the kernel's ephemeral range.
# Environment: IDEM_FAILOVER_TMPDIR (parent of the temp dir, default /tmp), IDEM_PG_BIN,
# IDEM_FAILOVER_KEEP_LOGS=1 (keep the temp dir with the etcd/Patroni/driver logs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"

driver=""
mode=both
rounds=2
threads=8
overall_timeout=540
while (($# > 0)); do
    case "$1" in
        --driver) driver="${2:?}"; shift ;;
        --driver=*) driver="${1#*=}" ;;
        --mode) mode="${2:?}"; shift ;;
        --mode=*) mode="${1#*=}" ;;
        --rounds) rounds="${2:?}"; shift ;;
        --rounds=*) rounds="${1#*=}" ;;
        --threads) threads="${2:?}"; shift ;;
        --threads=*) threads="${1#*=}" ;;
        --timeout) overall_timeout="${2:?}"; shift ;;
        --timeout=*) overall_timeout="${1#*=}" ;;
        -h | --help) sed -n '2,25s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "failover-test: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
case "$mode" in sync | async | both) ;; *) echo "failover-test: --mode sync|async|both" >&2; exit 2 ;; esac

PG_BIN="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}"
PY=/usr/bin/python3
script_start=$SECONDS
log() { printf '[failover %4ds] %s\n' "$((SECONDS - script_start))" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }

if [[ "$(id -u)" -ne 0 ]]; then
    die "must run as root (runs PostgreSQL, Patroni and etcd as the postgres user)"
fi

# ---- dependencies ------------------------------------------------------------------------------
need=()
command -v patroni >/dev/null 2>&1 || need+=(patroni)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
[[ -x "$PG_BIN/postgres" ]] || need+=(postgresql-15)
if ((${#need[@]} > 0)); then
    log "installing ${need[*]} (apt)"
    # Keep the packages' init scripts from starting a system-wide etcd/patroni.
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
fi
id postgres >/dev/null 2>&1 || die "OS user postgres missing (install postgresql-15)"

# ---- the driver --------------------------------------------------------------------------------
if [[ -z "$driver" ]]; then
    log "building the driver in build/failover"
    cmake -S . -B build/failover -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIDEM_BUILD_TESTS=ON \
        -DIDEM_BUILD_EXAMPLES=OFF -DIDEM_BUILD_BENCH=OFF -DIDEM_INSTALL=OFF >/dev/null
    cmake --build build/failover -j2 --target idem_failover_driver >/dev/null
    driver="$repo/build/failover/tests/failover/idem_failover_driver"
fi
[[ -x "$driver" ]] || die "driver $driver not found"
driver="$(realpath "$driver")" # daemons start in the temp dir

# ---- state and cleanup -------------------------------------------------------------------------
tmp=""
declare -a patroni_pid=("" "" "")
etcd_pid=""
driver_pid=""
watchdog_pid=""

descendants() {
    local kid
    for kid in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$kid"
        descendants "$kid"
    done
}

# Kill PostgreSQL of node $1 (postmaster and all its processes), by pid.
kill_postgres() {
    local pidfile="$tmp/node$1/data/postmaster.pid" pm
    [[ -f "$pidfile" ]] || return 0
    pm="$(head -n 1 "$pidfile" 2>/dev/null || true)"
    if [[ "$pm" =~ ^[0-9]+$ ]] && kill -0 "$pm" 2>/dev/null; then
        local -a kids
        mapfile -t kids < <(descendants "$pm")
        kill -KILL "$pm" "${kids[@]}" 2>/dev/null || true
    fi
}

# Kills a daemon started by start_daemon: its whole process group (Patroni's helper processes
# too), then reaps it.
kill_daemon() {
    [[ -n "$1" ]] || return 0
    { kill -KILL -- "-$1" || kill -KILL "$1"; wait "$1"; } 2>/dev/null || true
}

kill_node() {
    local i=$1
    kill_daemon "${patroni_pid[$i]}"
    patroni_pid[$i]=""
    kill_postgres "$i"
}

# Last sweep over what the temp dir names: every process whose command line contains DIR (etcd,
# Patroni, postmasters, pg_basebackup, the driver) and the PostgreSQL processes of every
# postmaster.pid in it, killed by pid. Self-contained: the reaper runs it too (declare -f).
# shellcheck disable=SC2317 # cleanup (trap) and the reaper
sweep_tmp() {
    local dir=$1 pidfile pm p cmd
    [[ -n "$dir" && -d "$dir" ]] || return 0
    for pidfile in "$dir"/node*/data/postmaster.pid; do
        [[ -f "$pidfile" ]] || continue
        pm="$(head -n 1 "$pidfile" 2>/dev/null || true)"
        if [[ "$pm" =~ ^[0-9]+$ ]] && kill -0 "$pm" 2>/dev/null; then
            local -a kids
            mapfile -t kids < <(ps -o pid= --ppid "$pm" 2>/dev/null)
            kill -KILL "$pm" "${kids[@]}" 2>/dev/null || true
        fi
    done
    for p in /proc/[0-9]*; do
        [[ "${p#/proc/}" == "$$" || "${p#/proc/}" == "$BASHPID" ]] && continue
        cmd="$( { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null || true)"
        if [[ "$cmd" == *"$dir"* ]]; then
            kill -KILL "${p#/proc/}" 2>/dev/null || true
        fi
    done
}

teardown_cluster() {
    if [[ -n "$driver_pid" ]]; then
        kill -TERM "$driver_pid" 2>/dev/null || true
        wait "$driver_pid" 2>/dev/null || true
        driver_pid=""
    fi
    kill_node 1
    kill_node 2
    kill_daemon "$etcd_pid"
    etcd_pid=""
}

reaper_pid=""

# shellcheck disable=SC2317 # trap
cleanup() {
    local rc=$?
    trap '' INT TERM HUP
    teardown_cluster
    kill_daemon "$reaper_pid"
    sweep_tmp "$tmp"
    if [[ -n "$watchdog_pid" ]]; then
        local -a w
        mapfile -t w < <(descendants "$watchdog_pid")
        kill "$watchdog_pid" "${w[@]}" 2>/dev/null || true
    fi
    if [[ -n "$tmp" && -d "$tmp" ]]; then
        if [[ -n "${IDEM_FAILOVER_KEEP_LOGS:-}" ]]; then
            log "logs kept in $tmp"
        else
            rm -rf "$tmp"
        fi
    fi
    log "total time $((SECONDS - script_start)) s (exit $rc)"
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "overall timeout or SIGTERM"; exit 143' TERM
trap 'log "SIGHUP"; exit 129' HUP

# The whole script is bounded (the watchdog keeps no descriptor of the caller's open).
(sleep "$overall_timeout" && kill -TERM $$ 2>/dev/null) </dev/null >/dev/null 2>&1 &
watchdog_pid=$!

tmp="$(mktemp -d "${IDEM_FAILOVER_TMPDIR:-/tmp}/idem-failover.XXXXXX")"
chmod 0755 "$tmp"
chown postgres: "$tmp"

# Runs a command as postgres (setpriv and env exec it: the pid stays the command's).
as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups --
       env -i PATH=/usr/bin:/bin HOME="$tmp" LANG=C.UTF-8 LC_ALL=C.UTF-8)

# start_daemon LOG COMMAND... — starts COMMAND in the background, detached from everything this
# script inherited, and sets daemon_pid to its pid (which is also its session and group id):
#   * working directory $tmp. Patroni starts PostgreSQL through a multiprocessing "spawn" child
#     that first changes to Patroni's working directory; where the postgres user cannot enter it
#     (the script's own, a checkout in a private folder) the child dies before it answers and
#     Patroni waits on the pipe for ever ("bootstrap in progress", a defunct python3 child);
#   * stdin /dev/null, stdout and stderr appended to LOG, no other file descriptor: nothing keeps a
#     test runner's pipe or log open, however long a daemon lives;
#   * a session of its own (setsid), so that cleanup can kill its whole process group.
detach=("$PY" -c 'import os, sys
os.closerange(3, os.sysconf("SC_OPEN_MAX"))
os.setsid()
os.execvp(sys.argv[1], sys.argv[1:])')
start_daemon() {
    local log=$1
    shift
    (cd "$tmp" && exec "${detach[@]}" "$@" </dev/null >>"$log" 2>&1) &
    daemon_pid=$!
}

# If this script is killed outright (SIGKILL: a test runner's timeout), its EXIT trap never runs:
# the reaper, in a session of its own, waits for it to go and then sweeps the temp dir.
# shellcheck disable=SC2016 # expanded by the reaper's bash
start_daemon /dev/null bash -c "$(declare -f sweep_tmp)"'
    trap "" HUP INT TERM
    while kill -0 "$1" 2>/dev/null; do sleep 1; done
    kill "$3" 2>/dev/null
    sweep_tmp "$2"
    [[ -n "$4" ]] || rm -rf "$2"' idem-failover-reaper "$$" "$tmp" "$watchdog_pid" "${IDEM_FAILOVER_KEEP_LOGS:-}"
reaper_pid=$daemon_pid

# N free loopback ports below the kernel's ephemeral range, which outgoing connections (the
# driver's, Patroni's, psql's) draw their local ports from: none of them can take one between this
# check and the daemon's bind.
free_ports() {
    "$PY" - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
socks = []
while len(socks) < int(sys.argv[1]):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(20000, max(low, 20001))))
        socks.append(s)
    except OSError:
        s.close()
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# "leader sync_standby replicas" from Patroni's REST API (any node that answers), '-' when absent.
cluster_state() {
    "$PY" - "${rest_port[1]}" "${rest_port[2]}" <<'PY'
import json, sys, urllib.request
for port in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster", timeout=2) as r:
            c = json.load(r)
    except Exception:
        continue
    ok = ("running", "streaming")
    leader = [m["name"] for m in c["members"] if m["role"] == "leader" and m.get("state") == "running"]
    sync = [m["name"] for m in c["members"] if m["role"] == "sync_standby" and m.get("state") in ok]
    reps = [m["name"] for m in c["members"] if m["role"] in ("replica", "sync_standby") and m.get("state") in ok]
    print(leader[0] if leader else "-", sync[0] if sync else "-", len(reps))
    sys.exit(0)
print("- - 0")
PY
}

psql_at() { # port sql
    PGCONNECT_TIMEOUT=2 psql -X -q -h 127.0.0.1 -p "$1" -U postgres -d postgres -Atc "$2" 2>/dev/null
}

patronictl_list() {
    timeout 15 patronictl -c "$tmp/node1.yml" list 2>/dev/null | sed 's/^/    /' || true
}

# Waits (bounded) until there is a writable leader and, in sync mode, a Sync Standby streaming
# with sync_state = 'sync' (async: a streaming replica). Prints the leader's node number.
wait_ready() {
    local sync=$1 limit=$2 deadline=$((SECONDS + $2)) leader standby reps n port
    while ((SECONDS < deadline)); do
        read -r leader standby reps < <(cluster_state)
        if [[ "$leader" == node* ]]; then
            n="${leader#node}"
            port="${pg_port[$n]}"
            if [[ "$(psql_at "$port" "SELECT pg_is_in_recovery()")" == "f" ]]; then
                if ((sync)); then
                    if [[ "$standby" == node* ]] &&
                        [[ "$(psql_at "$port" "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync' AND state = 'streaming'")" -ge 1 ]]; then
                        echo "$n"
                        return 0
                    fi
                elif ((reps >= 1)) &&
                    [[ "$(psql_at "$port" "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")" -ge 1 ]]; then
                    echo "$n"
                    return 0
                fi
            fi
        fi
        sleep 0.5
    done
    log "cluster not ready after ${limit}s (leader=$leader sync_standby=$standby replicas=$reps)" >&2
    return 1
}

start_patroni() {
    local i=$1
    start_daemon "$tmp/node$i/patroni.log" "${as_pg[@]}" patroni "$tmp/node$i.yml"
    patroni_pid[$i]=$daemon_pid
}

write_patroni_config() { # node sync(true|false) label
    local i=$1
    mkdir -p "$tmp/node$i"
    chown postgres: "$tmp/node$i"
    chmod 0700 "$tmp/node$i"
    cat >"$tmp/node$i.yml" <<YAML
scope: idem-failover-$3
namespace: /idem-test/
name: node$i
restapi:
  listen: 127.0.0.1:${rest_port[$i]}
  connect_address: 127.0.0.1:${rest_port[$i]}
etcd3:
  hosts: 127.0.0.1:$etcd_client
bootstrap:
  dcs:
    # A leader whose loop a busy machine stalls for a few seconds keeps its lock (ttl), yet a
    # killed one is replaced within about ttl: loop_wait + 2 * retry_timeout <= ttl.
    ttl: 20
    loop_wait: 2
    retry_timeout: 6
    maximum_lag_on_failover: 16777216
    synchronous_mode: $2
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: 'on'
        wal_log_hints: 'on'
        max_wal_senders: 10
        max_replication_slots: 10
        max_connections: 100
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
    - auth: trust
postgresql:
  listen: 127.0.0.1:${pg_port[$i]}
  connect_address: 127.0.0.1:${pg_port[$i]}
  data_dir: $tmp/node$i/data
  bin_dir: $PG_BIN
  pgpass: $tmp/node$i/pgpass
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
  authentication:
    superuser: {username: postgres, password: postgres}
    replication: {username: replicator, password: replicator}
    rewind: {username: postgres, password: postgres}
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication replicator 127.0.0.1/32 trust
  parameters:
    unix_socket_directories: '$tmp/node$i'
    shared_buffers: 64MB
    fsync: 'on'
    synchronous_commit: 'on'
  basebackup:
    - checkpoint: fast
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
  nosync: false
YAML
    chown postgres: "$tmp/node$i.yml"
}

# ---- one scenario: cluster up, load, faults, verdict ---------------------------------------------
# run_scenario LABEL SYNC(0|1) ROUNDS → sets scenario_rc (driver exit status; 3 = harness failure).
# Whatever happens, the scenario's cluster is gone when it returns.
run_scenario() {
    scenario "$@"
    teardown_cluster
}

scenario() {
    local label=$1 sync=$2 nrounds=$3 sync_yaml=false
    ((sync)) && sync_yaml=true
    local t_start=$SECONDS
    log "=== $label: synchronous_mode=$sync_yaml, $nrounds round(s) ==="
    scenario_rc=3
    local ports
    read -r -a ports < <(free_ports 6)
    etcd_client=${ports[0]}
    local etcd_peer=${ports[1]}
    rest_port=("" "${ports[2]}" "${ports[3]}")
    pg_port=("" "${ports[4]}" "${ports[5]}")
    rm -rf "$tmp/etcd" "$tmp/node1" "$tmp/node2" "$tmp/control-$label"

    mkdir -p "$tmp/etcd" && chown postgres: "$tmp/etcd" && chmod 0700 "$tmp/etcd"
    start_daemon "$tmp/etcd/etcd.log" "${as_pg[@]}" etcd --name idem --data-dir "$tmp/etcd/data" \
        --listen-client-urls "http://127.0.0.1:$etcd_client" --advertise-client-urls "http://127.0.0.1:$etcd_client" \
        --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
        --initial-cluster "idem=http://127.0.0.1:$etcd_peer" --initial-cluster-state new
    etcd_pid=$daemon_pid
    local deadline=$((SECONDS + 60))
    until ETCDCTL_API=3 timeout 3 etcdctl --endpoints "127.0.0.1:$etcd_client" endpoint health >/dev/null 2>&1; do
        ((SECONDS < deadline)) || { tail -n 20 "$tmp/etcd/etcd.log" >&2; log "etcd did not start"; return 0; }
        sleep 0.3
    done
    log "etcd up on 127.0.0.1:$etcd_client"

    write_patroni_config 1 "$sync_yaml" "$label"
    write_patroni_config 2 "$sync_yaml" "$label"
    start_patroni 1
    sleep 2 # node1 bootstraps (initdb) first, node2 clones it
    start_patroni 2
    local leader
    if ! leader="$(wait_ready "$sync" 240)"; then
        tail -n 30 "$tmp/node1/patroni.log" "$tmp/node2/patroni.log" >&2
        return 0
    fi
    log "cluster ready after $((SECONDS - t_start)) s: leader node$leader (ports ${pg_port[1]},${pg_port[2]})"
    patronictl_list

    local ctl="$tmp/control-$label"
    mkdir -p "$ctl"
    local conninfo="host=127.0.0.1,127.0.0.1 port=${pg_port[1]},${pg_port[2]} dbname=postgres user=postgres target_session_attrs=read-write connect_timeout=2"
    start_daemon "$tmp/driver-$label.log" \
        "$driver" --conninfo "$conninfo" --control "$ctl" --threads "$threads" --max-seconds 400 --label "$label"
    driver_pid=$daemon_pid
    deadline=$((SECONDS + 60))
    until [[ -f "$ctl/ready" ]]; do
        if ((SECONDS >= deadline)) || ! kill -0 "$driver_pid" 2>/dev/null; then
            cat "$tmp/driver-$label.log" >&2
            log "driver did not start"
            return 0
        fi
        sleep 0.2
    done

    local round killed
    for ((round = 1; round <= nrounds; round++)); do
        if ((round > 1)); then
            if ! leader="$(wait_ready "$sync" 240)"; then
                log "round $round: no Leader + $( ((sync)) && echo 'Sync Standby' || echo 'replica') within 240 s"
                patronictl_list
                break
            fi
            log "round $round: leader node$leader, standby in sync again"
        fi
        sleep 5 # load on a healthy cluster
        killed=$leader
        log "round $round: kill -9 node$killed (Patroni + PostgreSQL), the leader"
        kill_node "$killed"
        date +%s%N >"$ctl/fault-$round.tmp" && mv "$ctl/fault-$round.tmp" "$ctl/fault-$round"
        deadline=$((SECONDS + 120))
        until [[ -f "$ctl/recovered-$round" ]] || ((SECONDS >= deadline)); do sleep 0.2; done
        if [[ -f "$ctl/recovered-$round" ]]; then
            log "round $round: first successful execute_once $(cat "$ctl/recovered-$round") ms after the kill"
        else
            log "round $round: NO successful execute_once within 120 s of the kill"
            patronictl_list
            break
        fi
        patronictl_list
        sleep 3 # load on the new leader
        if ((round < nrounds)); then
            log "round $round: restarting node$killed (rejoins as a replica)"
            start_patroni "$killed"
        fi
    done
    sleep 1
    touch "$ctl/stop"
    deadline=$((SECONDS + 150))
    while kill -0 "$driver_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    if kill -0 "$driver_pid" 2>/dev/null; then
        log "driver did not finish its checks in 150 s"
        kill -TERM "$driver_pid" 2>/dev/null || true
    fi
    set +e
    wait "$driver_pid"
    scenario_rc=$?
    set -e
    driver_pid=""
    cat "$tmp/driver-$label.log"
    log "=== $label: rounds=$((round > nrounds ? nrounds : round)) $(cat "$ctl/summary" 2>/dev/null || echo 'no summary') driver_exit=$scenario_rc scenario_time=$((SECONDS - t_start))s ==="
    teardown_cluster
}

overall=0
if [[ "$mode" == sync || "$mode" == both ]]; then
    run_scenario sync 1 "$rounds"
    sync_rc=$scenario_rc
    case $sync_rc in
        0) log "sync: PASS (no acknowledged save lost, no duplicate effect, every replay byte-identical)" ;;
        1) log "sync: FAIL (anomalies above)"; overall=1 ;;
        *) log "sync: FAIL (harness/driver error $sync_rc)"; overall=1 ;;
    esac
fi
if [[ "$mode" == async || "$mode" == both ]]; then
    run_scenario async 0 1
    case $scenario_rc in
        0) log "async (negative control): no anomaly observed this time (informational)" ;;
        1) log "async (negative control): anomalies observed, as asynchronous replication allows (informational)" ;;
        *) log "async (negative control): could not run (status $scenario_rc; informational)" ;;
    esac
fi
exit "$overall"
