#!/usr/bin/env bash
# Run idem's database test suites against a throwaway Citus cluster (coordinator + 2 workers).
#
# Usage: scripts/citus-check.sh [--build-dir DIR] [--by scope|key]... [--shards N] [--build]
#                               [--log-dir DIR] [--] [CTEST ARGS...]
#
#   --build-dir DIR  build to test (default build/debug); configured and built with the flags of
#                    scripts/test.sh if it has no CTestTestfile.cmake yet
#   --build          (re)configure and build DIR even if it exists
#   --by COLUMN      distribute idem's tables by this column only (scope or key; may be repeated);
#                    default: both, one after the other
#   --shards N       shards per distributed table (default 4, 2 per worker: every multi-key
#                    statement still spans shards on both workers and more than one on each, and
#                    each test's CREATE TABLE makes an eighth of Citus's default 32 shard tables)
#   --log-dir DIR    where the logs go (default /tmp): citus-check-<by>.log (the ctest output) and
#                    citus-check-<by>.server.log (what the 3 servers logged during that run,
#                    each line with its SQLSTATE), citus-check-<by>.junit.xml (ctest's timings)
#   CTEST ARGS       passed to ctest after `-L citus` (e.g. -R idem_contract); a leading `--` is
#                    dropped
#   --exec CMD...    run CMD (the rest of the line) against each cluster instead of the suites,
#                    with the same environment (e.g. a benchmark: see docs/scale-out.md)
#
# Needs Citus already installed for the PostgreSQL that scripts/with-postgres.sh uses ($IDEM_PG_BIN,
# default /usr/lib/postgresql/15/bin): citus.control in `$IDEM_PG_BIN/pg_config --sharedir`/extension
# (.ci/run installs the build in ../shared/citus; CONTRIBUTING.md says how to get it elsewhere). If
# it is not there, says so in one line and exits 0 — except in CI (CI=true), where a missing Citus
# fails the check (exit 1): a green CI must mean the Citus suites ran. Nothing is downloaded or
# built but idem.
#
# What it does:
#   1. starts a coordinator and 2 workers (initdb in a fresh temp dir, run by the OS user
#      `postgres` when invoked as root, else by the invoking user), each on 127.0.0.1 and a Unix
#      socket in the temp dir, ports from 9700 up (the first free ones), trust authentication for
#      local and 127.0.0.1 only, shared_preload_libraries = citus, max_prepared_transactions = 100,
#      fsync and synchronous_commit on, citus.enable_statistics_collection off,
#      citus.recover_2pc_interval -1 (no 2PC recovery deleting pg_dist_transaction rows mid-test),
#      citus.shard_count from --shards;
#   2. for each distribution column: drops and recreates the database `postgres` on every node
#      (nothing of the previous run is left), CREATE EXTENSION citus on each, registers the
#      coordinator (citus_set_coordinator_host) and both workers (citus_add_node), and installs on
#      the coordinator an event trigger (ddl_command_end, CREATE TABLE) that calls
#      create_distributed_table(<table>, '<by>') for every new table having both a `scope` and a
#      `key` column. Other tables are left alone (local to the coordinator), and so is a table whose
#      PRIMARY KEY / UNIQUE / EXCLUDE constraint lacks the distribution column (Citus would refuse
#      to distribute it: e.g. the tests' effect tables with `id bigserial PRIMARY KEY`); the trigger
#      logs these at LOG level in the coordinator's log ("citus-check: ... left local"). A new
#      table is co-located with one whose distribution column has the same type and collation
#      (idem's `scope`/`key` are COLLATE "C", the tests' effect tables' are not), else alone;
#   3. runs ctest --output-on-failure on that build with IDEM_TEST_DATABASE_URL (and IDEM_PG_BIN,
#      IDEM_PG_DATA, IDEM_PG_CTL_USER, IDEM_PG_LOG, IDEM_PG_HOST, IDEM_PG_PORT, as
#      scripts/with-postgres.sh exports them) set to the coordinator, so the unmodified test
#      binaries create their tables distributed; prints a summary per distribution;
#   4. always stops the 3 servers and deletes the temp dir on exit (also on failure or a signal).
# Exit status: 0 if every selected test passed for every distribution, 1 if any failed, 2 on
# usage errors, other non-zero if the cluster or the build could not be set up.
#
# The database is `postgres` (recreated per distribution), not a database of its own, because
# idem_fault_lost_ack (its proxy) and idem_fault_pgbouncer (PgBouncer's [databases]) connect with
# dbname=postgres: in any other database they would test a plain, non-Citus table.
#
# Tests run: label citus, the suites whose statements or behaviour differ on a distributed table
# (`ctest --test-dir build/debug -N -L citus` lists them; tests/CMakeLists.txt says why each is in):
# the store contract (group commit off and on, blocking and async), PostgresStore's and Citus's own
# tests, atomicity, group commit, the process races, batches, the lifecycle suites, idemctl, and
# the fault scenarios that land mid-transaction on the coordinator: backend_kill, also with group
# commit on (pg_terminate_backend of idem's backends; the postmaster is untouched), lost_ack (a proxy on the
# coordinator's Unix socket), exhaustion (a table lock held with pg_sleep; idem's coordinator
# backends SIGSTOPped, then SIGCONT), hostile, and the async scenarios. Not run here: what sends
# the same statements as a suite that is (HTTP, the cache, metrics, PgBouncer, the statement-shape
# and most group-commit variants), what has no PostgreSQL store under test (unit, Redis), and what
# would kill the coordinator or needs a cluster of its own (crash, disruptive, failover).
# The suites run one at a time (some stop or slow the coordinator for everyone).
#
# Environment knobs: IDEM_PG_BIN (PostgreSQL binaries), IDEM_PG_TMPDIR (parent of the temp dir,
# default /tmp), CITUS_CHECK_PORT (first port tried, default 9700), IDEM_BUILD_JOBS (build -j,
# default nproc). Builds run under nice -n 10.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "citus-check: $*" >&2; }
usage() { sed -n '2,21s/^# \{0,1\}//p' "$0"; }

