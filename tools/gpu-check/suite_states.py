#!/usr/bin/env python3
"""Says which of a Meson build dir's tests were built and which were run.

    suite_states.py BUILD_DIR before|after

For each test in BUILD_DIR/meson-info/intro-tests.json prints one line:
`missing NAME` when its executable does not exist (the build did not make
it), else with `after`, `notrun NAME` when meson-logs/testlog.json exists
and has no record of it (meson test was stopped before starting it), else
`built NAME`. With `before`, testlog.json is not read.
"""
import json, os, sys
build, when = sys.argv[1], sys.argv[2]
log = os.path.join(build, "meson-logs", "testlog.json")
ran = None
if when == "after" and os.path.exists(log):
    # Newer Meson names a test "project:name" there.
    ran = {json.loads(l)["name"].split(":")[-1] for l in open(log) if l.strip()}
for t in json.load(open(os.path.join(build, "meson-info", "intro-tests.json"))):
    if not os.path.exists(t["cmd"][0]):
        print("missing", t["name"])
    elif ran is not None and t["name"] not in ran:
        print("notrun", t["name"])
    else:
        print("built", t["name"])
