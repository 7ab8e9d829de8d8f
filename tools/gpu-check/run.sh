# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck disable=SC2164  # sourced under set -e: a failed cd ends it
# tools/gpu-check.sh --run DIR [--reuse] [-- MESON_OPTION...]: what it does,
# its deadline and its environment variables are in the header of
# tools/gpu-check.sh. This file holds the deadline bookkeeping (stamped
# console lines, budgets, the late phases' shares, run_phase), which phases
# GPU_CHECK_PHASES chooses, and run_main, which runs the phases of
# run-phases.sh, shows their logs through run-logs.sh and prints the summary.

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=run-phases.sh
source "$gpu_check_dir/run-phases.sh"
# shellcheck source=run-logs.sh
source "$gpu_check_dir/run-logs.sh"

# The console log (run_main opens it), the clock the deadline counts from, and
# run_phase's record of each phase for the summary.
console=/dev/null
t0=$SECONDS
deadline=540
declare -A secs=() status=()
phases=()

# Console lines also go to console.log, synchronously: a tee in a process
# substitution could lose the last line, the one that matters, at exit.
show() { tee -a "$console"; }
say() { printf '%s\n' "$*" | show; }
stamp() { say "[$(date +%H:%M:%S) +$((SECONDS - t0))s] $*"; }
# What a phase may take: what is left of the deadline less RESERVE seconds
# for the phases after it, and never under 10 s.
budget() {
  local b=$((deadline - (SECONDS - t0) - $1))
  echo $((b < 10 ? 10 : b))
}

# The phases GPU_CHECK_PHASES may name, in the order they run (info always
# runs; build includes meson setup).
readonly ALL_PHASES=(build test train qlora peer bench profile)
# After build, tests and train, what is left of the deadline (less
# SUMMARY_S) is split in these shares (percent, of the chosen phases' sum),
# in this order: what the next session reads first comes first and a hang
# in one phase cannot take another's share. A phase that ends early leaves
# its rest to those after it, never the other way (late_limit).
readonly LATE_PHASES=(qlora peer bench profile)
declare -rA LATE_SHARE=([qlora]=30 [peer]=40 [bench]=15 [profile]=15)
# The least time worth starting a late phase with.
declare -rA LATE_MIN_S=([qlora]=45 [peer]=30 [bench]=20 [profile]=30)
readonly SUMMARY_S=5
declare -A late_s=()

# The chosen phases, one per line: GPU_CHECK_PHASES's words (commas or
# spaces between them), else all. Fails on a name it does not know.
chosen_phases() {
  local words=() w
  read -r -a words <<<"${GPU_CHECK_PHASES//,/ }"
  [ "${#words[@]}" -gt 0 ] || words=("${ALL_PHASES[@]}")
  for w in "${words[@]}"; do
    [[ " ${ALL_PHASES[*]} " == *" $w "* ]] \
      || die "GPU_CHECK_PHASES: no phase '$w' (phases: ${ALL_PHASES[*]})"
    echo "$w"
  done
}
chosen=" "
wants() { [[ "$chosen" == *" $1 "* ]]; }

# Splits what is left now among the chosen late phases (late_s), once,
# before the first of them.
plan_late() {
  local p total=0 left=$((deadline - (SECONDS - t0) - SUMMARY_S)) plan=""
  for p in "${LATE_PHASES[@]}"; do
    wants "$p" && total=$((total + LATE_SHARE[$p]))
  done
  [ "$total" -gt 0 ] || return 0
  for p in "${LATE_PHASES[@]}"; do
    wants "$p" || continue
    late_s[$p]=$((left > 0 ? left * LATE_SHARE[$p] / total : 0))
    plan+=" $p ${late_s[$p]} s,"
  done
  stamp "the late phases' shares of the ${left} s left:${plan%,}"
}

# What late phase NAME may take: what is left of the deadline less
# SUMMARY_S and the shares of the chosen phases after it.
late_limit() {
  local p after=0 seen=0
  for p in "${LATE_PHASES[@]}"; do
    [ "$seen" -eq 1 ] && wants "$p" && after=$((after + late_s[$p]))
    [ "$p" = "$1" ] && seen=1
  done
  echo $((deadline - (SECONDS - t0) - SUMMARY_S - after))
}

# run_late NAME LOG: runs late phase NAME into LOG with late_limit's
# seconds, or says why it does not start.
run_late() {
  local name="$1" log="$2" limit
  wants "$name" || return 0
  limit="$(late_limit "$name")"
  if [ ! -x "$build/tools/quanta" ]; then
    stamp "phase $name: not run (no $build/tools/quanta)"
  elif [ "$limit" -lt "${LATE_MIN_S[$name]}" ]; then
    stamp "phase $name: not run (${limit} s left for it, it needs ${LATE_MIN_S[$name]})"
  else
    run_phase "$name" "$log" "phase_$name" "$limit" || true
    show <"$log"
  fi
}

