# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck disable=SC2164  # sourced under set -e: a failed cd ends it
# tools/gpu-check.sh --run DIR [--reuse] [-- MESON_OPTION...]: what it does,
# its deadline and its environment variables are in the header of
# tools/gpu-check.sh. This file holds the deadline bookkeeping (stamped
# console lines, budgets, run_phase) and run_main, which runs the phases of
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
  (while sleep 60; do
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

  run_phase info "$tmp/info.log" phase_info || true
  show <"$tmp/info.log"
  local gpu
  gpu="$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total \
         --format=csv,noheader 2>/dev/null | head -n 1)" || true
  [ -n "$gpu" ] || gpu="no GPU visible (nvidia-smi failed)"

  local counts="0 passed, 1 failed, 0 skipped" failed_suites="" ok=1 tested=0
  local built=() missing=() notrun=()
  if ! run_phase setup "$logs/setup.log" phase_setup "$(budget 30)"; then
    ok=0
    say "----- tail of setup.log -----"
    tail -n 25 "$logs/setup.log" | show
    say "----- tail of meson-log.txt -----"
    tail -n 40 "$build/meson-logs/meson-log.txt" 2>/dev/null | show || true
  fi
  cp "$build/meson-logs/meson-log.txt" "$logs/" 2>/dev/null || true

  if [ "$ok" -eq 1 ]; then
    if ! run_phase build "$logs/build.log" phase_build "$(budget 20)"; then
      ok=0
      say "----- build.log: first failure -----"
      build_failure_tail "$logs/build.log" | show
      if [[ "${status[build]}" == TIMED* ]]; then
        say "The build ran out of time: a second call with --reuse goes on where it stopped."
      fi
    fi
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
  fi
  # Training on both devices, when the build made the quanta command and time
  # is left; its result is a phase status of its own, not a test count, but a
  # CUDA run that fails or misses the CPU's test MSE fails the check.
  local train_failed=0
  if [ -x "$build/tools/quanta" ] && [ "$(budget 15)" -ge 90 ]; then
    run_phase train "$logs/train.log" phase_train "$(( ($(budget 15) - 60) / 5 ))" \
      || train_failed=1
    grep -E '^(== |train |quanta: error|\(exit)' "$logs/train.log" | show || true
  fi
  # The GPU bench rows, into the console and the summary (its log stays in
  # tmp: the device tool brings back only a few files from OUT).
  local bench_rows=""
  if [ -x "$build/tools/quanta" ] && [ "$(budget 15)" -ge 45 ]; then
    run_phase bench "$tmp/bench.log" phase_bench "$(( $(budget 15) - 5 ))" || true
    show <"$tmp/bench.log"
    bench_rows="$(grep -vE '^(# |==|name )' "$tmp/bench.log" | grep -E '^[A-Za-z]' || true)"
  fi
  # quanta beside PyTorch on this GPU, then the kernel profile: they tell
  # how fast a step is and where its time goes; nothing is judged by them.
  if [ -x "$build/tools/quanta" ] && [ "$(budget 45)" -ge 60 ]; then
    run_phase peer "$tmp/peer.log" phase_peer "$(( $(budget 45) - 5 ))" || true
    show <"$tmp/peer.log"
  fi
  if [ -x "$build/tools/quanta" ] && [ "$(budget 5)" -ge 30 ]; then
    run_phase profile "$tmp/profile.log" phase_profile "$(( $(budget 5) - 5 ))" || true
    show <"$tmp/profile.log"
  fi
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
      printf '  %-6s %5d s  %s\n' "$p" "${secs[$p]}" "${status[$p]}"
    done
    printf '  %-6s %5d s  (deadline %d s)\n' total $((SECONDS - t0)) "$deadline"
    if [ -n "${status[train]:-}" ]; then
      grep -E '^train ' "$logs/train.log" | sed 's/^/  /' || true
    fi
    if [ -n "$bench_rows" ]; then
      echo "bench --device cuda (name, ms, floor_ms, ratio):"
      printf '%s\n' "$bench_rows" | sed 's/^/  /'
    fi
    echo "failed suites: ${failed_suites:-none}"
    echo "logs: $logs"
    echo "$counts"
  } | show
  [ "$ok" -eq 1 ]
}
