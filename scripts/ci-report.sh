#!/usr/bin/env bash
# Print how long each CI stage took and the slowest tests of the run.
#
# Usage: scripts/ci-report.sh STAGES_FILE [N]
#
#   STAGES_FILE  one line per stage: NAME START SECONDS STATUS [JUNIT_XML...] (written by .ci/run;
#                START: seconds into the run);
#                each JUNIT_XML is a ctest --output-junit file (scripts/test.sh writes
#                BUILD_DIR/ctest-junit.xml) whose test times are listed under that stage
#   N            how many of the slowest tests to list (default 10)
#
# Missing or half-written JUnit files (a stage that failed early) are skipped, never an error:
# the report is printed on every exit of .ci/run, failed or not.
set -euo pipefail

stages="${1:?usage: scripts/ci-report.sh STAGES_FILE [N]}"
top="${2:-10}"
[[ -f "$stages" ]] || exit 0

python3 - "$stages" "$top" <<'PY'
import sys
import xml.etree.ElementTree as ET

stages_file, top = sys.argv[1], int(sys.argv[2])
rows, tests = [], []
for line in open(stages_file):
    parts = line.split()
    if len(parts) < 4:
        continue
    name, begin, seconds, status, junits = parts[0], int(parts[1]), int(parts[2]), parts[3], parts[4:]
    rows.append((name, begin, seconds, status))
    for path in junits:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            try:
                tests.append((float(case.get("time", "0")), name, case.get("name", "?")))
            except ValueError:
                pass

def mmss(s):
    return f"{int(s) // 60}m{int(s) % 60:02d}s"

print("\n==> CI stages (stages beside each other overlap)")
print(f"  {'stage':<12} {'from':>7} {'to':>7} {'took':>7}")
for name, begin, seconds, status in sorted(rows, key=lambda r: r[1]):
    print(f"  {name:<12} {mmss(begin):>7} {mmss(begin + seconds):>7} {mmss(seconds):>7}  {status}")
if tests:
    print(f"\n==> The {min(top, len(tests))} slowest tests")
    for t, stage, name in sorted(tests, reverse=True)[:top]:
        print(f"  {t:8.1f} s  {stage:<10} {name}")
PY
