#!/usr/bin/env bash
# Install an already-built idem into a scratch prefix, then build and run a consumer project
# against it with find_package(idem).
#
# Usage: tests/package/run.sh SOURCE_DIR IDEM_BINARY_DIR WORK_DIR [extra cmake configure args...]
#
# The consumer is configured with the same C++ compiler and build type as the idem build, and
# with the same -fsanitize flags if idem was built with IDEM_SANITIZE (a sanitized static
# library cannot be linked into an unsanitized program).
set -euo pipefail

if (($# < 3)); then
    sed -n '5p' "$0" | sed 's/^# //' >&2
    exit 2
fi

source_dir="$(cd "$1" && pwd)"
idem_bin="$(cd "$2" && pwd)"
work_dir="$3"
shift 3

mkdir -p "$work_dir"
work_dir="$(cd "$work_dir" && pwd)"
prefix="$work_dir/prefix"
consumer_bin="$work_dir/build"
rm -rf "$prefix" "$consumer_bin"

# Read a variable from idem's CMake cache (empty if absent).
cache_var() {
    sed -n "s/^$1:[A-Z]*=//p" "$idem_bin/CMakeCache.txt" 2>/dev/null | head -n 1
}

echo "package test: installing $idem_bin into $prefix"
cmake --install "$idem_bin" --prefix "$prefix"

configure_args=(-DCMAKE_PREFIX_PATH="$prefix")
cxx="$(cache_var CMAKE_CXX_COMPILER)"
[[ -n "$cxx" ]] && configure_args+=(-DCMAKE_CXX_COMPILER="$cxx")
build_type="$(cache_var CMAKE_BUILD_TYPE)"
[[ -n "$build_type" ]] && configure_args+=(-DCMAKE_BUILD_TYPE="$build_type")
sanitize="$(cache_var IDEM_SANITIZE)"
if [[ -n "$sanitize" && "$sanitize" != "none" && "$sanitize" != "OFF" ]]; then
    configure_args+=(-DCMAKE_CXX_FLAGS="-fsanitize=$sanitize -fno-omit-frame-pointer"
                     -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$sanitize")
fi

echo "package test: configuring consumer in $consumer_bin"
cmake -S "$source_dir/tests/package" -B "$consumer_bin" "${configure_args[@]}" "$@"

echo "package test: building consumer"
cmake --build "$consumer_bin"

echo "package test: running consumer"
"$consumer_bin/consumer"
if [[ -x "$consumer_bin/consumer_asio" ]]; then
    echo "package test: running consumer_asio (find_package(idem COMPONENTS asio))"
    "$consumer_bin/consumer_asio"
fi
