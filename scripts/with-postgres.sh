#!/usr/bin/env bash
# Run a command against a throwaway PostgreSQL 15 cluster.
#
# Usage: scripts/with-postgres.sh [--] COMMAND [ARGS...]
#
# Starts a private cluster (unix socket only, in a fresh temp dir), exports
#   IDEM_TEST_DATABASE_URL  libpq conninfo, e.g. "host=/tmp/idem-pg.X port=54321 dbname=postgres user=postgres"
#   IDEM_PG_BIN             PostgreSQL binaries (default /usr/lib/postgresql/15/bin)
#   IDEM_PG_DATA            data directory of the cluster
#   IDEM_PG_CTL_USER        OS user owning the cluster (run pg_ctl as this user)
#   IDEM_PG_LOG             server log file
#   IDEM_PG_HOST / IDEM_PG_PORT  socket directory and port
# runs COMMAND, then always stops the server and deletes the temp dir (also on failure or
# SIGINT/SIGTERM), and exits with COMMAND's exit status.
#
# All server settings (port, socket dir, ...) live in the cluster's config, so a test can
# stop and restart the server with just:
#   runuser -u "$IDEM_PG_CTL_USER" -- "$IDEM_PG_BIN/pg_ctl" -D "$IDEM_PG_DATA" -m fast stop
#   runuser -u "$IDEM_PG_CTL_USER" -- "$IDEM_PG_BIN/pg_ctl" -D "$IDEM_PG_DATA" -l "$IDEM_PG_LOG" -w start
# (drop the runuser prefix when already running as that user).
#
# If IDEM_TEST_DATABASE_URL is already set, nothing is started: COMMAND is just run.
# Environment knobs: IDEM_PG_BIN, IDEM_PG_TMPDIR (parent of the temp dir, default /tmp),
# IDEM_PG_SHARED_BUFFERS (the server's shared_buffers, default 256MB; e.g. 4GB for a benchmark
# whose keys should fit in PostgreSQL's own cache).
set -euo pipefail

log() { echo "with-postgres: $*" >&2; }

if [[ "${1:-}" == "--" ]]; then
    shift
