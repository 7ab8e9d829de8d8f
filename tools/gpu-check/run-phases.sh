# shellcheck shell=bash
# The phases of tools/gpu-check.sh --run, each a function that run_phase (in
# run.sh) runs into its own log with a time limit: phase_info, phase_setup,
# phase_build, phase_test, phase_train, phase_qlora, phase_peer, phase_bench
# and phase_profile. They read what run_main sets up: build (the build dir,
# relative to the repository root, which is the current folder), bundle,
# reuse, setup_opts and peer_py (the python that imports torch, or empty).
# shellcheck disable=SC2154  # build, bundle, reuse, setup_opts, peer_py: run_main's

# The python for the PyTorch peers: the first of these that imports torch and
# numpy (the GPU machines' torch lives in a venv; a plain python3 on PATH may
# be another, without it). Prints its path; fails when none does.
pick_python() {
  local py
  for py in /opt/torch/.venv/bin/python3 python3; do
    py="$(command -v "$py" 2>/dev/null)" || continue
    if timeout 60 "$py" -c 'import torch, numpy' >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

# The same training job on the CPU and on the GPU (300 steps of 64, one
# seed, the data slice from the bundle): the CUDA run must finish and its
# test MSE be within 5% of the CPU's; then the default quantizer
# on both, judged the same way (its VQ layers run the quantizer table's CUDA
# kernels). Each run gets TRAIN_RUN_S seconds, whatever the deadline: a
# shorter limit would cut the CPU run and read as a FAIL (a 300-step CPU run
# took about 10 s on the first GPU machine's 16 cores; the step is 15 ms on
# 2 cores here). run_main starts the phase only when the four runs fit.
readonly TRAIN_STEPS=300
readonly TRAIN_SEED=17
readonly TRAIN_RUN_S=45
phase_train() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" out="$build-train"
  local common=(train --data "$data" --steps "$TRAIN_STEPS" --seed "$TRAIN_SEED"
                --batch-size 64 --limit-test 512 --eval-every "$TRAIN_STEPS"
                --log-every 50 --threads "$(nproc)")
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  [ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "the bundle has no data slice"; return 0; }
  rm -rf "$out"
  local q dev rc=0 end=$((SECONDS + $1))
  for q in none vq; do
    for dev in cpu cuda; do
      echo "== quantizer $q on $dev ($TRAIN_STEPS steps, seed $TRAIN_SEED)"
      timeout -k 5 "$TRAIN_RUN_S" "$quanta" "${common[@]}" --quantizer "$q" --device "$dev" \
        --out "$out/$q-$dev" && continue
      echo "(exit $?)"
      rc=1
      # The step as a CUDA graph is new: without it, the verdict still comes
      # (when the phase's time holds one more run).
      [ "$dev" = cuda ] || continue
      if [ $((end - SECONDS)) -lt "$TRAIN_RUN_S" ]; then
        echo "== no time left to run quantizer $q on $dev with --no-graph"
        continue
      fi
      echo "== quantizer $q on $dev again with --no-graph"
      timeout -k 5 "$TRAIN_RUN_S" "$quanta" "${common[@]}" --quantizer "$q" --device "$dev" \
        --no-graph --out "$out/$q-$dev" --overwrite || echo "(exit $?)"
    done
  done
  train_verdict "$out" || rc=1
  return "$rc"
}

# train_verdict DIR: one line per quantizer, the last evaluation's test MSE
# on each device and their ratio; each must be within 5% (PASS/FAIL).
train_verdict() {
  python3 "$gpu_check_dir/train_verdict.py" "$1"
}

# cap LEFT MAX: the limit for one command, so that a hang costs at most MAX
# seconds of the phase and the commands after it still run.
cap() {
  echo $(($1 < $2 ? $1 : $2))
}

# The PyTorch peers' packages from the bundle (vector-quantize-pytorch and
# bitsandbytes, unpacked by --bundle), for PYTHONPATH.
peer_site() {
  echo "$bundle/peer/site${PYTHONPATH:+:$PYTHONPATH}"
}

