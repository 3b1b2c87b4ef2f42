#!/usr/bin/env bash
# Build idem and run its whole test suite against a throwaway PostgreSQL cluster.
#
# Usage: scripts/test.sh [--sanitize=address|thread|none] [--build-dir DIR] [--build-only|--no-build]
#                       [CTEST ARGS...]
#
#   --sanitize=address   ASan + UBSan build in build/asan
#   --sanitize=thread    TSan build in build/tsan
#   --sanitize=none      plain Debug build in build/debug (default)
#   --build-dir DIR      override the build directory
#   --build-only         check dependencies, configure and build; run no test. With CTEST ARGS
#                        that select tests (-L sanitize), build only what those tests run
#   --no-build           run the tests of a build made before (by --build-only)
#   CTEST ARGS           passed to ctest after the defaults (e.g. -R store, -L sanitize, -j1,
#                        --repeat until-fail:3); a leading `--` is accepted and dropped
#
# Tests run IDEM_TEST_JOBS at a time (default: the number of cores). Each test that needs
# PostgreSQL starts a throwaway cluster of its own (scripts/with-postgres.sh), so tests that kill,
# stop or reconfigure their server run beside the others. The timings of the run are written to
# DIR/ctest-junit.xml (scripts/ci-report.sh reads them).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,20s/^# \{0,1\}//p' "$0"; }

step() {
    printf '\n==> %s\n' "$*"
}

sanitize=none
build_dir=""
build=1
run_tests=1
ctest_args=()
while (($# > 0)); do
    case "$1" in
        --sanitize=*) sanitize="${1#--sanitize=}" ;;
        --sanitize) sanitize="${2:?--sanitize needs a value}"; shift ;;
        --build-dir=*) build_dir="${1#--build-dir=}" ;;
        --build-dir) build_dir="${2:?--build-dir needs a value}"; shift ;;
        --build-only) ((build)) || { echo "test.sh: --build-only and --no-build exclude each other" >&2; exit 2; }
                      run_tests=0 ;;
        --no-build) ((run_tests)) || { echo "test.sh: --build-only and --no-build exclude each other" >&2; exit 2; }
                    build=0 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; ctest_args+=("$@"); break ;;
        *) ctest_args+=("$1") ;;
    esac
    shift
done

# ON, not the default AUTO: every test, example, the API reference and idemctl are built, and a missing
# dependency stops the configure instead of skipping a part.
cmake_args=(
    -DCMAKE_BUILD_TYPE=Debug
    -DIDEM_WERROR=ON
    -DIDEM_BUILD_TESTS=ON
    -DIDEM_BUILD_EXAMPLES=ON
    -DIDEM_BUILD_DOCS=ON
    -DIDEM_BUILD_TOOLS=ON
    -DIDEM_ASIO=ON
    -DIDEM_REDIS=ON
    -DIDEM_GRPC=ON
    # Line tables only (-g1: function names, files and lines in every backtrace and sanitizer
    # report, no variables), which builds much faster than -g. For a debugger, configure a build
    # of your own (CONTRIBUTING.md).
    "-DCMAKE_CXX_FLAGS_DEBUG=-g1"
    "-DCMAKE_C_FLAGS_DEBUG=-g1"
)
# Sanitized builds leave out what runs none of the library's code under the sanitizer (the
# benchmarks and the API reference: the plain build has both).
sanitized_off=(-DIDEM_BUILD_BENCH=OFF -DIDEM_BUILD_DOCS=OFF)
case "$sanitize" in
    address | asan)
        sanitize=address
        : "${build_dir:=build/asan}"
        cmake_args+=("-DIDEM_SANITIZE=address,undefined" "${sanitized_off[@]}")
        export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
        export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
        ;;
    thread | tsan)
        sanitize=thread
        : "${build_dir:=build/tsan}"
        cmake_args+=(-DIDEM_SANITIZE=thread "${sanitized_off[@]}")
        # tests/tsan.supp: a Boost.Asio false positive (fences TSan does not model), nothing of idem's
        export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp}"
        ;;
    none | "")
        sanitize=none
        : "${build_dir:=build/debug}"
        ;;
    *)
        echo "test.sh: unknown --sanitize value '$sanitize' (address|thread|none)" >&2
        exit 2
        ;;
esac

start=$SECONDS
# The tests' throwaway clusters go in a directory of this run's (scripts/with-postgres.sh,
# IDEM_PG_TMPDIR). A test that ctest kills at its TIMEOUT cannot stop its server (the postmaster
# is not in the killed process tree); on_exit stops what is left and removes the directory.
if [[ -z "${IDEM_PG_TMPDIR:-}" ]]; then
    IDEM_PG_TMPDIR="$(mktemp -d "${TMPDIR:-/tmp}/idem-test.XXXXXX")"
    chmod 0755 "$IDEM_PG_TMPDIR"
    export IDEM_PG_TMPDIR
    own_pg_tmpdir=1
else
    own_pg_tmpdir=0
