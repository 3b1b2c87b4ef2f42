#!/usr/bin/env bash
# Install (or report) the Debian packages needed to build and test idem.
#
# Usage: scripts/install-deps.sh [--with-examples] [--with-asio] [--with-fault] [--with-clang] [--with-failover] [--with-docs] [--with-redis] [--with-grpc] [--all]
#
#   (core, always)    cmake g++ make ninja-build ccache pkg-config libpq-dev libssl-dev openssl libfmt-dev
#                     catch2 postgresql-15 postgresql-client-15 libcli11-dev nlohmann-json3-dev
#                     (idemctl; nlohmann-json3-dev also for its test and some examples)
#   --with-examples   libcpp-httplib-dev wrk
#   --with-asio       libboost1.81-dev (the idem::asio component: Boost.Asio and Beast, header-only)
#   --with-fault      pgbouncer (the fault suite's transaction-pooling scenario)
#   --with-clang      clang libclang-rt-14-dev clang-format-14 (libFuzzer and clang sanitizer
#                     runtimes; scripts/format.sh)
#   --with-failover   patroni etcd-server etcd-client (the Patroni failover scenario)
#   --with-docs       doxygen (the `docs` target and the idem_docs test: the API reference)
#   --with-redis      libhiredis-dev redis-server (the idem::redis component and its tests)
#   --with-grpc       libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc (the
#                     idem::grpc component, its tests and examples/grpc-payments)
#   --all             everything above
#
# As root, missing packages are installed with apt-get. Otherwise the missing packages and
# the command to install them are printed and the script exits 1.
#
# Note: never add `npm` here; it conflicts with the machine's nodesource nodejs.
set -euo pipefail

core=(cmake g++ make ninja-build ccache pkg-config libpq-dev libssl-dev openssl libfmt-dev catch2 postgresql-15
      postgresql-client-15 libcli11-dev nlohmann-json3-dev)
examples=(libcpp-httplib-dev wrk)
asio_pkgs=(libboost1.81-dev)
clang_pkgs=(clang libclang-rt-14-dev clang-format-14)
fault_pkgs=(pgbouncer)
failover_pkgs=(patroni etcd-server etcd-client)
docs_pkgs=(doxygen)
redis_pkgs=(libhiredis-dev redis-server)
grpc_pkgs=(libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc)

usage() { sed -n '2,24s/^# \{0,1\}//p' "$0"; }

wanted=("${core[@]}")
with_examples=0
with_clang=0
with_asio=0
with_fault=0
with_failover=0
with_docs=0
with_redis=0
with_grpc=0
for arg in "$@"; do
    case "$arg" in
        --with-examples) with_examples=1 ;;
        --with-asio) with_asio=1 ;;
        --with-fault) with_fault=1 ;;
        --with-clang) with_clang=1 ;;
        --with-failover) with_failover=1 ;;
        --with-docs) with_docs=1 ;;
        --with-redis) with_redis=1 ;;
        --with-grpc) with_grpc=1 ;;
        --all) with_examples=1; with_asio=1; with_clang=1; with_fault=1; with_failover=1; with_docs=1; with_redis=1
               with_grpc=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "install-deps: unknown argument: $arg" >&2; usage >&2; exit 2 ;;
    esac
done
((with_examples)) && wanted+=("${examples[@]}")
((with_asio)) && wanted+=("${asio_pkgs[@]}")
((with_clang)) && wanted+=("${clang_pkgs[@]}")
((with_fault)) && wanted+=("${fault_pkgs[@]}")
((with_failover)) && wanted+=("${failover_pkgs[@]}")
((with_docs)) && wanted+=("${docs_pkgs[@]}")
((with_redis)) && wanted+=("${redis_pkgs[@]}")
((with_grpc)) && wanted+=("${grpc_pkgs[@]}")

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-deps: dpkg-query not found; this script supports Debian/Ubuntu only." >&2
    echo "install-deps: needed packages: ${wanted[*]}" >&2
    exit 1
fi

missing=()
for pkg in "${wanted[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "install-deps: all ${#wanted[@]} required packages are installed."
    exit 0
fi

install_cmd=(apt-get install -y --no-install-recommends "${missing[@]}")

if [[ "$(id -u)" -ne 0 ]]; then
    {
        echo "install-deps: missing Debian packages: ${missing[*]}"
        echo "install-deps: install them as root with:"
        echo "    apt-get update && DEBIAN_FRONTEND=noninteractive ${install_cmd[*]}"
        echo "install-deps: (or prefix each apt-get with sudo)"
    } >&2
    exit 1
fi

echo "install-deps: installing missing packages: ${missing[*]}"
apt-get update
DEBIAN_FRONTEND=noninteractive "${install_cmd[@]}"
echo "install-deps: done."
