# shellcheck shell=bash
# The phases of tools/gpu-check.sh --run, each a function that run_phase (in
# run.sh) runs into its own log with a time limit: phase_info, phase_setup,
# phase_build, phase_test, phase_train and phase_bench. They read what
# run_main sets up: build (the build dir, relative to the repository root,
# which is the current folder), bundle, reuse and setup_opts.
# shellcheck disable=SC2154  # build, bundle, reuse, setup_opts: run_main's

# The same training job on the CPU and on the GPU (300 steps of 64, one
# seed, the data slice from the bundle): the CUDA run must finish and its
# test MSE be within 5% of the CPU's; then the default quantizer
# on both, judged the same way (its VQ layers run the quantizer table's CUDA
# kernels). Each run gets LIMIT
# seconds (phase_train LIMIT); about 10 s each on the first GPU machine's
# 16 cores is the estimate (the CPU step is 15 ms on 2 cores here).
readonly TRAIN_STEPS=300
readonly TRAIN_SEED=17
phase_train() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" out="$build-train"
  local common=(train --data "$data" --steps "$TRAIN_STEPS" --seed "$TRAIN_SEED"
                --batch-size 64 --limit-test 512 --eval-every "$TRAIN_STEPS"
                --log-every 50 --threads "$(nproc)")
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  [ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "the bundle has no data slice"; return 0; }
  rm -rf "$out"
  local q dev rc=0
  for q in none vq; do
    for dev in cpu cuda; do
      echo "== quantizer $q on $dev ($TRAIN_STEPS steps, seed $TRAIN_SEED)"
      timeout -k 5 "$1" "$quanta" "${common[@]}" --quantizer "$q" --device "$dev" \
        --out "$out/$q-$dev" && continue
      echo "(exit $?)"
      rc=1
      # The step as a CUDA graph is new: without it, the verdict still comes.
      [ "$dev" = cuda ] || continue
      echo "== quantizer $q on $dev again with --no-graph"
      timeout -k 5 "$1" "$quanta" "${common[@]}" --quantizer "$q" --device "$dev" --no-graph \
        --out "$out/$q-$dev" --overwrite || echo "(exit $?)"
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

# Bench output with SUFFIX appended to each train_step row's name.
suffix_rows() {
  if [ -z "$1" ]; then cat; else sed "s/^\(train_step_[a-z_]*\)/\1$1/"; fi
}

# The GPU bench suites, each row against its floor (a row whose op has no
# kernel yet says so): the NF4 and VQ rows first (short, and the ones
# with goals to meet: nf4_dequantize ratio <= 1.18, nf4_gemv_8192_b1 <= 0.33,
# vq_nearest_* <= 1.2), the QLoRA step (goal: ratio <= 0.77, 1.3x PyTorch's
# tokens/s), then the engine and train rows. Timings, not
# a test: the phase fails only when a command fails. The commands share
# LIMIT seconds, each getting what the ones before it left (phase_bench
# LIMIT).
phase_bench() {
  local quanta="$build/tools/quanta" suite rc=0 end=$((SECONDS + $1)) left
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  # The last run: train again with cuDNN's algorithms timed and atomics
  # allowed (--fast-conv), beside the deterministic default; its rows are
  # named *_fast_conv.
  local suffix
  for suite in nf4 quant llm engine train "train --fast-conv"; do
    left=$((end - SECONDS))
    [ "$left" -ge 10 ] || { echo "== bench $suite: no time left"; rc=1; continue; }
    echo "== bench $suite --device cuda"
    if [ "$suite" = llm ]; then
      bench_qlora "$left" || rc=1
      continue
    fi
    suffix=""
    [ "$suite" != "train --fast-conv" ] || suffix=_fast_conv
    # shellcheck disable=SC2086  # "train --fast-conv" is two words
    timeout -k 5 "$left" "$quanta" bench $suite --device cuda --repeat 3 \
      --threads "$(nproc)" | suffix_rows "$suffix" || { echo "(exit $?)"; rc=1; }
  done
  return "$rc"
}

# The QLoRA step of the ~110M Llama (NF4 base, bf16 compute; and under
# MixedPrecision) beside PyTorch + PEFT + bitsandbytes on this GPU, then the
# attention rows at T 512 (both CUDA attentions) beside torch's SDPA; the peer
# being this machine's python3 where it imports them; else quanta's side
# alone, and the line names what the peer lacks (the bundle cannot carry
# them: bitsandbytes and transformers alone exceed its size).
bench_qlora() {
  local peer_py missing
  peer_py="$(command -v python3 || echo /nonexistent)"
  missing="$(python3 -c 'import importlib.util as u; print(" ".join(m for m in ("torch",
    "transformers", "peft", "accelerate", "bitsandbytes") if u.find_spec(m) is None))' \
    2>/dev/null || echo python3)"
  if [ -n "$missing" ]; then
    echo "the PyTorch peer lacks: $missing (rows without a floor)"
    peer_py=/nonexistent
  fi
  local end=$((SECONDS + $1)) rc=0
  QUANTA_PEER_PYTHON="$peer_py" timeout -k 5 "$1" "$build/tools/quanta" bench llm --device cuda \
    --only qlora100m_B4_T512 --repeat 3 --threads "$(nproc)" || { echo "(exit $?)"; rc=1; }
  # Attention at T 512 forward + backward: the whole-matrix products (the
  # default) and the reference kernels (_reference), against torch's SDPA.
  [ $((end - SECONDS)) -ge 10 ] || { echo "== attention rows: no time left"; return 1; }
  QUANTA_PEER_PYTHON="$peer_py" timeout -k 5 $((end - SECONDS)) "$build/tools/quanta" bench llm \
    --device cuda --only attention_T512_fb --repeat 3 --threads "$(nproc)" \
    || { echo "(exit $?)"; rc=1; }
  return "$rc"
}