# The QLoRA step of the ~110M Llama (NF4 base, bf16 compute; under
# MixedPrecision; as a captured graph) beside PyTorch + PEFT + bitsandbytes
# on this GPU (goal: ratio <= 0.77, 1.3x PyTorch's tokens/s): the machine's
# torch, transformers, peft and accelerate, the bundle's bitsandbytes. Where
# the peer cannot import them, quanta's side alone, and the line says why.
# The import check and the one bench command share LIMIT (phase_qlora LIMIT).
phase_qlora() {
  local quanta="$build/tools/quanta" py="${peer_py:-/nonexistent}" check end=$((SECONDS + $1))
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  if [ -z "$peer_py" ]; then
    echo "no python here imports torch: the QLoRA rows run without their floor"
  elif ! check="$(PYTHONPATH="$(peer_site)" timeout "$(cap $(($1 / 2)) 60)" "$py" -c '
import torch, transformers, peft, accelerate, bitsandbytes
from bitsandbytes.cextension import lib
print("torch", torch.__version__, "(CUDA", torch.version.cuda + ")", "transformers",
      transformers.__version__, "peft", peft.__version__, "bitsandbytes", bitsandbytes.__version__,
      "with", type(lib).__name__)' 2>&1)"; then
    echo "the PyTorch peer cannot import its stack (rows without a floor):"
    printf '%s\n' "$check" | tail -n 3
    py=/nonexistent
  else
    echo "peer: $py: $(printf '%s\n' "$check" | tail -n 1)"
  fi
  # The DoRA row apart: its PEFT peer is slow, and the rows before it come
  # first within the phase's share.
  echo "== bench llm --only 'qlora100m_B4_T512(?!_dora)' --device cuda"
  [ $((end - SECONDS)) -ge 10 ] || { echo "no time left for it"; return 1; }
  PYTHONPATH="$(peer_site)" QUANTA_PEER_PYTHON="$py" timeout -k 5 $((end - SECONDS)) \
    "$quanta" bench llm --device cuda --only 'qlora100m_B4_T512(?!_dora)' --repeat 3 \
    --threads "$(nproc)" \
    || { echo "(exit $?)"; return 1; }
}

# Bench output with SUFFIX appended to each train_step row's name.
suffix_rows() {
  if [ -z "$1" ]; then cat; else sed "s/^\(train_step_[a-z_]*\)/\1$1/"; fi
}

# The GPU bench suites, each row against its floor (a row whose op has no
# kernel yet says so), in the order the next session reads them: the train
# steps, deterministic and with cuDNN's algorithms timed and atomics allowed
# (--fast-conv; rows named *_fast_conv), then the rows with goals to meet
# (nf4_dequantize ratio <= 1.18, nf4_gemv_8192_b1 <= 0.33; attention at T
# 512 forward + backward, the whole-matrix products and the reference
# kernels beside torch's SDPA), then quant (vq_nearest_* <= 1.2) and engine.
# Timings, not a test: the phase fails only when a command fails. Each
# command gets at most BENCH_COMMAND_S of what is left of LIMIT (phase_bench
# LIMIT): one that hangs leaves the others their time.
readonly BENCH_COMMAND_S=90
phase_bench() {
  local quanta="$build/tools/quanta" suite rc=0 end=$((SECONDS + $1)) left suffix
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  for suite in train "train --fast-conv" nf4 "llm --only attention_T512_fb" quant engine; do
    left=$((end - SECONDS))
    [ "$left" -ge 10 ] || { echo "== bench $suite: no time left"; continue; }
    echo "== bench $suite --device cuda"
    suffix=""
    [ "$suite" != "train --fast-conv" ] || suffix=_fast_conv
    # shellcheck disable=SC2086  # "train --fast-conv" is two words
    PYTHONPATH="$(peer_site)" QUANTA_PEER_PYTHON="${peer_py:-/nonexistent}" \
      timeout -k 5 "$(cap "$left" "$BENCH_COMMAND_S")" "$quanta" bench $suite --device cuda \
      --repeat 3 --threads "$(nproc)" | suffix_rows "$suffix" || { echo "(exit $?)"; rc=1; }
  done
  return "$rc"
}

