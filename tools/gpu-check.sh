#!/usr/bin/env bash
# Checks the CUDA build on a GPU machine in one call of at most 10 minutes.
#
#   tools/gpu-check.sh --bundle DIR      here, on Debian 12 after tools/install-deps.sh
#   tools/gpu-check.sh --run DIR [--reuse] [-- MESON_OPTION...]
#                                        there, in a checkout that carries DIR
#   tools/gpu-check.sh --env DIR         there: print the environment --run sets
#                                        up, as `export` lines for a shell to eval
#   tools/gpu-check.sh --help
#
# Why a bundle: the GPU machines are lent rarely, have no network and lack our
# Debian build dependencies (Eigen, doctest, Gloo, CLI11, nlohmann-json, the
# libpng and zlib headers, perhaps pkg-config). Only the working tree and the
# git-ignored folders one carries (64 MiB together) travel there. --bundle
# copies those dependencies out of the installed Debian packages into DIR (at
# most 40 MiB), with pkg-config files whose prefix is relative to the file, so
# DIR works wherever it lands. CUDA (cudart, cuBLAS, cuDNN, NCCL) is never
# bundled: libnccl alone is over 200 MB. --run finds it on the machine, in the
# toolkit or in a Python venv's nvidia-* wheels. Of Fashion-MNIST only a slice
# travels (4096 training and 1024 test images, for the training phases); the
# test cases that train on the whole set return early, saying so. The PyTorch
# peers' packages the machines lack travel unpacked in DIR/peer/site: the
# bitsandbytes Python package with the CPU library and the one for the
# machines' torch (CUDA 13.0), and, beside a checkout with ../shared/peer, the
# PyTorch replica of quanta train and vector-quantize-pytorch's wheels.
# --bundle prints DIR's size and, with the working tree, what travels (64 MiB
# at most).
#
# --run prints the GPU and the toolchain, sets up the environment, configures a
# fresh BUILD_DIR with -Dcuda=enabled -Dnative=true (then the MESON_OPTIONs),
# builds it on every core, runs every suite with `meson test` and counts test
# cases with tools/test_summary.py, like tools/run-tests.sh. Each phase is
# stamped and timed and gets only what is left of a deadline, so the summary is
# out before the caller's 10 minutes are. A failed configure ends the run with
# its log's tail; a failed build (ninja -k 0: every failing file shows) prints
# the first error, and the suites that did build still run; a suite that runs
# over GPU_CHECK_SUITE_S is stopped and fails; up to two suites whose output
# shows a CUDA fault (an illegal address, a trap: it fails every later case
# of its process) run again under compute-sanitizer up to their first failed
# case, which names the kernel and its source line. The last line is
# `N passed, N failed, N skipped`, where a suite that was not built or not run
# counts as one failed case; the exit status is non-zero on any failure.
# Then, as phases of their own (not test counts):
#   train    `quanta train` for 300 steps on the CPU and on the GPU with one
#            seed, none and vq, 45 s a run (it starts only when all four
#            fit); the test MSEs must agree within 5% (a FAIL also makes the
#            exit status non-zero).
# What is left after it is split among the late phases, in this order and
# these shares: qlora 30%, peer 40%, bench 15%, profile 15%. A phase that
# ends early leaves its rest to those after it; none takes another's share.
#   qlora    `bench llm --only 'qlora100m_B4_T512(?!_dora)'` (the QLoRA step,
#            _mixed, _recompute and _graph) beside PyTorch + PEFT + the
#            bundle's bitsandbytes.
#   peer     200 steps of quanta train (graph, --no-graph, bf16), its PyTorch
#            replica eager and compiled (torch.compile), for vq, then none
#            and fsq: each one's img/s over the same steps 101-200 (no
#            evaluation inside) and its test MSE, and whether the graph's
#            checkpoint is --no-graph's. 60 s a run at most, 150 compiled.
#   bench    `quanta bench train`, `bench train --fast-conv` (rows named
#            *_fast_conv), `bench nf4`, `bench llm --only attention_T512_fb`,
#            `bench quant`, `bench engine`, with --device cuda, 90 s a
#            command at most; the rows go into the summary.
#   profile  quanta train --profile 5 on the GPU (each kernel-table entry's
#            calls and time a step, timed on the host, then with the device
#            synchronised after each call); then, where Nsight Compute (ncu)
#            is installed, a kernel profile of 5
#            steps of `quanta train --device cuda` (at most 1000 kernels):
#            launches and kernel time per step, and the 20 kernels that take
#            the most (tools/gpu-check/kernel_profile.py; the first step's
#            initialisation and a final evaluation of 64 images are in it; a
#            profile cut short is still summed, and says so); in its last
#            third (45 s at most), ncu's throughput, memory and stall
#            sections on the NF4 GEMV's default kernel in `bench nf4`.
# The PyTorch peers run with the first python of /opt/torch/.venv/bin/python3
# and python3 that imports torch and numpy (the info phase names it).
# --reuse keeps an existing BUILD_DIR: a second call on the same machine then
# builds incrementally. With GPU_CHECK_PHASES it can run only some phases,
# e.g. GPU_CHECK_PHASES="qlora peer" after a first call that built.
#
# Environment (--run):
#   OUT                             full logs go here when set (the device tool
#                                   returns files under $OUT, at most 8; this
#                                   writes 8: the bench rows go to console.log),
#                                   else to BUILD_DIR-logs
#   GPU_CHECK_DEADLINE_S            seconds after the start by which the summary
#                                   is printed (default 540)
#   GPU_CHECK_PHASES                the phases to run, of build (meson setup
#                                   and ninja), test, train, qlora, peer,
#                                   bench, profile (spaces or commas between;
#                                   default all); the late phases' shares are
#                                   split among those named
#   GPU_CHECK_BUILD_DIR             the build dir (default build-gpu)
#   GPU_CHECK_TARGETS               ninja targets to build instead of all, to try
#                                   this script quickly (suites then fail to run)
#   NINJA_JOBS                      parallel build jobs (default: every core)
#   MESON_TEST_JOBS                 suites run at once (default 8)
#   QUANTA_TEST_TIMEOUT_MULTIPLIER  as in tools/run-tests.sh (default 0.34)
#   GPU_CHECK_SUITE_S               seconds one suite may run (default 90: all
#                                   of them took 50 s on 16 cores)
set -euo pipefail

# The header above is --help's text. Each mode is a file of its own under
# tools/gpu-check/ (bundle.sh, run.sh, env.sh; common.sh is what they share,
# the .py files the Python they run), sourced rather than run, so that they
# run in this shell, under its `set -euo pipefail`.
parts="$(dirname "${BASH_SOURCE[0]}")/gpu-check"
readonly parts

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

short_usage() {
  sed -n '3,8{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

case "${1:-}" in
  --bundle|--run|--env) mode="${1#--}"; shift ;;
  -h|--help) usage; exit ;;
  *) short_usage >&2; exit 2 ;;
esac
# shellcheck source=/dev/null  # each mode's file is checked on its own
source "$parts/$mode.sh"
"${mode}_main" "$@"
