#!/usr/bin/env bash
# Re-runs the training figures README.md quotes (the 200-step example with 2
# and 1 threads, and with --nproc 2) and prints each final line beside the
# command, so the README's figures come from one script, never by hand.
#
#   tools/dev/readme-figures.sh [QUANTA]      QUANTA defaults to build/tools/quanta
#
# The figures depend on the thread count (the CPU kernels split their sums by
# thread), so every command names it. Takes about 20 s on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
quanta="${1:-$root/build/tools/quanta}"
[ -x "$quanta" ] || { echo "readme-figures: no quanta binary at $quanta (build first)"; exit 2; }
work="$(mktemp -d /tmp/quanta-figures.XXXXXX)"
trap 'rm -rf "$work"' EXIT

run() {  # run NAME ARGS...: one training run, its last "done:" line
  local name="$1"; shift
  local line
  line="$("$quanta" train --steps 200 --limit-test 1000 --out "$work/$name" "$@" 2>&1 \
          | grep -E 'done: ' | tail -n 1)"
  printf '%-34s %s\n' "$*" "${line#\[rank 0\] }"
}

echo "quanta train --steps 200 --limit-test 1000 plus:"
run threads2 --threads 2
run threads1 --threads 1
run nproc2 --nproc 2
