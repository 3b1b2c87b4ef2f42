#!/usr/bin/env bash
# Build idem's libFuzzer targets (clang, ASan + UBSan, library included) and run each for a while.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]        (default 30; CI runs `scripts/fuzz.sh 20`)
#
#   Targets: fuzz_key, fuzz_fingerprint, fuzz_record, fuzz_response (fuzz/*.cpp say what each checks).
#   Each starts from its committed seeds (fuzz/corpus/<target>/, read-only) plus what earlier runs
#   found (build/fuzz/corpus/<target>/), runs SECONDS with -max_total_time, and the script fails
#   (exit 1) if any target crashes, times out, leaks or hits a failed check. A crashing input is
#   saved as build/fuzz/artifacts/<target>-crash-<sha1>; replay it with
#     build/fuzz/fuzz/fuzz_<target> build/fuzz/artifacts/<target>-crash-<sha1>
#
# Environment: IDEM_FUZZ_BUILD_DIR (default build/fuzz), IDEM_FUZZ_JOBS (build parallelism,
# default 2), IDEM_FUZZ_TARGETS (space-separated subset, default all four).
# Needs clang and libclang-rt-14-dev (installed with apt-get when missing and running as root).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
    echo "fuzz.sh: SECONDS_PER_TARGET must be a positive integer (got '$seconds')" >&2
    exit 2
fi
build_dir="${IDEM_FUZZ_BUILD_DIR:-build/fuzz}"
jobs="${IDEM_FUZZ_JOBS:-2}"
read -r -a targets <<<"${IDEM_FUZZ_TARGETS:-key fingerprint record response}"

step() { printf '\n==> %s\n' "$*"; }
start=$SECONDS

# ---- toolchain ---------------------------------------------------------------------------------
fuzzer_rt() { compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; }
if ! command -v clang++ >/dev/null 2>&1 || ! fuzzer_rt; then
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "fuzz.sh: needs clang and libclang-rt-14-dev: apt-get install clang libclang-rt-14-dev" >&2
        exit 1
    fi
    step "Installing clang + libclang-rt-14-dev"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev
fi

# ---- build -------------------------------------------------------------------------------------
mkdir -p "$build_dir"
step "Configuring $build_dir (clang, IDEM_SANITIZE=address,undefined)"
CC=clang CXX=clang++ cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIDEM_BUILD_FUZZ=ON \
    -DIDEM_SANITIZE=address,undefined -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_EXAMPLES=OFF \
    -DIDEM_BUILD_BENCH=OFF -DIDEM_INSTALL=OFF >"$build_dir/configure.log" 2>&1 ||
    { cat "$build_dir/configure.log" >&2; exit 1; }
step "Building fuzz targets (-j$jobs)"
cmake --build "$build_dir" -j"$jobs" --target "${targets[@]/#/fuzz_}"

# ---- run ---------------------------------------------------------------------------------------
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
artifacts="$build_dir/artifacts"
mkdir -p "$artifacts"

declare -A max_len=([key]=600 [fingerprint]=2048 [record]=4096 [response]=4096)
failed=()
summary=()
for t in "${targets[@]}"; do
    bin="$build_dir/fuzz/fuzz_$t"
    work="$build_dir/corpus/$t" # grows across runs; the committed seeds stay untouched
    mkdir -p "$work"
    log="$build_dir/fuzz_$t.log"
    step "fuzz_$t for ${seconds}s (log: $log)"
    set +e
    "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="${max_len[$t]:-4096}" \
        -print_final_stats=1 -artifact_prefix="$artifacts/$t-" "$work" "fuzz/corpus/$t" >"$log" 2>&1
    rc=$?
    set -e
    runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1 || true)"
    eps="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1 || true)"
    cov="$( (grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" || true) | tail -n 1)"
    line="fuzz_$t: ${runs:-?} runs, ${eps:-?} exec/s, ${cov:-no coverage line}"
    if ((rc != 0)); then
        failed+=("$t")
        line+="  FAILED (exit $rc)"
        grep -E 'FUZZ_CHECK|runtime error|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|SUMMARY|Test unit written' \
            "$log" | head -n 20 >&2 || true
    fi
    summary+=("$line")
    echo "$line"
done

step "Summary (${seconds}s per target, $((SECONDS - start))s in all)"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]} > 0)); then
    echo "fuzz.sh: FAILED: ${failed[*]} (inputs in $artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: OK"
