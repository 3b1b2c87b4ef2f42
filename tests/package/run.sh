#!/usr/bin/env bash
# Install an already-built idem into a scratch prefix, then build and run consumers against it:
# a CMake project with find_package(idem), and main.cpp compiled by plain g++ with
# `pkg-config --cflags --libs idem`.
#
# Usage: tests/package/run.sh SOURCE_DIR IDEM_BINARY_DIR WORK_DIR [--deb] [extra cmake configure args...]
#
#   --deb   package the build with `cpack -G DEB` instead, check the package's fields and files,
#           unpack it into WORK_DIR/root (dpkg-deb -x: a throwaway root, nothing is installed on
#           the machine) and build the consumers against WORK_DIR/root/usr
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
deb=0
if [[ "${1:-}" == "--deb" ]]; then
    deb=1
    shift
fi

mkdir -p "$work_dir"
work_dir="$(cd "$work_dir" && pwd)"
prefix="$work_dir/prefix"
consumer_bin="$work_dir/build"
rm -rf "$prefix" "$consumer_bin" "$work_dir/root" "$work_dir/cpack"

# Read a variable from idem's CMake cache (empty if absent).
cache_var() {
    sed -n "s/^$1:[A-Z]*=//p" "$idem_bin/CMakeCache.txt" 2>/dev/null | head -n 1
}

libdir="$(cache_var CMAKE_INSTALL_LIBDIR)"
: "${libdir:=lib}"
if ((deb)); then
    echo "package test: cpack -G DEB ($idem_bin)"
    cpack --config "$idem_bin/CPackConfig.cmake" -G DEB -B "$work_dir/cpack"
    debs=("$work_dir"/cpack/*.deb)
    ((${#debs[@]} == 1)) || { echo "package test: expected one .deb, got: ${debs[*]}" >&2; exit 1; }
    pkg="${debs[0]}"
    dpkg-deb --info "$pkg"
    field() { dpkg-deb --field "$pkg" "$1"; }
    version="$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$idem_bin/idemConfigVersion.cmake")"
    [[ "$(field Package)" == "libidem-dev" ]] || { echo "package test: Package is '$(field Package)'" >&2; exit 1; }
    [[ "$(field Version)" == "$version" ]] || { echo "package test: Version '$(field Version)' != $version" >&2; exit 1; }
    [[ -n "$(field Maintainer)" && -n "$(field Description)" ]] || { echo "package test: no Maintainer/Description" >&2; exit 1; }
    # Every dependency the package names is a Debian 12 package installed on this machine.
    depends="$(field Depends)"
    dep_names=" $(tr ',' '\n' <<<"$depends" | awk '{print $1}' | tr '\n' ' ')"
    for dep in libpq5 libssl3 libfmt9 libpq-dev libssl-dev libfmt-dev; do
        [[ "$dep_names" == *" $dep "* ]] || { echo "package test: Depends lacks $dep: $depends" >&2; exit 1; }
    done
    for name in $dep_names; do
        [[ "$(dpkg-query -W -f='${Status}' "$name" 2>/dev/null)" == "install ok installed" ]] ||
            { echo "package test: dependency $name is not an installed package here" >&2; exit 1; }
    done
    contents="$(dpkg-deb --contents "$pkg" | awk '{print $NF}')"
    for file in ./usr/include/idem/idem.hpp "./usr/$libdir/cmake/idem/idemConfig.cmake" \
                "./usr/$libdir/pkgconfig/idem.pc" ./usr/share/idem/schema.sql; do
        grep -qxF "$file" <<<"$contents" || { echo "package test: the package lacks $file" >&2; exit 1; }
    done
    grep -qE "^\./usr/$libdir/libidem\.(a|so)$" <<<"$contents" ||
        { echo "package test: the package lacks libidem" >&2; exit 1; }
    if command -v apt-get >/dev/null 2>&1; then  # apt would install it here (simulated: nothing changes)
        apt-get install --simulate --no-install-recommends "$pkg" >"$work_dir/apt-simulate.log" 2>&1 ||
            { cat "$work_dir/apt-simulate.log"; echo "package test: apt-get would not install $pkg" >&2; exit 1; }
        grep -q '^Inst libidem-dev ' "$work_dir/apt-simulate.log" ||
            { cat "$work_dir/apt-simulate.log"; echo "package test: apt-get planned no install of libidem-dev" >&2; exit 1; }
    fi
    dpkg-deb -x "$pkg" "$work_dir/root"
    prefix="$work_dir/root/usr"
    echo "package test: unpacked $pkg into $work_dir/root"
else
    echo "package test: installing $idem_bin into $prefix"
    cmake --install "$idem_bin" --prefix "$prefix"
fi

configure_args=(-DCMAKE_PREFIX_PATH="$prefix")
cxx="$(cache_var CMAKE_CXX_COMPILER)"
[[ -n "$cxx" ]] && configure_args+=(-DCMAKE_CXX_COMPILER="$cxx")
build_type="$(cache_var CMAKE_BUILD_TYPE)"
[[ -n "$build_type" ]] && configure_args+=(-DCMAKE_BUILD_TYPE="$build_type")
sanitize="$(cache_var IDEM_SANITIZE)"
sanitize_flags=()
if [[ -n "$sanitize" && "$sanitize" != "none" && "$sanitize" != "OFF" ]]; then
    sanitize_flags=(-fsanitize="$sanitize" -fno-omit-frame-pointer)
    configure_args+=(-DCMAKE_CXX_FLAGS="${sanitize_flags[*]}"
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
if [[ -x "$consumer_bin/consumer_redis" ]]; then
    echo "package test: running consumer_redis (find_package(idem COMPONENTS redis))"
    "$consumer_bin/consumer_redis"
fi
if [[ -x "$consumer_bin/consumer_grpc" ]]; then
    echo "package test: running consumer_grpc (find_package(idem COMPONENTS grpc))"
    "$consumer_bin/consumer_grpc"
fi

# pkg-config: the installed idem.pc alone gives the flags (no CMake, no -I/-L of our own).
pc_dir="$prefix/$libdir/pkgconfig"
[[ -f "$pc_dir/idem.pc" ]] || { echo "package test: $pc_dir/idem.pc is not installed" >&2; exit 1; }
pc_flags="$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs idem)"
echo "package test: pkg-config --cflags --libs idem: $pc_flags"
# shellcheck disable=SC2086 # pkg-config's answer is a list of flags
"${cxx:-g++}" -std=c++20 "${sanitize_flags[@]}" "$source_dir/tests/package/main.cpp" -o "$consumer_bin/consumer_pc" \
    $pc_flags
echo "package test: running consumer_pc (pkg-config)"
"$consumer_bin/consumer_pc"