fi
stop_leftover_clusters() {
    local pid_file data pg_ctl="${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}/pg_ctl"
    for pid_file in "$IDEM_PG_TMPDIR"/idem-pg.*/data/postmaster.pid; do
        [[ -f "$pid_file" ]] || continue
        data="${pid_file%/postmaster.pid}"
        echo "test.sh: stopping a server its test left running ($data)" >&2
        if ((EUID == 0)); then
            runuser -u "$(stat -c %U "$data")" -- "$pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
        else
            "$pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
        fi
    done
    rm -rf "$IDEM_PG_TMPDIR"
}
on_exit() {
    local rc=$?
    if ((own_pg_tmpdir)); then
        stop_leftover_clusters
    fi
    if ((rc != 0)); then
        printf '\n==> FAILED (exit %d; sanitize=%s, build dir %s)\n' "$rc" "$sanitize" "$build_dir" >&2
    fi
}
trap on_exit EXIT

# The build's targets that the tests selected by ctest_args run: every program of a test's command
# that lies in the build directory (each test binary depends on the helpers it starts). A command
# naming a target not built yet has no path in ctest's listing; such a test is named after its
# target (idem_add_test in tests/CMakeLists.txt).
selected_targets() {
    ctest --test-dir "$build_dir" -N --show-only=json-v1 "${ctest_args[@]}" | python3 -c '
import json, os, sys
build = os.path.realpath(sys.argv[1])
seen = set()
for test in json.load(sys.stdin).get("tests", []):
    command = test.get("command")
    wanted = [test["name"]] if not command else [
        os.path.relpath(p, build) for p in map(os.path.realpath, command)
        if p.startswith(build + os.sep)]
    for target in wanted:
        if target not in seen:
            seen.add(target)
            print(target)
' "$build_dir"
}

if ((build)); then
    step "[1/4] Checking dependencies"
    scripts/install-deps.sh --all

    # Ninja when the build directory is new (an existing one keeps the generator it was made with).
    if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null 2>&1; then
        cmake_args+=(-G Ninja)
    fi
    # ccache when installed: a build that an earlier one in this clone compiled already takes the
    # objects from the cache (so does idem_configure_minimal's build of the library, in a directory
    # of its own: sources and include paths are hashed as the absolute paths both builds use, the
    # working directory not at all); with an empty cache it costs a few percent.
    if command -v ccache >/dev/null 2>&1; then
        cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
        export CCACHE_NOHASHDIR=true
        # The tests' precompiled Catch2 header: ccache caches its users only with this sloppiness
        # (the header's own hash is part of each user's).
        export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros}"
        export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
    fi

    step "[2/4] Configuring $build_dir (sanitize=$sanitize)"
    cmake -S . -B "$build_dir" "${cmake_args[@]}"

    # Ninja names a target by its output's path; other generators build everything, and so does a
    # selection with a test that runs no program of this build's (the package and docs tests use
    # the whole build).
    build_args=()
    if ((!run_tests && ${#ctest_args[@]} > 0)) && [[ -f "$build_dir/build.ninja" ]]; then
        selected="$(selected_targets)"
        [[ -n "$selected" ]] || { echo "test.sh: no test matches: ${ctest_args[*]}" >&2; exit 2; }
        known="$(ninja -C "$build_dir" -t targets all | sed 's/: [^:]*$//')"
        mapfile -t targets <<<"$selected"
        for target in "${targets[@]}"; do
            grep -qxF -- "$target" <<<"$known" || { targets=(); break; }
        done
        if ((${#targets[@]} > 0)); then
            build_args=(--target "${targets[@]}")
        fi
    fi
    if ((${#build_args[@]} > 0)); then
        step "[3/4] Building $build_dir: ${#targets[@]} programs, what the selected tests run"
    else
        step "[3/4] Building $build_dir"
    fi
    cmake --build "$build_dir" -j"$(nproc)" "${build_args[@]}"
fi
if ((!run_tests)); then
    step "OK: built $build_dir (sanitize=$sanitize, $((SECONDS - start))s)"
    exit 0
fi
if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
    echo "test.sh: --no-build: $build_dir has no build (run scripts/test.sh --build-only first)" >&2
    exit 2
fi

jobs="${IDEM_TEST_JOBS:-$(nproc)}"
step "[4/4] Running tests (ctest -j$jobs ${ctest_args[*]})"
# Every test runs once: a test that fails once fails the run (timing-dependent tests move their
# clocks by hand or have bounds a busy 2-core machine keeps). No shared server: a test's own
# cluster is started by its command (tests/CMakeLists.txt), unless IDEM_TEST_DATABASE_URL is set.
rm -f "$build_dir/ctest-junit.xml"
ctest --test-dir "$build_dir" --output-on-failure --timeout 600 -j"$jobs" \
    --output-junit ctest-junit.xml "${ctest_args[@]}"

step "OK: all tests passed (sanitize=$sanitize, $((SECONDS - start))s)"