build_dir=build/debug
force_build=0
log_dir=/tmp
bys=()
shards=4
ctest_args=()
exec_cmd=()
while (($# > 0)); do
    case "$1" in
        --build-dir=*) build_dir="${1#--build-dir=}" ;;
        --build-dir) build_dir="${2:?--build-dir needs a value}"; shift ;;
        --build) force_build=1 ;;
        --log-dir=*) log_dir="${1#--log-dir=}" ;;
        --log-dir) log_dir="${2:?--log-dir needs a value}"; shift ;;
        --shards=*) shards="${1#--shards=}" ;;
        --shards) shards="${2:?--shards needs a value}"; shift ;;
        --by=*) bys+=("${1#--by=}") ;;
        --by) bys+=("${2:?--by needs a value (scope or key)}"); shift ;;
        -h | --help) usage; exit 0 ;;
        --exec) shift; exec_cmd=("$@"); break ;;
        --) shift; ctest_args+=("$@"); break ;;
        *) ctest_args+=("$1") ;;
    esac
    shift
done
if ((${#bys[@]} == 0)); then
    bys=(scope key)
fi
for by in "${bys[@]}"; do
    if [[ "$by" != scope && "$by" != key ]]; then
        log "--by must be scope or key, not '$by'"
        exit 2
    fi
done
if [[ ! "$shards" =~ ^[1-9][0-9]*$ ]]; then
    log "--shards must be a positive number, not '$shards'"
    exit 2
fi

# The suites whose statements or behaviour differ on a distributed table: label citus
# (tests/CMakeLists.txt and tests/fault/CMakeLists.txt say which and why).
labels='^citus$'

# ---- 1. Is Citus installed for the PostgreSQL of scripts/with-postgres.sh? -----------------------
pg_bin="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}"
if [[ ! -x "$pg_bin/pg_config" ]]; then
    log "$pg_bin/pg_config not found (PostgreSQL server binaries: scripts/install-deps.sh)"
    exit 1
fi
pg_version="$("$pg_bin/pg_config" --version)"
pg_major="$(sed -E 's/^PostgreSQL ([0-9]+).*/\1/' <<<"$pg_version")"
citus_control="$("$pg_bin/pg_config" --sharedir)/extension/citus.control"
if [[ ! -f "$citus_control" ]]; then
    if [[ "${CI:-}" == true ]]; then
        log "Citus is not installed for PostgreSQL $pg_major ($citus_control not found): in CI (CI=true) the" \
            "Citus suites must run; install it first (.ci/run uses ../shared/citus/install.sh)"
        exit 1
    fi
    echo "citus-check: Citus is not installed for PostgreSQL $pg_major ($citus_control not found); nothing to check"
    exit 0
fi
for tool in initdb pg_ctl postgres psql; do
    if [[ ! -x "$pg_bin/$tool" ]]; then
        log "$pg_bin/$tool not found"
        exit 1
    fi
done

# ---- the build -----------------------------------------------------------------------------------
if ((force_build)) || [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
    log "configuring and building $build_dir (flags of scripts/test.sh)"
    nice -n 10 cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DIDEM_WERROR=ON \
        -DIDEM_BUILD_TESTS=ON -DIDEM_BUILD_EXAMPLES=ON
    nice -n 10 cmake --build "$build_dir" -j"${IDEM_BUILD_JOBS:-$(nproc)}"
fi
mkdir -p "$log_dir"

# ---- 2. the cluster ------------------------------------------------------------------------------
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
child=""
nodes=(coordinator worker1 worker2)
declare -A port_of=()

as_pg() {
    if ((uid == 0)); then
        (cd "$tmpdir" && runuser -u "$pg_user" -- "$@")
    else
        (cd "$tmpdir" && "$@")
    fi
}

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
    trap '' INT TERM HUP
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        local -a pids
        mapfile -t pids < <(descendants "$child")
        kill -TERM "$child" "${pids[@]}" 2>/dev/null || true
        wait "$child" 2>/dev/null || true
    fi
    if [[ -n "$tmpdir" && -d "$tmpdir" ]]; then
        local node datadir pid
        for node in "${nodes[@]}"; do
            datadir="$tmpdir/$node"
            [[ -f "$datadir/postmaster.pid" ]] || continue
            as_pg "$pg_bin/pg_ctl" -D "$datadir" -m immediate -w -t 60 stop >/dev/null 2>&1 || true
            if [[ -f "$datadir/postmaster.pid" ]]; then
                pid="$(head -n 1 "$datadir/postmaster.pid" 2>/dev/null || true)"
                if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
                    log "pg_ctl stop failed; killing postmaster $pid ($node)"
                    kill -KILL "$pid" 2>/dev/null || true
                    sleep 0.5
                fi
            fi
        done
        rm -rf "$tmpdir"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

tmpdir="$(mktemp -d "${IDEM_PG_TMPDIR:-/tmp}/idem-citus.XXXXXX")"
chmod 0755 "$tmpdir" # the socket dir must be reachable by the client
if ((uid == 0)); then
    chown "$pg_user:" "$tmpdir"
fi

port_busy() {
    # Something listens on 127.0.0.1:$1 (or a socket file of that port exists).
    [[ -e "$tmpdir/.s.PGSQL.$1" ]] && return 0
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

next_port="${CITUS_CHECK_PORT:-9700}"
start_node() {
    local node="$1" max_connections="$2"
    local datadir="$tmpdir/$node" logfile="$tmpdir/$node.log" initdb_log="$tmpdir/$node.initdb.log"
    local locale ok=0
    for locale in C.UTF-8 C; do
        if as_pg "$pg_bin/initdb" -D "$datadir" -U postgres --no-sync -E UTF8 --locale="$locale" \
            >"$initdb_log" 2>&1; then
            ok=1
            break
        fi
        as_pg rm -rf "$datadir"
    done
    if ((!ok)); then
        log "initdb failed ($node):"
        cat "$initdb_log" >&2
        exit 1
    fi
    as_pg tee "$datadir/pg_hba.conf" >/dev/null <<'HBA'
# written by scripts/citus-check.sh: trust on the Unix socket and 127.0.0.1 only
local all all trust
host  all all 127.0.0.1/32 trust
HBA
    echo "include 'citus-check.conf'" >>"$datadir/postgresql.conf"
    as_pg touch "$logfile"
    local attempt port offset
    for attempt in $(seq 1 50); do
        port="$next_port"
        next_port=$((next_port + 1))
        if port_busy "$port"; then
            continue
        fi
        as_pg tee "$datadir/citus-check.conf" >/dev/null <<CONF
# written by scripts/citus-check.sh ($node)
listen_addresses = '127.0.0.1'
unix_socket_directories = '$tmpdir'
port = $port
max_connections = $max_connections
max_prepared_transactions = 100
shared_preload_libraries = 'citus'
citus.enable_statistics_collection = off
# tests/store/citus_test.cpp counts two-phase commits in pg_dist_transaction: no recovery deletes
# its rows meanwhile (nothing here leaves a prepared transaction to recover)
citus.recover_2pc_interval = -1
citus.shard_count = $shards
fsync = on
synchronous_commit = on
log_min_messages = warning
log_line_prefix = '%m [%p] %e '
CONF
        offset="$(stat -c %s "$logfile")"
        if as_pg "$pg_bin/pg_ctl" -D "$datadir" -l "$logfile" -w -t 60 start >/dev/null 2>&1; then
            port_of[$node]="$port"
            return 0
        fi
        log "$node: start failed on port $port (attempt $attempt); log tail:"
        tail -c +"$((offset + 1))" "$logfile" | tail -n 20 >&2 || true
        as_pg "$pg_bin/pg_ctl" -D "$datadir" -m immediate -w stop >/dev/null 2>&1 || true
    done
    log "could not start $node"
    exit 1
}

# psql on a node (as the database superuser postgres), stopping at the first error.
sql() {
    local node="$1" db="$2"
    shift 2
    "$pg_bin/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$tmpdir" -p "${port_of[$node]}" -U postgres \
        -d "$db" "$@"
}

# A new coordinator backend opens connections to the workers: they get more slots.
start_node coordinator 300
start_node worker1 400
start_node worker2 400
log "Citus cluster up in $tmpdir: coordinator ${port_of[coordinator]}, workers ${port_of[worker1]} and ${port_of[worker2]} ($pg_version, citus $(sed -nE "s/^default_version = '([^']*)'.*/\1/p" "$citus_control"))"

db=postgres

# The event trigger of step 3: every new table with both `scope` and `key` distributed by $1.
trigger_sql() {
    cat <<SQL
CREATE FUNCTION public.citus_check_distribute() RETURNS event_trigger
LANGUAGE plpgsql AS \$fn\$
DECLARE
    r record;
    dist_col constant text := '$1';
    blocking text;
    coloc text;
BEGIN
    FOR r IN
        SELECT c.oid AS relid, c.oid::regclass::text AS name
        FROM pg_event_trigger_ddl_commands() d
        JOIN pg_class c ON c.oid = d.objid
        WHERE d.command_tag = 'CREATE TABLE' AND d.object_type = 'table'
          AND c.relkind IN ('r', 'p') AND c.relpersistence <> 't' AND NOT c.relispartition
    LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = r.relid);
        -- tests/store/citus_test.cpp distributes these itself (PostgresStore::distribute).
        CONTINUE WHEN r.name LIKE '%\_local\_%';
        CONTINUE WHEN (SELECT count(*) FROM pg_attribute
                       WHERE attrelid = r.relid AND attnum > 0 AND NOT attisdropped
                         AND attname IN ('scope', 'key')) < 2;
        -- Citus refuses a unique constraint without the distribution column: keep such a table local.
        SELECT string_agg(i.indexrelid::regclass::text, ', ') INTO blocking
        FROM pg_index i
        WHERE i.indrelid = r.relid AND (i.indisunique OR i.indisexclusion)
          AND NOT EXISTS (SELECT 1 FROM pg_attribute a
                          WHERE a.attrelid = r.relid AND a.attname = dist_col
                            AND a.attnum = ANY (i.indkey::int2[]));
        IF blocking IS NOT NULL THEN
            RAISE LOG 'citus-check: % left local (unique index % lacks %)', r.name, blocking, dist_col;
            CONTINUE;
        END IF;
        -- Co-locate with a table whose distribution column has the same type and collation (the
        -- tests' effect tables use the default collation, idem's table COLLATE "C": Citus's
        -- default co-location would refuse them), else start a co-location group of its own.
        SELECT p.logicalrelid::text INTO coloc
        FROM pg_dist_partition p
        JOIN pg_attribute pa ON pa.attrelid = p.logicalrelid
                            AND pa.attname = column_to_column_name(p.logicalrelid, p.partkey)
        JOIN pg_attribute na ON na.attrelid = r.relid AND na.attname = dist_col
        WHERE p.partmethod = 'h' AND pa.atttypid = na.atttypid AND pa.attcollation = na.attcollation
          AND (SELECT count(*) FROM pg_dist_shard s WHERE s.logicalrelid = p.logicalrelid)
              = current_setting('citus.shard_count')::int
        ORDER BY p.logicalrelid
        LIMIT 1;
        PERFORM create_distributed_table(r.relid::regclass, dist_col,
                                         colocate_with => coalesce(coloc, 'none'));
    END LOOP;
END
\$fn\$;
CREATE EVENT TRIGGER citus_check_distribute ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
    EXECUTE FUNCTION public.citus_check_distribute();
SQL
}

# A fresh database on every node, Citus in it, the nodes registered, the event trigger installed.
prepare_database() {
    local by="$1" node
    for node in "${nodes[@]}"; do # the coordinator first: its metadata points at the workers
        sql "$node" template1 -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
        sql "$node" "$db" -c "CREATE EXTENSION citus" >/dev/null
    done
    sql coordinator "$db" >/dev/null <<SQL
SELECT citus_set_coordinator_host('127.0.0.1', ${port_of[coordinator]});
SELECT citus_add_node('127.0.0.1', ${port_of[worker1]});
SELECT citus_add_node('127.0.0.1', ${port_of[worker2]});
SQL
    trigger_sql "$by" | sql coordinator "$db" >/dev/null
    # What docs/scale-out.md tells an operator to run: idem's session settings do not reach the
    # shards, so the role carries them (Citus propagates ALTER ROLE … SET to the workers).
    # lock_timeout is idem's default; PostgresStore::inspect() warns when a store asks otherwise.
    sql coordinator "$db" >/dev/null <<SQL
ALTER ROLE postgres SET lock_timeout = '1000ms';
ALTER ROLE postgres SET enable_seqscan = off;
SQL
    local workers
    workers="$(sql coordinator "$db" -c "SELECT count(*) FROM citus_get_active_worker_nodes()")"
    if [[ "$workers" != 2 ]]; then
        log "expected 2 active workers, got '$workers'"
        exit 1
    fi
    # Self-check of the trigger: tables with scope and key distributed by $by (whatever their
    # collation), one with a unique key lacking $by and one without scope/key left alone.
    local check
    check="$(sql coordinator "$db" <<SQL
CREATE TABLE citus_check_probe1 (scope text NOT NULL, key text NOT NULL);
CREATE TABLE citus_check_probe2 (scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
                                 PRIMARY KEY (scope, key));
CREATE TABLE citus_check_local (id bigserial PRIMARY KEY, scope text, key text);
CREATE TABLE citus_check_plain (id int PRIMARY KEY);
SELECT string_agg(logicalrelid::text || ':' || column_to_column_name(logicalrelid, partkey), ' '
                  ORDER BY logicalrelid::text)
FROM pg_dist_partition
WHERE logicalrelid::text LIKE 'citus_check_%';
DROP TABLE citus_check_probe1, citus_check_probe2, citus_check_local, citus_check_plain;
SQL
)"
    if [[ "$check" != "citus_check_probe1:$by citus_check_probe2:$by" ]]; then
        log "the event trigger does not distribute by $by (got: ${check:-nothing})"
        exit 1
    fi
}

conninfo_value() {
    if [[ "$1" =~ ^[A-Za-z0-9_./+:@-]+$ ]]; then
        printf '%s' "$1"
    else
        local v="${1//\\/\\\\}"
        printf "'%s'" "${v//\'/\\\'}"
    fi
}

IDEM_TEST_DATABASE_URL="host=$(conninfo_value "$tmpdir") port=${port_of[coordinator]} dbname=$db user=postgres"
export IDEM_TEST_DATABASE_URL
export IDEM_PG_BIN="$pg_bin"
export IDEM_PG_DATA="$tmpdir/coordinator"
export IDEM_PG_CTL_USER="$pg_user"
export IDEM_PG_LOG="$tmpdir/coordinator.log"
export IDEM_PG_HOST="$tmpdir"
export IDEM_PG_PORT="${port_of[coordinator]}"
# tests/store/citus_test.cpp: a worker to be refused by ensure_schema() and distribute().
export IDEM_TEST_CITUS_WORKER_URL="host=$(conninfo_value "$tmpdir") port=${port_of[worker1]} dbname=$db user=postgres"

# ---- 3. the runs ---------------------------------------------------------------------------------
summary=()
any_failed=0
for by in "${bys[@]}"; do
    ctest_log="$log_dir/citus-check-$by.log"
    server_log="$log_dir/citus-check-$by.server.log"
    log "[by $by] fresh database '$db' on all nodes; tables with scope and key distributed by $by"
    export IDEM_TEST_CITUS_DISTRIBUTE="$by"  # tests/store/citus_test.cpp: what to expect
    prepare_database "$by"
    declare -A offset_of=()
    for node in "${nodes[@]}"; do
        offset_of[$node]="$(stat -c %s "$tmpdir/$node.log")"
    done
    if ((${#exec_cmd[@]} > 0)); then # --exec: the given command instead of the suites
        log "[by $by] ${exec_cmd[*]}"
        set +e
        "${exec_cmd[@]}" </dev/null 2>&1 | tee "$ctest_log"
        status=${PIPESTATUS[0]}
        set -e
        summary+=("by $by: ${exec_cmd[*]}: exit $status — output in $ctest_log")
        ((status == 0)) || any_failed=1
        continue
    fi
    rm -f "$log_dir/citus-check-$by.junit.xml"
    cmd=(ctest --test-dir "$build_dir" --output-on-failure --no-tests=error --timeout 600
         --output-junit "$log_dir/citus-check-$by.junit.xml" -L "$labels"
         "${ctest_args[@]+"${ctest_args[@]}"}")
    log "[by $by] ${cmd[*]}"
    log "[by $by] IDEM_TEST_DATABASE_URL=$IDEM_TEST_DATABASE_URL"
    {
        echo "# scripts/citus-check.sh --by $by: $(date -u '+%Y-%m-%dT%H:%M:%SZ'), $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
        echo "# $pg_version, citus.control: $citus_control"
        echo "# IDEM_TEST_DATABASE_URL=$IDEM_TEST_DATABASE_URL"
        echo "# ${cmd[*]}"
    } >"$ctest_log"
    # ctest in the background, so that a signal reaches the trap (which ends ctest and its tests)
    # at once; its output through tee to the terminal and the log.
    exec {tee_fd}> >(tee -a "$ctest_log")
    tee_pid=$!
    set +e
    "${cmd[@]}" </dev/null >&"$tee_fd" 2>&1 &
    child=$!
    exec {tee_fd}>&-
    wait "$child"
    status=$?
    child=""
    set -e
    for _ in $(seq 1 100); do # tee ends once nothing writes to it (a test's leftover may)
        kill -0 "$tee_pid" 2>/dev/null || break
        sleep 0.1
    done
    kill "$tee_pid" 2>/dev/null || true
    {
        for node in "${nodes[@]}"; do
            echo "===== $node (port ${port_of[$node]}) ====="
            tail -c +"$((offset_of[$node] + 1))" "$tmpdir/$node.log"
        done
    } >"$server_log"

    # ctest's result lines: "  3/27 Test  #5: name ......   Passed   1.23 sec" (or ***Failed,
    # ***Timeout, ***Exception: ..., ***Not Run, ***Skipped)
    results="$(sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*(\*\*\*)? *(.*[^ ]) +[0-9.]+ sec$/\1\t\3/p' "$ctest_log")"
    mapfile -t passed < <(awk -F'\t' '$2 == "Passed" { print $1 }' <<<"$results")
    mapfile -t skipped < <(awk -F'\t' '$2 ~ /Skipped/ { print $1 }' <<<"$results")
    mapfile -t failed < <(awk -F'\t' 'NF == 2 && $2 != "Passed" && $2 !~ /Skipped/ { print $1 " (" $2 ")" }' <<<"$results")
    left_local="$(grep -c 'citus-check: .* left local' "$server_log" || true)"
    line="by $by: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped (ctest exit $status)"
    line+=" — log $ctest_log, servers $server_log"
    if ((left_local > 0)); then
        line+="; $left_local table(s) left local (grep 'left local' in the server log)"
    fi
    summary+=("$line")
    for t in "${passed[@]+"${passed[@]}"}"; do
        summary+=("    passed  $t")
    done
    for t in "${failed[@]+"${failed[@]}"}"; do
        summary+=("    FAILED  $t")
    done
    for t in "${skipped[@]+"${skipped[@]}"}"; do
        summary+=("    skipped $t")
    done
    if ((status != 0)); then
        any_failed=1
    fi
done

echo
echo "==> citus-check summary ($pg_version; ${#bys[@]} distribution(s))"
printf '%s\n' "${summary[@]}"
if ((any_failed)); then
    echo "==> FAILED"
    exit 1
fi
echo "==> OK: all selected tests passed for: ${bys[*]}"