# Where the default training step's GPU time goes: Nsight Compute times every
# kernel of PROFILE_STEPS steps of `quanta train --device cuda` (one at a
# time, at the clocks the GPU runs at) and kernel_profile.py sums them by
# kernel, per step. Skipped, saying so, where ncu is not installed.
readonly PROFILE_STEPS=10
phase_profile() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" ncu csv
  ncu="$(command -v ncu || compgen -G '/opt/nvidia/nsight-compute/*/ncu' | sort -V | tail -n 1)" \
    || true
  [ -n "$ncu" ] || { echo "no ncu on this machine: no kernel profile"; return 0; }
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  [ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "the bundle has no data slice"; return 0; }
  csv="$(mktemp)"
  rm -rf "$build-profile"
  timeout -k 5 "$1" "$ncu" --csv --metrics gpu__time_duration.sum --clock-control none \
    "$quanta" train --data "$data" --device cuda --steps "$PROFILE_STEPS" --batch-size 64 \
    --limit-test 64 --eval-every 1000000 --log-every "$PROFILE_STEPS" --threads "$(nproc)" \
    --out "$build-profile" >"$csv" 2>&1 || { echo "(ncu exit $?)"; tail -n 5 "$csv"; return 1; }
  python3 "$gpu_check_dir/kernel_profile.py" "$csv" "$PROFILE_STEPS" 20
}

# quanta against eager PyTorch and torch.compile on the same GPU: the
# replica of quanta train (../shared/peer, carried by the bundle) with
# vector-quantize-pytorch from the bundle's wheels, PEER_STEPS steps of each
# quantizer, beside quanta train's own steps in the same call. Each prints
# its last log line (images per second over steps 151-200, past warm-up and
# compilation) and its evaluation (test MSE, codebook usage). quanta runs
# with its step captured as a CUDA graph (the default), with --no-graph,
# and with --precision bf16; the graph's checkpoint must be --no-graph's,
# byte for byte.
readonly PEER_STEPS=200
phase_peer() {
  local data="$bundle/fashion-mnist-subset" quanta="$build/tools/quanta" site q end left
  [ -f "$bundle/peer/quanta_arch_fmnist.py" ] || { echo "the bundle has no PyTorch peer"; return 0; }
  [ -e "$data/train-images-idx3-ubyte.gz" ] || { echo "the bundle has no data slice"; return 0; }
  site="$(mktemp -d)"
  python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile \
    --target "$site" "$bundle"/peer/wheels/*.whl || { echo "cannot install the peer's wheels"; return 1; }
  end=$((SECONDS + $1))
  local common=(--steps "$PEER_STEPS" --batch-size 64 --limit-test 512 --data "$data")
  for q in vq none fsq; do
    for mode in quanta quanta_nograph quanta_bf16 eager compile; do
      left=$((end - SECONDS))
      [ "$left" -ge 15 ] || { echo "== $q $mode: no time left"; continue; }
      echo "== $q $mode"
      if [ "${mode#quanta}" != "$mode" ]; then
        # quanta_bf16: --precision bf16 (bf16 GEMMs, TF32 convolutions)
        # shellcheck disable=SC2046  # --no-graph or nothing
        timeout -k 5 "$left" "$quanta" train "${common[@]}" --quantizer "$q" --device cuda \
          --precision "$([ "$mode" = quanta_bf16 ] && echo bf16 || echo f32)" \
          $([ "$mode" = quanta_nograph ] && echo --no-graph) \
          --eval-every "$PEER_STEPS" --log-every 50 --out "$build-peer/$q-$mode" --overwrite 2>&1 \
          | grep -E "^step $PEER_STEPS/|^eval|captured|error" || echo "(exit $?)"
        if [ "$mode" = quanta_nograph ]; then
          if cmp -s "$build-peer/$q-quanta/checkpoint.safetensors" \
            "$build-peer/$q-quanta_nograph/checkpoint.safetensors"; then
            echo "graph and --no-graph checkpoints: the same bytes"
          else
            echo "graph and --no-graph checkpoints DIFFER"
          fi
        fi
      else
        # shellcheck disable=SC2046  # --compile or nothing
        PYTHONPATH="$site" timeout -k 5 "$left" python3 "$bundle/peer/quanta_arch_fmnist.py" \
          "${common[@]}" --quantizer "$q" --device cuda --log-every 50 \
          $([ "$mode" = compile ] && echo --compile) 2>&1 \
          | grep -E "^step $PEER_STEPS/|^eval|Error" || echo "(exit $?)"
      fi
    done
  done
}

phase_info() {
  echo "host: $(hostname), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB," \
       "$(sed -n 's/^PRETTY_NAME=//p' /etc/os-release 2>/dev/null | tr -d '"')"
  timeout 30 nvidia-smi || echo "nvidia-smi failed (exit $?)"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v c++ >/dev/null && c++ --version | head -n 1
  echo "meson $(meson --version 2>&1), ninja $(ninja --version 2>&1), $(python3 --version 2>&1)"
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
phase_test() {
  local limit="$1" rc=0 src=0
  shift
  rm -f "$build/meson-logs/testlog.json"
  timeout -k 20 "$limit" meson test -C "$build" --no-rebuild --print-errorlogs \
    --num-processes "${MESON_TEST_JOBS:-8}" \
    --timeout-multiplier "${QUANTA_TEST_TIMEOUT_MULTIPLIER:-0.34}" "$@" || rc=$?
  echo "meson test exit status: $rc$([ "$rc" -eq 124 ] && echo ' (stopped at the deadline)')"
  python3 "$root/tools/test_summary.py" "$build" "$rc" || src=$?
  [ "$rc" -eq 124 ] && return 124
  return "$src"
}