# Where the default training step's GPU time goes: Nsight Compute times every
# kernel of PROFILE_STEPS steps of `quanta train --device cuda` (one at a
# time, at the clocks the GPU runs at) and kernel_profile.py sums them by
# kernel, per step. Skipped, saying so, where ncu is not installed. ncu's
# work is bounded twice: it stops timing after PROFILE_LAUNCHES kernels (the
# last profiles counted 153 to 232 a step, and ncu timed some 20 a second
# on an H100, 2026-12-05), and the training run ends 20 s before LIMIT, so
# that ncu still prints what it timed; whatever CSV there is then gets
# summed, marked as cut short, and a run stopped by that limit is no failure
# (ncu answers 9, the SIGKILL its target got, or timeout's 124 or 137). The steps run with --no-graph: ncu
# times kernels one launch at a time and failed on the launches of a graph
# capture (exit 9 at the captured step, on an H200, 2026-12-04); the eager
# step's launches are what a capture then holds. The phase's last third (at
# most GEMV_PROFILE_S seconds) goes to the NF4 GEMV's profile (profile_gemv).
# Before ncu (and where it is absent), quanta's own call profile
# (profile_calls) takes at most CALLS_PROFILE_S of the phase.
readonly PROFILE_STEPS=5
readonly PROFILE_LAUNCHES=1000
readonly GEMV_PROFILE_S=45
readonly CALLS_PROFILE_S=60
phase_profile() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" ncu rc=0 start=$SECONDS
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  if [ -e "$data/train-images-idx3-ubyte.gz" ]; then
    profile_calls $(($1 / 4 < CALLS_PROFILE_S ? $1 / 4 : CALLS_PROFILE_S)) || rc=$?
  fi
  ncu="$(command -v ncu || compgen -G '/opt/nvidia/nsight-compute/*/ncu' | sort -V | tail -n 1)" \
    || true
  [ -n "$ncu" ] || { echo "no ncu on this machine: no kernel profile"; return "$rc"; }
  local left=$(($1 - (SECONDS - start)))
  local gemv_s=$((left / 3 < GEMV_PROFILE_S ? left / 3 : GEMV_PROFILE_S))
  if [ -e "$data/train-images-idx3-ubyte.gz" ]; then
    profile_train "$ncu" $((left - gemv_s)) || rc=$?
  else
    echo "the bundle has no data slice: no profile of the training step"
  fi
  profile_gemv "$ncu" $(($1 - (SECONDS - start))) || rc=$?
  return "$rc"
}

# profile_calls SECONDS: where the uncaptured step's time goes, by quanta's
# own count (quanta train --profile, engine/profile/call_profile.h): each
# kernel-table entry's calls and time over PROFILE_STEPS steps after two,
# first as the host spends it (launching: an eager step of some 5 ms
# against a 1 ms graph on the H100, 2026-12-05, is mostly the host's), then
# the same with --fast-conv (which took some 2 ms off the eager step and
# only 0.2 ms off the graph's on the H200, 2026-12-04: the convolutions'
# rows say whether the host's share moved), then with the device
# synchronised after each call (each kernel's own time, as ncu would give
# it, without ncu). A third of the seconds each.
profile_calls() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" run rc=0 out
  local -a extra
  for run in host host-fast-conv device; do
    extra=(--profile-timing "${run%%-*}")
    [ "$run" != host-fast-conv ] || extra+=(--fast-conv)
    echo "== quanta train --device cuda --profile $PROFILE_STEPS ${extra[*]}"
    out="$build-calls-$run"
    rm -rf "$out"
    timeout -k 5 $(($1 / 3)) "$quanta" train --data "$data" --device cuda \
      --steps $((PROFILE_STEPS + 2)) --batch-size 64 --limit-test 64 --eval-every 1000000 \
      --log-every 1000000 --threads "$(nproc)" --profile "$PROFILE_STEPS" "${extra[@]}" \
      --out "$out" >"$out.log" 2>&1 || rc=$?
    sed -n '/^profile of steps/,/more entries\|^step /p' "$out.log" | grep -v '^step ' | head -n 40
    [ "$rc" -eq 0 ] || { echo "(exit $rc; its last lines:)"; tail -n 5 "$out.log"; }
  done
  return "$rc"
}