# run_phase NAME LOG COMMAND...: runs one phase into LOG, stamping its start
# and end and a progress line every minute (a silent 5-minute build looks
# like a hang). The phase runs as a background job that is waited for: as
# `cmd || rc=$?`, bash would switch off `set -e` inside the phase's functions.
run_phase() {
  local name="$1" log="$2" start=$SECONDS rc=0 job tick
  shift 2
  stamp "phase $name: start (log $log)"
  "$@" >"$log" 2>&1 &
  job=$!
  # The sleep's output goes nowhere: when the ticker is killed, a sleep
  # left running must not hold the caller's stdout open for a minute.
  (while sleep 60 >/dev/null 2>&1; do
     stamp "  $name: $(tail -n 5 "$log" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-160)"
   done) &
  tick=$!
  wait "$job" || rc=$?
  kill "$tick" 2>/dev/null || true
  wait "$tick" 2>/dev/null || true
  secs[$name]=$((SECONDS - start))
  case "$rc" in
    0) status[$name]=ok ;;
    124|137) status[$name]="TIMED OUT (deadline)" ;;
    *) status[$name]="FAILED (exit $rc)" ;;
  esac
  phases+=("$name")
  stamp "phase $name: ${status[$name]} in ${secs[$name]} s"
  return "$rc"
}

