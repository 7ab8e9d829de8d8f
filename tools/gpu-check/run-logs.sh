# shellcheck shell=bash
# What tools/gpu-check.sh --run shows of its logs and its build dir on the
# console: which suites were built and run, the first build error, the tails
# of failed suites, test_summary.py's table and the failed suites' names.
# shellcheck disable=SC2154  # build: run_main's

# suite_states before|after: prints `built NAME` for each test of the build
# dir, or `missing NAME` when its executable was not built, or (after) `notrun
# NAME` when testlog.json lacks it (meson test stopped before starting it).
suite_states() {
  python3 "$gpu_check_dir/suite_states.py" "$build" "$1"
}

# The first failed edge of a ninja log (the error itself) and how many more
# failed; after a timeout, how far the build got.
build_failure_tail() {
  awk '/^FAILED: / {f++; if (f == 1) n = 1}
       n && n <= 40 && !/^ninja: build stopped/ {print; n++}
       /^\[[0-9]+\/[0-9]+\]/ {step = $1}
       END { if (f > 1) print "(" f - 1 " more failed steps in build.log)"
             if (!f) print "no step failed; the last one started: " step }' "$1"
  tail -n 1 "$1"
}

# The last lines of each failed suite from test_summary.py's ===== blocks.
suite_tails() {
  awk -v keep=15 -v most=6 '
    /^===== end of / { if (shown < most) { print head; s = (n > keep ? n - keep : 0)
                         for (i = s; i < n; i++) print buf[i]; print $0 }
                       shown++; inblock = 0; next }
    /^===== .*: .* \(exit .*\) =====$/ { inblock = 1; head = $0; n = 0; next }
    inblock { buf[n++] = $0 }
    END { if (shown > most) print "(" shown - most " more failed suites in test.log)" }' "$1"
}

# test_summary.py's table: from its header to the counts line.
suite_table() {
  awk '/^suite +result +passed/ {t = 1} t' "$1"
}

# The suites that table counts as failed, as test_summary.py does.
failed_suite_names() {
  awk '/^suite +result +passed/ {t = 1; next}
       t && $2 ~ /^[A-Z]+$/ && $3 ~ /^[0-9]+$/ &&
       (($2 != "OK" && $2 != "EXPECTEDFAIL") || $4 > 0) {printf "%s%s", sep, $1; sep = " "}' "$1"
}
