#!/usr/bin/env bash
# Run a command against a throwaway redis-server (durable: appendonly yes, appendfsync always).
#
# Usage: scripts/with-redis.sh [--] COMMAND [ARGS...]
#
# Starts a private redis-server (unix socket only, in a fresh temp dir; as the `redis` user when
# run as root), exports
#   IDEM_TEST_REDIS_SOCKET  the server's unix socket, e.g. /tmp/idem-redis.X/redis.sock
#   IDEM_REDIS_DIR          its directory (AOF in appendonlydir/, log in redis.log)
#   IDEM_REDIS_PID          the server's pid
# runs COMMAND, then always stops the server and deletes the temp dir (also on failure or
# SIGINT/SIGTERM), and exits with COMMAND's exit status. Composes with scripts/with-postgres.sh:
#   scripts/with-postgres.sh scripts/with-redis.sh build/bench-rel/bench/idem-bench --store tiered
#
# If IDEM_TEST_REDIS_SOCKET is already set, nothing is started: COMMAND is just run.
# Environment knobs: IDEM_REDIS_SERVER (default: redis-server on PATH), IDEM_REDIS_TMPDIR (parent
# of the temp dir, default /tmp).
set -euo pipefail

log() { echo "with-redis: $*" >&2; }

if [[ "${1:-}" == "--" ]]; then
    shift
fi
if (($# == 0)); then
    sed -n '2,4s/^# \{0,1\}//p' "$0" >&2
    exit 2
fi

if [[ -n "${IDEM_TEST_REDIS_SOCKET:-}" ]]; then
    exec "$@"
fi

server_bin="${IDEM_REDIS_SERVER:-$(command -v redis-server || true)}"
if [[ -z "$server_bin" || ! -x "$server_bin" ]]; then
    log "redis-server not found; apt-get install redis-server (or set IDEM_REDIS_SERVER)"
    exit 1
fi

# Who runs the server: not root (a server that runs Lua scripts should not).
uid="$(id -u)"
run_as=()
if ((uid == 0)); then
    if ! id redis >/dev/null 2>&1; then
        log "running as root but OS user 'redis' does not exist"
        exit 1
    fi
    run_as=(setpriv --reuid=redis --regid=redis --init-groups --)
fi

tmpdir=""
server=""
child=""

# Print the pids of all descendants of process $1.
# shellcheck disable=SC2317 # used by cleanup (trap)
descendants() {
    local kid
    for kid in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$kid"
        descendants "$kid"
    done
}

# shellcheck disable=SC2317 # invoked via trap
cleanup() {
    local rc=$?
    trap '' INT TERM
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        # Terminate the command and everything it started (e.g. ctest and its tests).
        local -a pids
        mapfile -t pids < <(descendants "$child")
        kill -TERM "$child" "${pids[@]}" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    if [[ -n "$server" ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server" 2>/dev/null || true
        kill -CONT "$server" 2>/dev/null || true # a paused server handles SIGTERM only once it runs
        local i
        for ((i = 0; i < 100; ++i)); do
            kill -0 "$server" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$server" 2>/dev/null; then
            log "redis-server $server did not stop within 10 s; killing it"
            kill -KILL "$server" 2>/dev/null || true
        fi
        wait "$server" 2>/dev/null || true
    fi
    if [[ -n "$tmpdir" && -d "$tmpdir" ]]; then
        rm -rf "$tmpdir"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

tmpdir="$(mktemp -d "${IDEM_REDIS_TMPDIR:-/tmp}/idem-redis.XXXXXX")"
chmod 0755 "$tmpdir" # the socket must be reachable by the client (root or any user)
if ((uid == 0)); then
    chown redis: "$tmpdir"
fi
socket="$tmpdir/redis.sock"
logfile="$tmpdir/redis.log"

# setpriv execs redis-server, so $! is the server itself. stdin from /dev/null: the server must
# not take the command's input.
"${run_as[@]}" "$server_bin" --port 0 --unixsocket "$socket" --unixsocketperm 777 --dir "$tmpdir" \
    --daemonize no --logfile "$logfile" --save "" --appendonly yes --appendfsync always \
    --appenddirname appendonlydir </dev/null >"$tmpdir/stdout.log" 2>&1 &
server=$!

ping() {
    if command -v redis-cli >/dev/null 2>&1; then
        [[ "$(redis-cli -s "$socket" PING 2>/dev/null)" == "PONG" ]]
    else
        [[ -S "$socket" ]]
    fi
}
ready=0
for ((i = 0; i < 300; ++i)); do
    if ! kill -0 "$server" 2>/dev/null; then
        break
    fi
    if ping; then
        ready=1
        break
    fi
    sleep 0.1
done
if ((!ready)); then
    log "redis-server did not start; log tail:"
    tail -n 20 "$logfile" "$tmpdir/stdout.log" >&2 2>/dev/null || true
    exit 1
fi

export IDEM_TEST_REDIS_SOCKET="$socket"
export IDEM_REDIS_DIR="$tmpdir"
export IDEM_REDIS_PID="$server"
log "redis-server running: unix socket $socket (appendonly yes, appendfsync always)"

# Run the command in the background (stdin passed through explicitly) so that signals sent to
# this script are handled right away: the EXIT trap terminates the command, then cleans up.
set +e
if { true <&0; } 2>/dev/null; then
    "$@" <&0 &
else
    "$@" </dev/null & # stdin was closed
fi
child=$!
wait "$child"
status=$?
set -e
child=""
if ((status != 0)); then
    log "command exited with status $status"
fi
exit "$status"
