#!/usr/bin/env bash
# Format idem's C and C++ sources with the repository's .clang-format (clang-format 14).
#
# Usage: scripts/format.sh [--check] [FILE...]
#
#   (no option)  rewrite the files in place
#   --check      change nothing: name each file clang-format would change, exit 1 if there is one
#   FILE...      these files only (default: every *.c, *.h, *.cpp and *.hpp that git tracks)
#
# Uses $CLANG_FORMAT, else clang-format-14, else clang-format (which must be version 14: another
# version formats some lines differently). As root, installs clang-format-14 with apt-get when
# none is found (scripts/install-deps.sh --with-clang).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,12s/^# \{0,1\}//p' "$0"; }

check=0
files=()
while (($# > 0)); do
    case "$1" in
        --check) check=1 ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "format.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
        *) files+=("$1") ;;
    esac
    shift
done

find_clang_format() {
    local c
    for c in "${CLANG_FORMAT:-}" clang-format-14 clang-format; do
        if [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}
if ! clang_format="$(find_clang_format)"; then
    scripts/install-deps.sh --with-clang
    clang_format="$(find_clang_format)" || { echo "format.sh: no clang-format found" >&2; exit 1; }
fi
version="$("$clang_format" --version)"
if [[ "$version" != *"version 14."* ]]; then
    echo "format.sh: $clang_format is not clang-format 14 ($version)" >&2
    exit 1
fi

if ((${#files[@]} == 0)); then
    mapfile -t files < <(git ls-files '*.c' '*.h' '*.cpp' '*.hpp')
fi

if ((!check)); then
    "$clang_format" -i "${files[@]}"
    exit 0
fi
unformatted=()
for f in "${files[@]}"; do
    "$clang_format" "$f" | cmp -s - "$f" || unformatted+=("$f")
done
if ((${#unformatted[@]} > 0)); then
    echo "format.sh: ${#unformatted[@]} of ${#files[@]} files are not formatted (run scripts/format.sh):" >&2
    printf '  %s\n' "${unformatted[@]}" >&2
    exit 1
fi
echo "format.sh: ${#files[@]} files formatted"
