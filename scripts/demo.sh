#!/usr/bin/env bash
# Build and run the quickstart example against a throwaway PostgreSQL cluster.
#
# Usage: scripts/demo.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=build/debug

step() {
    printf '\n==> %s\n' "$*"
}

step "Checking dependencies"
scripts/install-deps.sh --with-examples

# Same configuration as scripts/test.sh (default variant) so the build dir is shared.
step "Configuring $build_dir"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DIDEM_WERROR=ON -DIDEM_BUILD_TESTS=ON \
    -DIDEM_BUILD_EXAMPLES=ON

step "Building quickstart"
cmake --build "$build_dir" -j"$(nproc)" --target quickstart

step "Running quickstart"
scripts/with-postgres.sh "$build_dir/examples/quickstart/quickstart"