run_main() {
  local bundle reuse=0 extra=()
  [ $# -ge 1 ] || die "--run takes DIR"
  bundle="$(cd "$1" && pwd)" || die "no such folder: $1"
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --reuse) reuse=1 ;;
      --) shift; extra=("$@"); break ;;
      *) die "unknown --run argument: $1" ;;
    esac
    shift
  done
  cd "$root"
  local phase_list peer_py=""
  phase_list="$(chosen_phases)"
  chosen=" $(tr '\n' ' ' <<<"$phase_list")"
  deadline="${GPU_CHECK_DEADLINE_S:-540}"
  build="${GPU_CHECK_BUILD_DIR:-build-gpu}"
  setup_opts=(-Dcuda=enabled -Dcudnn=enabled -Dnative=true "${extra[@]}")
  local logs="${OUT:-$root/$build-logs}" work="$root/$build-env" tmp
  mkdir -p "$logs"
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand now: tmp is local
  trap "rm -rf '$tmp'" EXIT
  logs="$(cd "$logs" && pwd)"
  console="$logs/console.log"
  : >"$console"

  stamp "gpu-check --run: bundle $bundle, build dir $build, deadline ${deadline} s, logs $logs"
  # The environment comes first: meson and ninja may be found only by it.
  stamp "environment"
  setup_env "$bundle" "$work" >"$tmp/env.log" 2>&1
  show <"$tmp/env.log"
  { sed 's/^/# /' "$tmp/env.log"; print_exports; } >"$logs/env.sh"
  print_exports | show

  stamp "phases: ${chosen# }"
  # The peers' python before info, which prints it (importing torch takes
  # seconds: once).
  peer_py="$(pick_python)" || peer_py=""
  run_phase info "$tmp/info.log" phase_info || true
  show <"$tmp/info.log"
  local gpu
  gpu="$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total \
         --format=csv,noheader 2>/dev/null | head -n 1)" || true
  [ -n "$gpu" ] || gpu="no GPU visible (nvidia-smi failed)"

  local counts="0 passed, 1 failed, 0 skipped" failed_suites="" ok=1 tested=0
  local built=() missing=() notrun=() configured=1
  wants test || counts="0 passed, 0 failed, 0 skipped"
  if wants build && ! run_phase setup "$logs/setup.log" phase_setup "$(budget 30)"; then
    ok=0
    configured=0
    say "----- tail of setup.log -----"
    tail -n 25 "$logs/setup.log" | show
    say "----- tail of meson-log.txt -----"
    tail -n 40 "$build/meson-logs/meson-log.txt" 2>/dev/null | show || true
  fi
  cp "$build/meson-logs/meson-log.txt" "$logs/" 2>/dev/null || true

  if wants build && [ "$configured" -eq 1 ]; then
    if ! run_phase build "$logs/build.log" phase_build "$(budget 20)"; then
      ok=0
      say "----- build.log: first failure -----"
      build_failure_tail "$logs/build.log" | show
      if [[ "${status[build]}" == TIMED* ]]; then
        say "The build ran out of time: a second call with --reuse goes on where it stopped."
      fi
    fi
  fi
  if wants test && [ "$configured" -eq 1 ] && [ -f "$build/meson-info/intro-tests.json" ]; then
    mapfile -t built < <(suite_states before | sed -n 's/^built //p')
    mapfile -t missing < <(suite_states before | sed -n 's/^missing //p')
  fi

  # After a failed build, the suites that did build still run (each one that
  # did not counts as a failed test case), given a minute to do it in.
  if [ "${#built[@]}" -gt 0 ] && { [ "$ok" -eq 1 ] || [ "$(budget 15)" -ge 60 ]; }; then
    local subset=() last
    [ "${#missing[@]}" -eq 0 ] || subset=("${built[@]}")
    run_phase test "$logs/test.log" phase_test "$(budget 15)" "${subset[@]}" || ok=0
    tested=1
    cp "$build/meson-logs/testlog.json" "$logs/" 2>/dev/null || true
    suite_tails "$logs/test.log" | show
    suite_table "$logs/test.log" | show
    last="$(tail -n 1 "$logs/test.log")"
    [[ "$last" =~ ^[0-9]+\ passed,\ [0-9]+\ failed,\ [0-9]+\ skipped$ ]] && counts="$last"
    failed_suites="$(failed_suite_names "$logs/test.log")"
    mapfile -t notrun < <(suite_states after | sed -n 's/^notrun //p')
  elif wants test; then
    ok=0
  fi
  # Training on both devices, when the build made the quanta command and the
  # four runs' fixed time is left; its result is a phase status of its own,
  # not a test count, but a CUDA run that fails or misses the CPU's test MSE
  # fails the check.
  local train_failed=0 train_need=$((4 * TRAIN_RUN_S))
  if wants train && [ -x "$build/tools/quanta" ]; then
    if [ "$(budget 15)" -ge "$train_need" ]; then
      run_phase train "$logs/train.log" phase_train "$(cap "$(budget 15)" $((6 * TRAIN_RUN_S)))" \
        || train_failed=1
      grep -E '^(== |train |quanta: error|\(exit)' "$logs/train.log" | show || true
    else
      stamp "phase train: not run ($(budget 15) s left, its four runs need ${train_need})"
    fi
  fi
  # The late phases, each in its share: the QLoRA row beside PyTorch + PEFT
  # + bitsandbytes, quanta beside eager PyTorch and torch.compile, the GPU
  # bench suites, the kernel profile. Their logs stay in tmp (the device
  # tool brings back only a few files from OUT); their lines go to the
  # console, the rows and figures into the summary. Timings: nothing is
  # judged by them.
  plan_late
  run_late qlora "$tmp/qlora.log"
  run_late peer "$tmp/peer.log"
  run_late bench "$tmp/bench.log"
  run_late profile "$tmp/profile.log"
  local bench_rows="" peer_lines=""
  # A row: its name, then milliseconds or "unavailable:" (bench's own lines
  # and the phases' remarks are not rows).
  bench_rows="$(cat "$tmp/qlora.log" "$tmp/bench.log" 2>/dev/null \
                | grep -E '^[a-z][A-Za-z0-9_]* +([0-9]|unavailable:)' || true)"
  peer_lines="$(grep -hE '^(peer |graph and --no-graph)' "$tmp/peer.log" 2>/dev/null || true)"
  # Like test_summary.py, no failure may vanish from the count: a suite that
  # was not built, or not started before the deadline, is one failed case.
  local uncounted=$((${#missing[@]} + ${#notrun[@]}))
  [ "$uncounted" -eq 0 ] || ok=0
  [ "${#missing[@]}" -eq 0 ] || failed_suites+="${failed_suites:+ }(not built: ${missing[*]})"
  [ "${#notrun[@]}" -eq 0 ] || failed_suites+="${failed_suites:+ }(not run: ${notrun[*]})"
  if [ "$train_failed" -eq 1 ]; then
    ok=0
    failed_suites+="${failed_suites:+ }(train phase: see its lines below)"
  fi
  if [ "$tested" -eq 1 ] && [ "$uncounted" -gt 0 ] \
      && [[ "$counts" =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed,\ ([0-9]+) ]]; then
    counts="${BASH_REMATCH[1]} passed, $((BASH_REMATCH[2] + uncounted)) failed, ${BASH_REMATCH[3]} skipped"
  fi
  [ "$ok" -eq 1 ] || [ -n "$failed_suites" ] || failed_suites="(no suite ran)"

  stamp "done"
  {
    echo "===== gpu-check summary ====="
    echo "device:    $gpu"
    echo "nvcc:      $(nvcc --version 2>/dev/null | sed -n 's/.*release \([^,]*\),.*/\1/p')," \
         "c++: $(c++ -dumpfullversion 2>/dev/null), meson: $(meson --version 2>/dev/null)"
    local p
    for p in "${phases[@]}"; do
      printf '  %-7s %5d s  %s\n' "$p" "${secs[$p]}" "${status[$p]}"
    done
    printf '  %-7s %5d s  (deadline %d s)\n' total $((SECONDS - t0)) "$deadline"
    if [ -n "${status[train]:-}" ]; then
      grep -E '^train ' "$logs/train.log" | sed 's/^/  /' || true
    fi
    if [ -n "$bench_rows" ]; then
      echo "bench --device cuda (name, ms, floor_ms, ratio):"
      printf '%s\n' "$bench_rows" | sed 's/^/  /'
    fi
    if [ -n "$peer_lines" ]; then
      echo "quanta train beside its PyTorch replica on this GPU (peer phase):"
      printf '%s\n' "$peer_lines" | sed 's/^/  /'
    fi
    echo "failed suites: ${failed_suites:-none}"
    echo "logs: $logs"
    echo "$counts"
  } | show
  [ "$ok" -eq 1 ]
}
