#!/usr/bin/env bash
# Re-runs the quantizer comparison of docs/train.md ("Recipes") and prints
# its two tables as Markdown rows (every quantizer type at its recipe, then
# what each part of a recipe does), so those figures come from one script, as
# the README's do from tools/dev/readme-figures.sh: hand-copied figures drift.
#
#   tools/dev/train-figures.sh [QUANTA] [--short-only]
#                                   QUANTA defaults to build/tools/quanta
#
# Every run is `--threads 1`: the CPU kernels split some sums by thread, so
# the figures depend on the thread count, and one thread also keeps them
# independent of what else the machine runs. Only the time column depends on
# the machine and its load. The long table (whole test set) takes about 10
# minutes on one free core, the short one (2,000 test images) about 6; both
# train for the default 2 epochs.
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

levels_cell() {  # levels_cell DIR: each codebook's usage ("100.0/98.2/...%") or "-"
  python3 - "$1/metrics.jsonl" <<'EOF'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "eval"]
levels = evals[-1].get("codebook_usage_per_level")
print("/".join(f"{100 * u:.1f}" for u in levels) + "%" if levels else "-")
EOF
}

if [ "$short_only" = 0 ]; then
  echo "| quantizer (command: \`quanta train --threads 1\` plus) | steps | test MSE | usage | usage per codebook | perplexity | time |"
  echo "|---|---|---|---|---|---|---|"
  long_row() {  # long_row LABEL NAME ARGS...
    local label="$1" name="$2"; shift 2
    local secs steps mse first
    secs="$(run "$name" "$@")"
    steps="$(grep -o 'done: [0-9]*' "$work/$name.log" | grep -o '[0-9]*$')"
    mse="$(metric "$work/$name" test_mse 5)"
    first="$(metric "$work/$name" test_mse 5 first)"
    [ "$first" != "$mse" ] && mse="$mse ($first after epoch 1)"
    echo "| $label | $steps | $mse | $(usage_cell "$work/$name") | $(levels_cell "$work/$name") | $(metric "$work/$name" perplexity 1) | ${secs} s |"
  }
  long_row "vq, the default (nothing): 512 codes" vq
  long_row "none (\`--quantizer none\`)" none --quantizer none
  long_row "rvq (\`--quantizer rvq\`: 4 levels of 512)" rvq --quantizer rvq
  long_row "grvq (\`--quantizer grvq\`: 2 groups x 4 levels of 512)" grvq --quantizer grvq
  long_row "simvq (\`--quantizer simvq\`: 512 codes)" simvq --quantizer simvq
  long_row "fsq (\`--quantizer fsq\`: 8,8,8 = 512 codes)" fsq --quantizer fsq
  long_row "the same, \`--seed 1\`" fsq1 --quantizer fsq --seed 1
  long_row "the same, \`--seed 2\`" fsq2 --quantizer fsq --seed 2
  long_row "fsp (\`--quantizer fsp\`: 8,8,8)" fsp --quantizer fsp
  long_row "rfsq (\`--quantizer rfsq\`: 4 levels of 8,8,8)" rfsq --quantizer rfsq
  long_row "lfq (\`--quantizer lfq\`: 2^10 codes)" lfq --quantizer lfq
  long_row "lfq, \`--codebook-size 65536\` (2^16 codes)" lfq16 --quantizer lfq --codebook-size 65536
  long_row "rlfq (\`--quantizer rlfq\`: 4 levels of 512)" rlfq --quantizer rlfq
  long_row "hvq (\`--quantizer hvq\`: levels 1x1, 2x2, 4x4, 7x7 of 512)" hvq --quantizer hvq
  long_row "the same, \`--seed 1\`" hvq1 --quantizer hvq --seed 1
  long_row "hvq, \`--shared-codebook\` (one codebook for the 4 levels)" hvq_shared --quantizer hvq --shared-codebook
  long_row "hvq, \`--scales 1,2,3,4,5,7\` (6 levels)" hvq6 --quantizer hvq --scales 1,2,3,4,5,7
  echo
fi

echo "What each part of a recipe does (2 epochs, \`--limit-test 2000\`, so 2,000 test images):"
echo
echo "| quantizer | test MSE | usage | usage per codebook | perplexity |"
echo "|---|---|---|---|---|"
short_row() {  # short_row LABEL NAME ARGS...
  local label="$1" name="$2"; shift 2
  run "$name" --limit-test 2000 "$@" >/dev/null
  echo "| $label | $(metric "$work/$name" test_mse 5) | $(usage_cell "$work/$name") | $(levels_cell "$work/$name") | $(metric "$work/$name" perplexity 1) |"
}
short_row "vq, the default" s_vq
short_row "vq, \`--threshold-ema-dead-code 0\` (no dead-code expiry)" s_vq_nodead --threshold-ema-dead-code 0
short_row "rvq" s_rvq --quantizer rvq
short_row "rvq, \`--threshold-ema-dead-code 0 --kmeans-init=false\`" s_rvq_plain --quantizer rvq --threshold-ema-dead-code 0 --kmeans-init=false
short_row "fsq" s_fsq --quantizer fsq
short_row "fsq, \`--latent-norm-groups 0\` (no latent norm)" s_fsq_nonorm --quantizer fsq --latent-norm-groups 0
short_row "fsq, \`--seed 2\`" s_fsq_s2 --quantizer fsq --seed 2
short_row "fsq, \`--seed 2 --latent-norm-groups 0\`" s_fsq_s2_nonorm --quantizer fsq --seed 2 --latent-norm-groups 0
short_row "rfsq" s_rfsq --quantizer rfsq
short_row "rfsq, \`--quantize-dropout=false\`" s_rfsq_nodrop --quantizer rfsq --quantize-dropout=false
short_row "lfq" s_lfq --quantizer lfq
short_row "lfq, \`--latent-norm-groups 0\`" s_lfq_nonorm --quantizer lfq --latent-norm-groups 0
short_row "lfq, \`--spherical=false --entropy-loss-weight 0.1\`" s_lfq_plain --quantizer lfq --spherical=false --entropy-loss-weight 0.1
short_row "lfq, \`--spherical=false --entropy-loss-weight 0.1 --latent-norm-groups 0\` (none of the recipe but D = 10)" s_lfq_none --quantizer lfq --spherical=false --entropy-loss-weight 0.1 --latent-norm-groups 0
