#!/usr/bin/env bash
# Re-runs the quantizer comparison of docs/train.md ("Measured") and prints
# its two tables as Markdown rows, so those figures come from one script, as
# the README's do from tools/dev/readme-figures.sh: hand-copied figures drift.
#
#   tools/dev/train-figures.sh [QUANTA] [--short-only]
#                                   QUANTA defaults to build/tools/quanta
#
# Every run is `--threads 1`: the CPU kernels split some sums by thread, so
# the figures depend on the thread count, and one thread also keeps them
# independent of what else the machine runs. Only the time column depends on
# the machine and its load. The long table (whole dataset, 1 or 2 epochs) takes
# about 20 minutes on one free core, the short one (400 steps) about 8.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly root
quanta="$root/build/tools/quanta"
short_only=0
for arg in "$@"; do
  case "$arg" in
    --short-only) short_only=1 ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) quanta="$arg" ;;
  esac
done
[ -x "$quanta" ] || { echo "train-figures: no quanta binary at $quanta (build first)"; exit 2; }
work="$(mktemp -d /tmp/quanta-train-figures.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# The value after `key` in the last eval record of metrics.jsonl, printed
# with `digits` decimals ("n/a" for NaN or absent).
metric() {  # metric DIR KEY DIGITS [WHICH: last|first]
  python3 - "$1/metrics.jsonl" "$2" "$3" "${4:-last}" <<'EOF'
import json, math, sys
path, key, digits, which = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
evals = [r for r in map(json.loads, open(path)) if r.get("kind") == "eval"]
r = evals[-1] if which == "last" else evals[0]
v = r.get(key)
print("n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}")
EOF
}

# run NAME ARGS...: one training run into $work/NAME; prints its wall seconds.
run() {
  local name="$1"; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$quanta" train --threads 1 --out "$work/$name" "$@" >"$work/$name.log" 2>&1 || {
    echo "train-figures: quanta train $* failed:" >&2; tail -n 5 "$work/$name.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  python3 -c "print(round($t1 - $t0))"
}

usage_cell() {  # usage_cell DIR: "100%" or "n/a"
  local u; u="$(metric "$1" codebook_usage 4)"
  [ "$u" = n/a ] && { echo n/a; return; }
  python3 -c "print(f'{100 * $u:.1f}%')"
}

if [ "$short_only" = 0 ]; then
  echo "| quantizer (command: \`quanta train --threads 1\` plus) | steps | test MSE | usage | perplexity | time |"
  echo "|---|---|---|---|---|---|"
  long_row() {  # long_row LABEL NAME ARGS...
    local label="$1" name="$2"; shift 2
    local secs steps mse first
    secs="$(run "$name" "$@")"
    steps="$(grep -o 'done: [0-9]*' "$work/$name.log" | grep -o '[0-9]*$')"
    mse="$(metric "$work/$name" test_mse 5)"
    first="$(metric "$work/$name" test_mse 5 first)"
    [ "$first" != "$mse" ] && mse="$mse ($first after epoch 1)"
    echo "| $label | $steps | $mse | $(usage_cell "$work/$name") | $(metric "$work/$name" perplexity 1) | ${secs} s |"
  }
  long_row "vq, the default (nothing)" vq
  long_row "none (\`--quantizer none\`)" none --quantizer none
  long_row "fsq (\`--quantizer fsq --epochs 1\`: levels 8,5,5,5, projections 16 -> 4)" fsq --quantizer fsq --epochs 1
  long_row "fsq without projections (\`--quantizer fsq --dim 4 --epochs 1\`)" fsq4 --quantizer fsq --dim 4 --epochs 1
  long_row "lfq (\`--quantizer lfq --epochs 1 --limit-test 2000\`: 65536 codes, a bit per channel, no projections)" lfq --quantizer lfq --epochs 1 --limit-test 2000
  long_row "lfq with 512 codes (\`--quantizer lfq --codebook-size 512 --epochs 1\`: projections 16 -> 9)" lfq512 --quantizer lfq --codebook-size 512 --epochs 1
  long_row "the same with \`--lr 1e-3\`" lfq512lr --quantizer lfq --codebook-size 512 --epochs 1 --lr 1e-3
  long_row "the same with \`--lr 1e-3 --dim 9 --commitment-loss-weight 0.25 --limit-test 2000\`" lfq512d9 --quantizer lfq --codebook-size 512 --epochs 1 --lr 1e-3 --dim 9 --commitment-loss-weight 0.25 --limit-test 2000
  echo
fi

echo "Shorter runs (\`--steps 400 --limit-test 2000\`, so 2,000 test images):"
echo
echo "| quantizer | test MSE | usage | perplexity |"
echo "|---|---|---|---|"
short_row() {  # short_row LABEL NAME ARGS...
  local label="$1" name="$2"; shift 2
  run "$name" --steps 400 --limit-test 2000 "$@" >/dev/null
  echo "| $label | $(metric "$work/$name" test_mse 5) | $(usage_cell "$work/$name") | $(metric "$work/$name" perplexity 1) |"
}
short_row "vq, the default" s_vq
short_row "vq, \`--threshold-ema-dead-code 0\` (no dead-code expiry)" s_vq_nodead --threshold-ema-dead-code 0
short_row "none" s_none --quantizer none
short_row "fsq" s_fsq --quantizer fsq
short_row "fsq, \`--dim 4\`" s_fsq4 --quantizer fsq --dim 4
short_row "rvq, \`--kmeans-init --threshold-ema-dead-code 2\` (4 levels of 512)" s_rvq --quantizer rvq --kmeans-init --threshold-ema-dead-code 2
short_row "lfq, \`--codebook-size 65536\` (the lfq default)" s_lfq --quantizer lfq --codebook-size 65536
short_row "lfq, \`--codebook-size 512\`" s_lfq512 --quantizer lfq --codebook-size 512
short_row "lfq, \`--codebook-size 512 --lr 1e-3\`" s_lfq512lr --quantizer lfq --codebook-size 512 --lr 1e-3
short_row "lfq, \`--codebook-size 512 --dim 9\`" s_lfq512d9 --quantizer lfq --codebook-size 512 --dim 9
short_row "lfq, \`--codebook-size 512 --commitment-loss-weight 0.25\`" s_lfq512c --quantizer lfq --codebook-size 512 --commitment-loss-weight 0.25
short_row "lfq, \`--codebook-size 512 --entropy-loss-weight 0.02\`" s_lfq512e --quantizer lfq --codebook-size 512 --entropy-loss-weight 0.02
short_row "rlfq (4 levels of 512, projections 16 -> 9)" s_rlfq --quantizer rlfq