# profile_train NCU SECONDS: the training step's kernels (above).
profile_train() {
  local ncu="$1" data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" csv rc=0 cut=()
  csv="$(mktemp)"
  rm -rf "$build-profile"
  timeout -k 5 "$2" "$ncu" --csv --metrics gpu__time_duration.sum --clock-control none \
    --target-processes all --launch-count "$PROFILE_LAUNCHES" \
    timeout -k 5 $(($2 > 40 ? $2 - 20 : $2 / 2)) \
    "$quanta" train --data "$data" --device cuda --no-graph --steps "$PROFILE_STEPS" --batch-size 64 \
    --limit-test 64 --eval-every 1000000 --log-every "$PROFILE_STEPS" --threads "$(nproc)" \
    --out "$build-profile" >"$csv" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && [ "$(grep -c '^"[0-9]' "$csv")" -lt "$PROFILE_LAUNCHES" ] || cut=(--cut)
  local summed=0
  python3 "$gpu_check_dir/kernel_profile.py" "$csv" "$PROFILE_STEPS" 20 "${cut[@]}" || summed=$?
  if [ "$summed" -eq 0 ] && { [ "$rc" -eq 9 ] || [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
    echo "(the training run was stopped at its time limit, ncu exit $rc: the table is what it timed)"
    rc=0
  elif [ "$rc" -ne 0 ] || [ "$summed" -ne 0 ]; then
    echo "(ncu exit $rc$([ "$rc" -eq 124 ] && echo ': timed out'); its last lines:)"
    grep -v '^"' "$csv" | tail -n 5
    [ "$rc" -ne 0 ] || rc=1
  fi
  return "$rc"
}

# profile_gemv NCU SECONDS: the NF4 GEMV at batch 1, the issue's goal left
# furthest (0.84x cuBLAS's bf16 GEMV against 3x on the H200, 2026-12-04).
# Nsight Compute's sections on the first launch of the default kernel at one
# row (unstaged since 2026-12-05) in `bench nf4`, which say whether memory bandwidth, instruction
# issue or the latency of too few loads bounds it: its throughputs against
# the peaks (SpeedOfLight), the memory traffic, the warps' stall reasons.
profile_gemv() {
  local ncu="$1" quanta="$build/tools/quanta" rc=0
  [ "$2" -ge 20 ] || { echo "no time left for the NF4 GEMV's profile"; return 0; }
  echo "== ncu: the NF4 GEMV's default kernel (nf4_gemv_8192_b1, first launch)"
  timeout -k 5 "$2" "$ncu" --kernel-name regex:'(^|::)gemv_kernel' --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section WarpStateStats \
    "$quanta" bench nf4 --device cuda --repeat 1 >"$build-gemv-ncu.txt" 2>&1 || rc=$?
  grep -v '^==PROF==' "$build-gemv-ncu.txt" | tail -n 150
  [ "$rc" -eq 0 ] || echo "(ncu exit $rc$([ "$rc" -eq 124 ] && echo ': timed out'))"
  return "$rc"
}

# quanta against eager PyTorch and torch.compile on the same GPU: the
# replica of quanta train (../shared/peer, carried by the bundle) with
# vector-quantize-pytorch from the bundle, PEER_STEPS steps of each
# quantizer, vq first (the issue's goals: >= 1.5x eager, >= 1x compiled),
# then none and fsq. quanta runs with its step captured as a CUDA graph (the
# default), with --no-graph, and with --precision bf16; the graph's
# checkpoint must be --no-graph's, byte for byte. Both sides evaluate only
# after the last step (--eval-every PEER_STEPS: the replica's default would
# evaluate at every epoch of the slice, every 64 steps, inside the timing),
# and peer_window.py reads each one's images per second over the same steps
# (PEER_WINDOW to PEER_STEPS, past warm-up, capture and compilation) from
# its metrics.jsonl. Each run gets at most PEER_RUN_S (torch.compile's
# PEER_COMPILE_S) of what is left of LIMIT (phase_peer LIMIT). Where
# torch.compile fails (on the H200, PyTorch 2.11's Inductor stopped at vq's
# convolution backward, a stride assertion after its channels-last layout
# optimisation), compile_nchw runs it again with that optimisation off
# (TORCHINDUCTOR_LAYOUT_OPTIMIZATION=0), labelled as such.
readonly PEER_STEPS=200 PEER_WINDOW=100 PEER_RUN_S=60 PEER_COMPILE_S=150
phase_peer() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" q mode end left run
  [ -f "$bundle/peer/quanta_arch_fmnist.py" ] || { echo "the bundle has no PyTorch peer"; return 0; }
  [ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "the bundle has no data slice"; return 0; }
  [ -n "$peer_py" ] || { echo "no python here imports torch: no PyTorch peer"; return 0; }
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  end=$((SECONDS + $1))
  local common=(--steps "$PEER_STEPS" --batch-size 64 --limit-test 512 --data "$data"
                --eval-every "$PEER_STEPS" --log-every 50)
  rm -rf "$build-peer"
  for q in vq none fsq; do
    for mode in quanta quanta_nograph quanta_bf16 eager compile compile_nchw; do
      # The second compilation only where the first ended without its
      # evaluation.
      if [ "$mode" = compile_nchw ] \
         && grep -qs '"eval"' "$build-peer/$q-compile/metrics.jsonl"; then
        continue
      fi
      left=$((end - SECONDS))
      # A compilation cut short measures nothing: it starts only with time
      # for the compiler.
      if [ "$left" -lt 15 ] || { [ "${mode#compile}" != "$mode" ] && [ "$left" -lt 45 ]; }; then
        echo "== $q $mode: no time left"
        continue
      fi
      echo "== $q $mode"
      run="$build-peer/$q-$mode"
      if [ "${mode#quanta}" != "$mode" ]; then
        # quanta_bf16: --precision bf16 (bf16 GEMMs, TF32 convolutions)
        # shellcheck disable=SC2046  # --no-graph or nothing
        timeout -k 5 "$(cap "$left" "$PEER_RUN_S")" "$quanta" train "${common[@]}" \
          --quantizer "$q" --device cuda \
          --precision "$([ "$mode" = quanta_bf16 ] && echo bf16 || echo f32)" \
          $([ "$mode" = quanta_nograph ] && echo --no-graph) --out "$run" --overwrite 2>&1 \
          | grep -E "^step $PEER_STEPS/|^eval|captured|error" || echo "(exit $?)"
        [ "$mode" != quanta_nograph ] || compare_checkpoints "$build-peer/$q-quanta" "$run"
      else
        local compiled=0 layout=1
        [ "${mode#compile}" = "$mode" ] || compiled=1
        [ "$mode" != compile_nchw ] || layout=0
        # shellcheck disable=SC2046  # --compile or nothing
        TORCHINDUCTOR_LAYOUT_OPTIMIZATION=$layout PYTHONPATH="$(peer_site)" timeout -k 5 \
          "$(cap "$left" "$([ "$compiled" = 1 ] && echo "$PEER_COMPILE_S" || echo "$PEER_RUN_S")")" \
          "$peer_py" "$bundle/peer/quanta_arch_fmnist.py" "${common[@]}" --quantizer "$q" \
          --device cuda --out "$run" $([ "$compiled" = 1 ] && echo --compile) 2>&1 \
          | grep -E "^step $PEER_STEPS/|^eval|Error" || echo "(exit $?)"
      fi
      python3 "$gpu_check_dir/peer_window.py" "$q $mode" "$run" 64 "$PEER_WINDOW" "$PEER_STEPS" \
        || true
    done
  done
}

# compare_checkpoints GRAPH_RUN NOGRAPH_RUN: whether the captured step and the
# plain one wrote the same checkpoint, or which of them wrote none (a run
# that failed or ran out of time is not a difference).
compare_checkpoints() {
  local a="$1/checkpoint.safetensors" b="$2/checkpoint.safetensors" f
  for f in "$a" "$b"; do
    [ -f "$f" ] || { echo "graph and --no-graph checkpoints: $f missing"; return 0; }
  done
  if cmp -s "$a" "$b"; then
    echo "graph and --no-graph checkpoints: the same bytes"
  else
    echo "graph and --no-graph checkpoints DIFFER"
  fi
}

phase_info() {
  echo "host: $(hostname), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB," \
       "$(sed -n 's/^PRETTY_NAME=//p' /etc/os-release 2>/dev/null | tr -d '"')"
  timeout 30 nvidia-smi || echo "nvidia-smi failed (exit $?)"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v c++ >/dev/null && c++ --version | head -n 1
  echo "meson $(meson --version 2>&1), ninja $(ninja --version 2>&1), $(python3 --version 2>&1)"
  if [ -n "$peer_py" ]; then
    echo "PyTorch peers' python: $peer_py ($("$peer_py" --version 2>&1))"
  else
    echo "PyTorch peers' python: none (neither /opt/torch/.venv/bin/python3 nor python3" \
         "imports torch and numpy): the qlora and peer phases run without their peers"
  fi
  [ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
    || echo "Fashion-MNIST absent: its training test cases return early (counted as passed)"
}

phase_setup() {
  if [ "$reuse" -eq 1 ] && [ -f "$build/build.ninja" ]; then
    timeout -k 10 "$1" meson setup --reconfigure "$build" "${setup_opts[@]}"
  else
    rm -rf "$build"
    timeout -k 10 "$1" meson setup "$build" "${setup_opts[@]}"
  fi
}

# -k 0: on a machine lent for minutes, one call should show every file that
# fails to compile, and build every suite that can be built.
phase_build() {
  local targets=()
  read -r -a targets <<<"${GPU_CHECK_TARGETS:-}"
  timeout -k 15 "$1" ninja -C "$build" -k 0 -j "${NINJA_JOBS:-$(nproc)}" "${targets[@]}"
}

# As tools/run-tests.sh's tail, split out so that build and tests are timed
# and logged apart. meson test gets what is left of the deadline (on SIGTERM
# it stops the running suites, which count as failed, and still writes
# testlog.json). phase_test LIMIT [SUITE...]: no SUITE runs them all.
# Each suite also runs under `timeout GPU_CHECK_SUITE_S` (default 90): the
# suites' own timeouts (300 to 1800 s) times one multiplier cannot bound
# them all to a minute or so (0.1 would leave the 300 s suites 30 s and the
# 1800 s one 180 s), and the whole run took 50 s on 16 cores, so one hung
# suite costs at most 90 s of the deadline and counts as failed.
# Meson names its log after a wrapper (testlog-timeout.json); test_summary.py
# and suite_states.py read testlog.json.
# A CUDA fault poisons its suite's process: every later case fails and the
# log does not say which kernel faulted. For at most two suites whose output
# shows one (cuda_faults.py), run the program again under compute-sanitizer,
# stopping at the first failed case (the build has -lineinfo: it names the
# kernel and the source line), within LEFT seconds.
sanitize_faults() {
  local testlog="$1" left="$2" sanitizer name cmd
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  [ -x "$sanitizer" ] || { echo "no compute-sanitizer: CUDA faults not located"; return 0; }
  while IFS=$'\t' read -r name cmd; do
    [ "$left" -ge 20 ] || { echo "== compute-sanitizer on $name: no time left"; break; }
    echo "== compute-sanitizer (memcheck) on $name, first failed case, at most 60 s"
    local start=$SECONDS
    # shellcheck disable=SC2086  # cmd is the shell-quoted command line
    eval "QUANTA_TEST_DATA='$root/tests/data' timeout -k 5 $((left < 60 ? left : 60)) \
      '$sanitizer' --tool memcheck --print-limit 5 $cmd --abort-after=1" 2>&1 \
      | grep -E '^=========|TEST CASE|ERROR' | head -n 40 || true
    left=$((left - (SECONDS - start)))
  done < <(python3 "$gpu_check_dir/cuda_faults.py" "$testlog" 2)
}

phase_test() {
  local limit="$1" rc=0 src=0 log="$build/meson-logs/testlog" end=$((SECONDS + $1))
  shift
  rm -f "$log.json" "$log-timeout.json"
  timeout -k 20 "$limit" meson test -C "$build" --no-rebuild --print-errorlogs \
    --num-processes "${MESON_TEST_JOBS:-8}" \
    --wrapper "timeout -k 5 ${GPU_CHECK_SUITE_S:-90}" \
    --timeout-multiplier "${QUANTA_TEST_TIMEOUT_MULTIPLIER:-0.34}" "$@" || rc=$?
  [ ! -f "$log-timeout.json" ] || mv -f "$log-timeout.json" "$log.json"
  echo "meson test exit status: $rc$([ "$rc" -eq 124 ] && echo ' (stopped at the deadline)')"
  [ "$rc" -eq 0 ] || sanitize_faults "$log.json" $((end - SECONDS - 10))
  # The summary line stays the log's last.
  python3 "$root/tools/test_summary.py" "$build" "$rc" || src=$?
  [ "$rc" -eq 124 ] && return 124
  return "$src"
}
