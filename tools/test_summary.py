#!/usr/bin/env python3
"""Counts doctest test cases across the suites of one `meson test` run.

Reads BUILD_DIR/meson-logs/testlog.json (one JSON object per suite, with the
suite's output and meson's verdict), prints a line per suite and the full
output of every suite that failed, and ends with exactly one line

    N passed, N failed, N skipped

Exit status: 0 when every suite passed and no test case failed, 1 otherwise.

Why the counts come from the suites' own output: meson only knows whether an
executable exited 0, while doctest prints
`[doctest] test cases: N | N passed | N failed | N skipped` at its end. A suite
that never reaches that line (crash, sanitizer abort, timeout) or that exits
non-zero without any failed test case (a leak found at exit) counts as one
failed test case, so no failure can vanish from the total.
"""
import json
import re
import sys
from pathlib import Path

SUMMARY = re.compile(
    r"\[doctest\] test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed"
    r"(?:\s*\|\s*(\d+) skipped)?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
OK_RESULTS = {"OK", "EXPECTEDFAIL"}
# Long logs are cut in the middle: the first failures and the end (where a
# crash or sanitizer report lands) are what one reads.
HEAD_LINES, TAIL_LINES = 200, 200


def excerpt(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= HEAD_LINES + TAIL_LINES:
        return "\n".join(lines)
    cut = len(lines) - HEAD_LINES - TAIL_LINES
    return "\n".join(lines[:HEAD_LINES] + [f"... ({cut} lines cut) ..."]
                     + lines[-TAIL_LINES:])


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print("usage: test_summary.py BUILD_DIR [MESON_TEST_EXIT_STATUS]", file=sys.stderr)
        return 2
    meson_rc = int(sys.argv[2]) if len(sys.argv) == 3 else 0
    log = Path(sys.argv[1]) / "meson-logs" / "testlog.json"
    if not log.is_file():
        print(f"test_summary: {log} not found (meson test did not run)")
        print("0 passed, 1 failed, 0 skipped")
        return 1

    results = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_suites = []
    rows = []
    for r in results:
        out = ANSI.sub("", (r.get("stdout") or "") + (r.get("stderr") or ""))
        found = SUMMARY.findall(out)
        verdict = r.get("result", "?")
        if found:
            _, passed, failed, skipped = (int(v or 0) for v in found[-1])
        else:
            passed = failed = skipped = 0
        note = ""
        if verdict not in OK_RESULTS and failed == 0:
            # The executable failed without a failing test case to show for it.
            failed = 1
            note = "no doctest summary" if not found else "non-zero exit"
        if verdict not in OK_RESULTS or failed:
            failed_suites.append((r, out))
        total["passed"] += passed
        total["failed"] += failed
        total["skipped"] += skipped
        rows.append((r["name"], verdict, passed, failed, skipped, r.get("duration", 0.0), note))

    for r, out in failed_suites:
        print(f"===== {r['name']}: {r.get('result')} (exit {r.get('returncode')}) "
              f"=====\n$ {' '.join(r.get('command') or [])}\n{excerpt(out)}\n"
              f"===== end of {r['name']} =====")

    width = max((len(row[0]) for row in rows), default=5)
    print(f"{'suite':<{width}}  {'result':<8} {'passed':>6} {'failed':>6} "
          f"{'skipped':>7} {'seconds':>8}")
    for name, verdict, p, f, s, secs, note in rows:
        print(f"{name:<{width}}  {verdict:<8} {p:>6} {f:>6} {s:>7} {secs:>8.1f}"
              + (f"  ({note})" if note else ""))
    if not rows:
        print("(no suites ran)")
    if meson_rc != 0 and not failed_suites and not total["failed"]:
        # meson failed without any suite failing (e.g. an unknown suite name).
        print(f"meson test exited {meson_rc} with every suite passing")
        total["failed"] += 1
        failed_suites.append(None)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if failed_suites or total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
