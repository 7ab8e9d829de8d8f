#!/usr/bin/env bash
# Builds quanta and runs every doctest suite, then counts test cases.
#
#   tools/run-tests.sh [BUILD_DIR [MESON_OPTION...]]
#
# BUILD_DIR defaults to `build` (the README's build dir). It is configured
# with the given options when it does not exist yet (or reconfigured with
# them when it does), built with ninja, and tested with `meson test`.
# The last line printed is always `N passed, N failed, N skipped`, counted
# from the suites' own doctest summaries (tools/test_summary.py); a suite that
# crashes or times out before its summary counts as one failed test case, and
# a configure or build failure prints `0 passed, 1 failed, 0 skipped`.
# Exit status is non-zero on any failure.
#
# Environment:
#   QUANTA_TEST_TIMEOUT_MULTIPLIER  scales each suite's timeout (900 s in
#                                   tests/meson.build); default 0.34, about
#                                   5 minutes, so one hung suite cannot eat
#                                   CI's 30-minute budget
#   NINJA_JOBS                      parallel build jobs (default: ninja's)
#   MESON_TEST_JOBS                 suites run at once (default: meson's)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="${1:-build}"
[ $# -gt 0 ] && shift
setup_opts=("$@")

# Meson 1.0.1 looks for the CUDA compiler only as `nvcc` on PATH (it reads no
# NVCC/CUDACXX variable), and CUDA's installer leaves nvcc in
# /usr/local/cuda/bin. Without nvcc the build is CPU-only, which is fine.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

fail_line() {
  echo "run-tests: $1 failed in $build"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
}

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "${setup_opts[@]}" || fail_line "meson setup"
elif [ ${#setup_opts[@]} -gt 0 ]; then
  meson configure "$build" "${setup_opts[@]}" || fail_line "meson configure"
fi

ninja_args=(-C "$build")
[ -n "${NINJA_JOBS:-}" ] && ninja_args+=(-j "$NINJA_JOBS")
ninja "${ninja_args[@]}" || fail_line "build"

# A stale log from an earlier run must never be counted.
rm -f "$build/meson-logs/testlog.json"
test_args=(-C "$build" --no-rebuild
           --timeout-multiplier "${QUANTA_TEST_TIMEOUT_MULTIPLIER:-0.34}")
[ -n "${MESON_TEST_JOBS:-}" ] && test_args+=(--num-processes "$MESON_TEST_JOBS")
meson_rc=0
meson test "${test_args[@]}" || meson_rc=$?

# The counts come from the suites' output; meson's exit status goes along so
# that a failure meson saw but no suite shows still counts.
exec python3 "$root/tools/test_summary.py" "$build" "$meson_rc"
