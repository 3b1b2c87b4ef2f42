#!/usr/bin/env bash
# A library-only user's machine: configure idem with every optional dependency hidden (the CMake
# finders of Catch2, nlohmann_json, CLI11, Boost, gRPC and Doxygen disabled with
# CMAKE_DISABLE_FIND_PACKAGE_<name>; cpp-httplib and hiredis, found by pkg-config, left out of a
# scratch PKG_CONFIG_LIBDIR), then
#   1. the default configure succeeds and prints one "skipped (needs ...)" line per part it leaves
#      out; `cmake --build` and `cmake --install` work and install the CMake package and idem.pc;
#   2. an explicit -DIDEM_BUILD_TESTS=ON, -DIDEM_BUILD_EXAMPLES=ON, -DIDEM_BUILD_DOCS=ON or
#      -DIDEM_BUILD_TOOLS=ON with its dependency missing stops the configure with an error naming
#      the option.
#
# Usage: tests/package/configure.sh SOURCE_DIR WORK_DIR [extra cmake configure args...]
set -euo pipefail

if (($# < 2)); then
    sed -n '12p' "$0" | sed 's/^# //' >&2
    exit 2
fi
source_dir="$(cd "$1" && pwd)"
mkdir -p "$2"
work_dir="$(cd "$2" && pwd)"
shift 2
rm -rf "$work_dir/minimal" "$work_dir/prefix" "$work_dir/tests-on" "$work_dir/examples-on" "$work_dir/docs-on" \
    "$work_dir/tools-on"

without=(-DCMAKE_DISABLE_FIND_PACKAGE_Catch2=ON -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
         -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON -DCMAKE_DISABLE_FIND_PACKAGE_Boost=ON
         -DCMAKE_DISABLE_FIND_PACKAGE_Doxygen=ON -DCMAKE_DISABLE_FIND_PACKAGE_gRPC=ON)
# pkg-config sees every module of this machine but the optional ones (FindOpenSSL asks pkg-config
# too, so pkg-config itself stays).
pc_dir="$work_dir/pkgconfig"
rm -rf "$pc_dir"
mkdir -p "$pc_dir"
IFS=':' read -ra pc_path <<<"$(pkg-config --variable pc_path pkg-config)"
for dir in "${pc_path[@]}"; do
    for pc in "$dir"/*.pc; do
        [[ -e "$pc" ]] || continue
        case "$(basename "$pc")" in
            cpp-httplib.pc | hiredis.pc) ;;
            *) [[ -e "$pc_dir/$(basename "$pc")" ]] || ln -s "$pc" "$pc_dir/" ;;
        esac
    done
done
export PKG_CONFIG_LIBDIR="$pc_dir" PKG_CONFIG_PATH=""

fail() {
    echo "configure test: $*" >&2
    exit 1
}

# Exactly one line equal to $2 in file $1.
expect_line() {
    local n
    n="$(grep -cxF -- "$2" "$1" || true)"
    ((n == 1)) || fail "expected the line '$2' once in $1, found it $n times"
}

echo "configure test: the default configure without the optional dependencies"
cmake -S "$source_dir" -B "$work_dir/minimal" "${without[@]}" "$@" >"$work_dir/minimal.log" 2>&1 ||
    { cat "$work_dir/minimal.log"; fail "the default configure failed"; }
cat "$work_dir/minimal.log"
log="$work_dir/minimal.log"
expect_line "$log" "-- idem: tests skipped (needs Catch2 2: apt-get install catch2)"
expect_line "$log" "-- idem: examples/quickstart-http skipped (needs libcpp-httplib-dev)"
expect_line "$log" "-- idem: examples/payments skipped (needs libcpp-httplib-dev, nlohmann-json3-dev and the idem::asio component (libboost1.81-dev))"
expect_line "$log" "-- idem: examples/consumer skipped (needs nlohmann-json3-dev)"
expect_line "$log" "-- idem: examples/beast-http skipped (needs the idem::asio component: Boost >= 1.81)"
expect_line "$log" "-- idem: the docs target skipped (needs doxygen: apt-get install doxygen)"
expect_line "$log" "-- idem: idemctl skipped (needs CLI11 and nlohmann-json: apt-get install libcli11-dev nlohmann-json3-dev)"
if grep -q "CMake Warning" "$log"; then
    fail "the configure printed warnings"
fi

echo "configure test: cmake --build"
# As many jobs as cores; under the calling build's ccache its objects of the library are hits.
cmake --build "$work_dir/minimal" -j "$(nproc)"
echo "configure test: cmake --install"
cmake --install "$work_dir/minimal" --prefix "$work_dir/prefix"
for file in include/idem/idem.hpp lib/cmake/idem/idemConfig.cmake lib/pkgconfig/idem.pc; do
    [[ -f "$work_dir/prefix/$file" ]] || fail "cmake --install did not install $file"
done
[[ ! -e "$work_dir/prefix/include/idem/asio.hpp" ]] || fail "the asio headers were installed without the component"
[[ ! -e "$work_dir/prefix/bin/idemctl" ]] || fail "idemctl was installed although it was skipped"

# An explicit ON is a promise: a missing dependency is an error, not a skip.
expect_failure() {
    local name=$1 option=$2
    shift 2
    if cmake -S "$source_dir" -B "$work_dir/$name" "${without[@]}" "$@" >"$work_dir/$name.log" 2>&1; then
        cat "$work_dir/$name.log"
        fail "-D$option=ON configured although its dependency is missing"
    fi
    grep -q "idem: $option=ON but " "$work_dir/$name.log" ||
        { cat "$work_dir/$name.log"; fail "-D$option=ON failed without idem's message"; }
    echo "configure test: -D$option=ON without its dependency fails: $(grep -m1 "idem: $option=ON" "$work_dir/$name.log")"
}
expect_failure tests-on IDEM_BUILD_TESTS -DIDEM_BUILD_TESTS=ON "$@"
expect_failure examples-on IDEM_BUILD_EXAMPLES -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_EXAMPLES=ON "$@"
expect_failure docs-on IDEM_BUILD_DOCS -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_DOCS=ON "$@"
expect_failure tools-on IDEM_BUILD_TOOLS -DIDEM_BUILD_TESTS=OFF -DIDEM_BUILD_TOOLS=ON "$@"
echo "configure test: ok"