fi
if (($# == 0)); then
    sed -n '2,4s/^# \{0,1\}//p' "$0" >&2
    exit 2
fi

if [[ -n "${IDEM_TEST_DATABASE_URL:-}" ]]; then
    exec "$@"
fi

export IDEM_PG_BIN="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}"
shared_buffers="${IDEM_PG_SHARED_BUFFERS:-256MB}"
if [[ ! "$shared_buffers" =~ ^[0-9]+(kB|MB|GB)$ ]]; then
    log "IDEM_PG_SHARED_BUFFERS must be a size like 256MB or 4GB, not '$shared_buffers'"
    exit 2
fi
for tool in initdb pg_ctl postgres; do
    if [[ ! -x "$IDEM_PG_BIN/$tool" ]]; then
        log "$IDEM_PG_BIN/$tool not found; run scripts/install-deps.sh (needs postgresql-15)"
        exit 1
    fi
done

# Who owns and runs the server: initdb refuses to run as root.
uid="$(id -u)"
if ((uid == 0)); then
    pg_user=postgres
    if ! id "$pg_user" >/dev/null 2>&1; then
        log "running as root but OS user '$pg_user' does not exist"
        exit 1
    fi
else
    pg_user="$(id -un)"
fi

tmpdir=""
datadir=""
child=""
server_started=0

# Run a command as the cluster owner, from a directory it can access.
as_pg() {
    if ((uid == 0)); then
        (cd "$tmpdir" && runuser -u "$pg_user" -- "$@")
    else
        (cd "$tmpdir" && "$@")
    fi
}

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
    if [[ -n "$tmpdir" && -d "$tmpdir" ]]; then
        if [[ -n "$datadir" && -f "$datadir/postmaster.pid" ]]; then
            as_pg "$IDEM_PG_BIN/pg_ctl" -D "$datadir" -m immediate -w -t 60 stop \
                >/dev/null 2>&1 || true
            # Last resort if pg_ctl could not stop it.
            if [[ -f "$datadir/postmaster.pid" ]]; then
                local pid
                pid="$(head -n 1 "$datadir/postmaster.pid" 2>/dev/null || true)"
                if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
                    log "pg_ctl stop failed; killing postmaster $pid"
                    kill -KILL "$pid" 2>/dev/null || true
                    sleep 0.5
                fi
            fi
        elif ((server_started)); then
            log "note: server was already stopped"
        fi
        rm -rf "$tmpdir"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

tmpdir="$(mktemp -d "${IDEM_PG_TMPDIR:-/tmp}/idem-pg.XXXXXX")"
chmod 0755 "$tmpdir" # socket dir must be reachable by the client (root or any user)
if ((uid == 0)); then
    chown "$pg_user:" "$tmpdir"
fi
datadir="$tmpdir/data"
logfile="$tmpdir/postgres.log"
as_pg touch "$logfile"

# initdb with C.UTF-8 if available, else C.
initdb_log="$tmpdir/initdb.log"
initdb_ok=0
for locale in C.UTF-8 C; do
    if as_pg "$IDEM_PG_BIN/initdb" -D "$datadir" -A trust -U postgres --no-sync -E UTF8 \
        --locale="$locale" >"$initdb_log" 2>&1; then
        initdb_ok=1
        break
    fi
    as_pg rm -rf "$datadir"
done
if ((!initdb_ok)); then
    log "initdb failed:"
    cat "$initdb_log" >&2
    exit 1
fi

echo "include 'idem.conf'" >>"$datadir/postgresql.conf" # appended by root; ownership unchanged

write_conf() {
    as_pg tee "$datadir/idem.conf" >/dev/null <<CONF
# written by scripts/with-postgres.sh
listen_addresses = ''
unix_socket_directories = '$tmpdir'
port = $1
max_connections = 300
shared_buffers = $shared_buffers
fsync = on
synchronous_commit = on
log_min_messages = warning
CONF
}

port=""
for attempt in 1 2 3 4 5; do
    port=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
    write_conf "$port"
    log_offset="$(stat -c %s "$logfile")"
    if as_pg "$IDEM_PG_BIN/pg_ctl" -D "$datadir" -l "$logfile" -w -t 60 start >/dev/null 2>&1; then
        server_started=1
        break
    fi
    log "server start failed on port $port (attempt $attempt); log tail:"
    tail -c +"$((log_offset + 1))" "$logfile" | tail -n 20 >&2 || true
    # Make sure nothing half-started is left behind before retrying.
    as_pg "$IDEM_PG_BIN/pg_ctl" -D "$datadir" -m immediate -w stop >/dev/null 2>&1 || true
    port=""
done
if [[ -z "$port" ]]; then
    log "could not start PostgreSQL"
    exit 1
fi

conninfo_value() {
    # Quote a libpq conninfo value if needed.
    if [[ "$1" =~ ^[A-Za-z0-9_./+:@-]+$ ]]; then
        printf '%s' "$1"
    else
        local v="${1//\\/\\\\}"
        printf "'%s'" "${v//\'/\\\'}"
    fi
}

IDEM_TEST_DATABASE_URL="host=$(conninfo_value "$tmpdir") port=$port dbname=postgres user=postgres"
export IDEM_TEST_DATABASE_URL
export IDEM_PG_DATA="$datadir"
export IDEM_PG_CTL_USER="$pg_user"
export IDEM_PG_LOG="$logfile"
export IDEM_PG_HOST="$tmpdir"
export IDEM_PG_PORT="$port"
log "PostgreSQL running: $IDEM_TEST_DATABASE_URL"

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
    if grep -qE '(PANIC|FATAL|ERROR)' "$logfile" 2>/dev/null; then
        log "server log tail ($logfile):"
        tail -n 30 "$logfile" >&2 || true
    fi
fi
exit "$status"
