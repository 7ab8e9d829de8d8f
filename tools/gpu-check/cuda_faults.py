#!/usr/bin/env python3
"""The failed suites of a meson test log whose output shows a CUDA fault.

Usage: cuda_faults.py TESTLOG_JSON [MAX]

A kernel that faults (an illegal or misaligned address, a trap) poisons its
process's CUDA context: every later case of that suite fails too, and the
log says only that something did. For at most MAX (default 2) such suites
this prints one line each, the suite's name, a tab, and its test program's
command (shell-quoted, the timeout wrapper left off), for gpu-check to run
again under compute-sanitizer, which names the kernel and the source line.
"""
import json
import shlex
import sys

FAULTS = (
    "illegal memory access",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "device-side assert",
    "cudaErrorLaunchFailure",
    "cudaErrorIllegalAddress",
)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    found = 0
    try:
        lines = open(sys.argv[1], encoding="utf-8", errors="replace").readlines()
    except OSError as e:
        sys.exit(f"cuda_faults: {e}")
    for line in lines:
        try:
            test = json.loads(line)
        except json.JSONDecodeError:
            continue
        if test.get("result") == "OK" or test.get("result") == "SKIP":
            continue
        out = test.get("stdout") or ""
        if not any(f in out for f in FAULTS):
            continue
        command = test.get("command") or []
        # The program is the first word under tests/ (meson may put the
        # timeout wrapper in front).
        start = next((i for i, w in enumerate(command) if "/tests/test_" in w), None)
        if start is None:
            continue
        print(f"{test.get('name', '?')}\t{shlex.join(command[start:])}")
        found += 1
        if found >= limit:
            break


if __name__ == "__main__":
    main()
