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
# DIR works wherever it lands. CUDA (cudart, cuBLAS, NCCL) is never bundled:
# libnccl alone is over 200 MB. --run finds it on the machine, in the toolkit or
# in a Python venv's nvidia-* wheels. Fashion-MNIST is not bundled either: the
# test cases that train on it return early, saying so, when it is absent.
#
# --run prints the GPU and the toolchain, sets up the environment, configures a
# fresh BUILD_DIR with -Dcuda=enabled -Dnative=true (then the MESON_OPTIONs),
# builds it on every core, runs every suite with `meson test` and counts test
# cases with tools/test_summary.py, like tools/run-tests.sh. Each phase is
# stamped and timed and gets only what is left of a deadline, so the summary is
# out before the caller's 10 minutes are. A failed configure ends the run with
# its log's tail; a failed build (ninja -k 0: every failing file shows) prints
# the first error, and the suites that did build still run. The last line is
# `N passed, N failed, N skipped`, where a suite that was not built or not run
# counts as one failed case; the exit status is non-zero on any failure.
# Then, as phases of their own (not test counts): `quanta train` for 300
# steps on the CPU and on the GPU with one seed, whose test MSE must agree
# within 5% (a FAIL there also makes the exit status non-zero), and `quanta
# bench nf4`, `bench quant`, `bench engine` and `bench train` with --device
# cuda, whose rows go into the summary.
# --reuse keeps an existing BUILD_DIR: a second call on the same machine then
# builds incrementally.
#
# Environment (--run):
#   OUT                             full logs go here when set (the device tool
#                                   returns files under $OUT, at most 8; this
#                                   writes 8: the bench rows go to console.log),
#                                   else to BUILD_DIR-logs
#   GPU_CHECK_DEADLINE_S            seconds after the start by which the summary
#                                   is printed (default 540)
#   GPU_CHECK_BUILD_DIR             the build dir (default build-gpu)
#   GPU_CHECK_TARGETS               ninja targets to build instead of all, to try
#                                   this script quickly (suites then fail to run)
#   NINJA_JOBS                      parallel build jobs (default: every core)
#   MESON_TEST_JOBS                 suites run at once (default 8)
#   QUANTA_TEST_TIMEOUT_MULTIPLIER  as in tools/run-tests.sh (default 0.34)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly root
readonly MARKER=.gpu-check-bundle
readonly FMNIST=/usr/share/datasets/fashion-mnist
readonly BUNDLE_MAX_KIB=$((40 * 1024))
# meson.build's cuda_lib_dirs: a library there needs nothing from us.
readonly CUDA_LIB_DIRS=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
readonly CUDA_INCLUDE=/usr/local/cuda/include
# The CUDA libraries meson.build links (cublasLt: cuBLAS needs it at run time).
readonly CUDA_LIBS=(cudart cublas cublasLt nccl)
readonly CUDA_HEADERS=(cuda_runtime.h cublas_v2.h nccl.h)

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

short_usage() {
  sed -n '3,8{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

die() {
  echo "gpu-check: $*" >&2
  exit 1
}

# ---------------------------------------------------------------- --bundle --

# Copies one shared library under its soname (what the loader asks for) and,
# given LINKNAME, under that name too (-lX and find_library need libX.so),
# then the libraries it needs. Copies, not symlinks, so that nothing depends
# on how the folder travels. The C runtime, the compiler's own libraries and
# zlib (a required package on Debian and Ubuntu alike) are left out: the GPU
# machine has them, newer, and an older libstdc++ or libz on LD_LIBRARY_PATH
# would be loaded by every program there.
copy_lib() {
  local dir="$1" path="$2" linkname="${3:-}" real soname
  real="$(readlink -f "$path")"
  soname="$(readelf -d "$real" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')"
  soname="${soname:-$(basename "$real")}"
  [ -z "$linkname" ] || cp "$real" "$dir/lib/$linkname"
  [ -f "$dir/lib/$soname" ] && return 0
  cp "$real" "$dir/lib/$soname"
  # Debian 12 registers some libraries under /lib, which is a link to /usr/lib.
  { dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || echo "?: $real"; } \
    | head -n 1 >>"$dir/.sources"
  copy_deps "$dir" "$real"
}

copy_deps() {
  local dir="$1" file="$2" dep
  while read -r dep; do
    case "$(basename "$dep")" in
      ld-linux*|libc.so*|libm.so*|libmvec.so*|libdl.so*|libpthread.so*|librt.so*|\
      libutil.so*|libresolv.so*|libstdc++.so*|libgcc_s.so*|libz.so*) ;;
      *) copy_lib "$dir" "$dep" ;;
    esac
  done < <(ldd "$file" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
}

# Rewrites a Debian .pc file so that every path is under ${pcfiledir}/../..
# (the bundle's root). Some files have no prefix line (nlohmann_json.pc names
# /usr/include outright), so the prefix is always written first.
# shellcheck disable=SC2016  # ${...} is pkg-config's, not the shell's
rewrite_pc() {
  {
    echo 'prefix=${pcfiledir}/../..'
    sed -e '/^prefix=/d' \
        -e 's|^exec_prefix=.*|exec_prefix=${prefix}|' \
        -e 's|^libdir=.*|libdir=${prefix}/lib|' \
        -e 's|^sharedlibdir=.*|sharedlibdir=${libdir}|' \
        -e 's|/usr/include|${prefix}/include|g' \
        -e 's|/usr/lib/x86_64-linux-gnu|${prefix}/lib|g' "$1"
  } >"$2"
}

bundle_main() {
  [ $# -eq 1 ] || die "--bundle takes one DIR"
  local dir="$1" f m src dest pkg
  for f in readelf ldd dpkg-query pkg-config; do
    command -v "$f" >/dev/null || die "$f not found (run tools/install-deps.sh)"
  done
  # Never wipe a folder this script did not make.
  if [ -e "$dir" ]; then
    [ -f "$dir/$MARKER" ] || [ -z "$(ls -A "$dir")" ] \
      || die "$dir exists and is not a bundle; give a new or empty folder"
    rm -rf "$dir"
  fi
  mkdir -p "$dir"/{include,gloo-include,lib/pkgconfig,bin,libexec}
  dir="$(cd "$dir" && pwd)"

  # gloo has no .pc file (dist/meson.build finds it with find_library and
  # has_headers), so --run puts gloo-include on CPLUS_INCLUDE_PATH. The other
  # headers stay off every default path so that configure has to find them
  # through their .pc files, as it does here.
  local headers=(
    "/usr/include/eigen3 include libeigen3-dev"
    "/usr/include/doctest include doctest-dev"
    "/usr/include/CLI include libcli11-dev"
    "/usr/include/nlohmann include nlohmann-json3-dev"
    "/usr/include/libpng16 include libpng-dev"
    "/usr/include/zlib.h include zlib1g-dev"
    "/usr/include/zconf.h include zlib1g-dev"
    "/usr/include/gloo gloo-include libgloo-dev"
  )
  for f in "${headers[@]}"; do
    read -r src dest pkg <<<"$f"
    [ -e "$src" ] || die "$src not found (Debian package $pkg: run tools/install-deps.sh)"
    cp -a "$src" "$dir/$dest/"
  done

  : >"$dir/.sources"
  local libs=(
    "/usr/lib/libgloo.so libgloo-dev"
    "/usr/lib/x86_64-linux-gnu/libpng16.so libpng-dev"
    "/usr/lib/x86_64-linux-gnu/libz.so zlib1g-dev"
  )
  for f in "${libs[@]}"; do
    read -r src pkg <<<"$f"
    [ -e "$src" ] || die "$src not found (Debian package $pkg: run tools/install-deps.sh)"
    if [ "$(basename "$src")" = libz.so ]; then
      # Only for -lz: at run time the machine's own libz.so.1 is loaded.
      cp "$(readlink -f "$src")" "$dir/lib/libz.so"
    else
      copy_lib "$dir" "$src" "$(basename "$src")"
    fi
  done

  # pkgconf, in case the GPU machine has no pkg-config. The wrapper finds
  # libpkgconf next to it without touching the caller's LD_LIBRARY_PATH.
  cp /usr/bin/pkgconf "$dir/libexec/pkgconf"
  copy_deps "$dir" /usr/bin/pkgconf
  cat >"$dir/bin/pkg-config" <<'EOF'
#!/bin/sh
# Debian 12's pkgconf, run with the libpkgconf bundled next to it.
here="$(cd "$(dirname "$0")/.." && pwd)"
exec env LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$here/libexec/pkgconf" "$@"
EOF
  chmod +x "$dir/bin/pkg-config"

  for m in eigen3 CLI11 nlohmann_json libpng16 zlib; do
    src="$(pkg-config --variable=pcfiledir "$m")/$m.pc"
    [ -f "$src" ] || die "$m.pc not found (run tools/install-deps.sh)"
    rewrite_pc "$src" "$dir/lib/pkgconfig/$m.pc"
  done
  cp "$dir/lib/pkgconfig/libpng16.pc" "$dir/lib/pkgconfig/libpng.pc"
  # Debian's doctest-dev has only a CMake config; a .pc file spares the GPU
  # machine the CMake lookup (and its dependence on CMake's version).
  local dv
  dv="$(awk '/#define DOCTEST_VERSION_(MAJOR|MINOR|PATCH) / {v = v (v ? "." : "") $3}
             END {print v}' /usr/include/doctest/doctest.h)"
  cat >"$dir/lib/pkgconfig/doctest.pc" <<EOF
prefix=\${pcfiledir}/../..
includedir=\${prefix}/include

Name: doctest
Description: C++ testing framework (header-only, bundled by tools/gpu-check.sh)
Version: $dv
Cflags: -I\${includedir}
EOF

  if grep -n '/usr' "$dir"/lib/pkgconfig/*.pc; then
    die "the .pc files above still name /usr"
  fi
  # Every flag must point into the bundle, read by the bundled pkgconf alone.
  local flags version word bad=0
  for m in eigen3 doctest CLI11 nlohmann_json libpng zlib; do
    version="$(PKG_CONFIG_LIBDIR="$dir/lib/pkgconfig" PKG_CONFIG_PATH='' \
               "$dir/bin/pkg-config" --modversion "$m")" || die "the bundled pkg-config fails on $m"
    flags="$(PKG_CONFIG_LIBDIR="$dir/lib/pkgconfig" PKG_CONFIG_PATH='' \
             "$dir/bin/pkg-config" --cflags --libs "$m")" || die "the bundled pkg-config fails on $m"
    printf '  %-14s %-8s %s\n' "$m" "$version" "$flags"
    for word in $flags; do
      case "$word" in
        -I*|-L*) case "$(realpath -m "${word:2}")" in
                   "$dir"/*|"$dir") ;;
                   *) echo "gpu-check: $m: $word is outside the bundle" >&2; bad=1 ;;
                 esac ;;
      esac
    done
  done
  [ "$bad" -eq 0 ] || die "bundled .pc files point outside $dir"

  # A slice of Fashion-MNIST (the GPU machine has no dataset package), so
  # --run can train the same small job on the CPU and on the GPU and compare.
  if [ -e "$FMNIST/train-images-idx3-ubyte.gz" ]; then
    python3 "$root/tools/gpu-check/fashion_mnist_subset.py" "$FMNIST" "$dir/fashion-mnist-subset"
    echo "fashion-mnist-subset: 4096 training and 1024 test images" >>"$dir/.sources"
  else
    echo "gpu-check: $FMNIST not found: the bundle has no data, --run skips its training phase" >&2
  fi

  {
    echo "Made by tools/gpu-check.sh --bundle on $(date -u +%FT%TZ)"
    echo "from Debian $(cat /etc/debian_version 2>/dev/null || echo '?') packages:"
    dpkg-query -W -f='  ${Package} ${Version}\n' libeigen3-dev doctest-dev libcli11-dev \
      nlohmann-json3-dev libpng-dev zlib1g-dev libgloo-dev pkgconf-bin
    echo "libraries (package: file):"
    sort -u "$dir/.sources" | sed 's/^/  /'
  } >"$dir/MANIFEST.txt"
  rm -f "$dir/.sources"
  echo "gpu-check bundle v1" >"$dir/$MARKER"

  local kib
  kib="$(du -sk "$dir" | cut -f1)"
  cat "$dir/MANIFEST.txt"
  echo "gpu-check: bundle $dir: $(du -sh "$dir" | cut -f1) (${kib} KiB, limit ${BUNDLE_MAX_KIB} KiB)"
  [ "$kib" -le "$BUNDLE_MAX_KIB" ] || die "bundle is larger than 40 MiB"
}

# ------------------------------------------------------------ environment --

# site-packages folders that hold pip's nvidia-* wheels (PyTorch's CUDA).
python_sites() {
  local py d
  {
    for py in /opt/torch/.venv/bin/python3 /opt/*/.venv/bin/python3 /opt/*/venv/bin/python3 \
              python3; do
      command -v "$py" >/dev/null 2>&1 || continue
      "$py" -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null || true
    done
    for d in /opt/*/.venv/lib/python3*/site-packages /opt/*/venv/lib/python3*/site-packages \
             /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
      echo "$d"
    done
  } | awk '!seen[$0]++' | while read -r d; do
    [ -d "$d/nvidia" ] && echo "$d"
  done
  return 0
}

# Prints the library file for -lNAME from the first folder that has one:
# libNAME.so, else its highest libNAME.so.N.
find_lib_in() {
  local name="$1" d versioned
  shift
  for d in "$@"; do
    if [ -f "$d/lib$name.so" ]; then
      echo "$d/lib$name.so"
      return 0
    fi
    versioned="$(compgen -G "$d/lib$name.so.[0-9]*" | sort -V | tail -n 1)" || true
    if [ -n "$versioned" ]; then
      echo "$versioned"
      return 0
    fi
  done
  return 1
}

# Sets PATH, PKG_CONFIG, PKG_CONFIG_PATH, CPLUS_INCLUDE_PATH, LIBRARY_PATH and
# LD_LIBRARY_PATH for a build against BUNDLE and the machine's CUDA, and
# prints what it found. WORK gets lib/ (symlinks to the CUDA libraries found
# outside meson.build's dirs, with libX.so for a lib that only has libX.so.N:
# -lX and Meson's find_library need the bare name), runtime/ (the bundled
# libraries this machine lacks) and bin/ (a meson wrapper if need be).
# Meson's find_library(dirs: ...) searches those dirs, then the compiler's own
# search dirs (`c++ -print-search-dirs`), which include LIBRARY_PATH: so
# meson.build's fixed CUDA dirs, and dist/meson.build's for gloo, need no
# change.
setup_env() {
  local bundle="$1" work="$2" d f h name tool found
  [ -f "$bundle/$MARKER" ] || die "$bundle is not a bundle (make one with --bundle)"
  # In case the copy that carried the bundle here dropped the mode bits.
  chmod +x "$bundle/bin/pkg-config" "$bundle/libexec/pkgconf" 2>/dev/null || true
  rm -rf "$work"
  mkdir -p "$work/lib" "$work/bin" "$work/runtime"

  # Meson 1.0.1 finds nvcc only on PATH.
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    PATH="$PATH:/usr/local/cuda/bin"
  fi
  local sites=() pylib=() pyinc=()
  mapfile -t sites < <(python_sites)
  for d in "${sites[@]}"; do
    mapfile -t -O "${#pylib[@]}" pylib < <(find "$d/nvidia" -mindepth 2 -maxdepth 3 -type d \
                                           \( -name lib -o -name lib64 \) | sort)
    mapfile -t -O "${#pyinc[@]}" pyinc < <(find "$d/nvidia" -mindepth 2 -maxdepth 3 -type d \
                                           -name include | sort)
  done
  echo "python site-packages with nvidia wheels: ${sites[*]:-none}"

  # meson and ninja may exist only inside a venv (pip).
  for tool in meson ninja; do
    command -v "$tool" >/dev/null && continue
    for d in /opt/torch/.venv/bin /opt/*/.venv/bin /opt/*/venv/bin "$HOME/.local/bin"; do
      if [ -x "$d/$tool" ]; then
        PATH="$PATH:$d"
        break
      fi
    done
    if ! command -v "$tool" >/dev/null && [ "$tool" = meson ] \
        && python3 -c 'import mesonbuild' 2>/dev/null; then
      printf '#!/bin/sh\nexec python3 -m mesonbuild.mesonmain "$@"\n' >"$work/bin/meson"
      chmod +x "$work/bin/meson"
      PATH="$PATH:$work/bin"
    fi
    command -v "$tool" >/dev/null || echo "WARNING: $tool not found"
  done

  if command -v pkg-config >/dev/null; then
    PKG_CONFIG="$(command -v pkg-config)"
  else
    PKG_CONFIG="$bundle/bin/pkg-config"
    PATH="$bundle/bin:$PATH"
  fi
  echo "pkg-config: $PKG_CONFIG"

  # Libraries: meson.build's dirs first (what Meson would pick anyway), then
  # the venv wheels, then the system (apt's libnccl2).
  local rt_dirs=() inc_dirs=()
  local search=("${CUDA_LIB_DIRS[@]}" "${pylib[@]}" /usr/lib/x86_64-linux-gnu)
  for name in "${CUDA_LIBS[@]}"; do
    if ! found="$(find_lib_in "$name" "${search[@]}")"; then
      echo "lib$name: NOT FOUND in ${search[*]}"
      continue
    fi
    d="$(dirname "$found")"
    if [ "$(basename "$found")" = "lib$name.so" ] \
        && { [ "$d" = "${CUDA_LIB_DIRS[0]}" ] || [ "$d" = "${CUDA_LIB_DIRS[1]}" ]; }; then
      echo "lib$name: $found -> $(readlink -f "$found") (in meson.build's dirs)"
      continue
    fi
    for f in "$d/lib$name.so".*; do
      [ -e "$f" ] && ln -sfn "$f" "$work/lib/"
    done
    ln -sfn "$found" "$work/lib/lib$name.so"
    [[ " ${rt_dirs[*]} " == *" $d "* ]] || rt_dirs+=("$d")
    echo "lib$name: $found -> $(readlink -f "$found") (as $work/lib/lib$name.so)"
  done
  for h in "${CUDA_HEADERS[@]}"; do
    if [ -f "$CUDA_INCLUDE/$h" ]; then
      echo "$h: $CUDA_INCLUDE"
      continue
    fi
    found=""
    for d in "${pyinc[@]}"; do
      if [ -f "$d/$h" ]; then
        found="$d"
        break
      fi
    done
    if [ -n "$found" ]; then
      [[ " ${inc_dirs[*]} " == *" $found "* ]] || inc_dirs+=("$found")
      echo "$h: $found"
    else
      echo "$h: NOT FOUND in $CUDA_INCLUDE or the venvs"
    fi
  done

  # At run time the machine's own copy of a bundled library wins where it has
  # one (newer, same soname): a Debian libibverbs on LD_LIBRARY_PATH would be
  # what NCCL loads too. The others (gloo, hiredis) come from the bundle.
  local from_bundle=() from_system=() sys_path
  for f in "$bundle"/lib/*.so.*; do
    name="$(basename "$f")"
    sys_path="$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n {print $NF; exit}')"
    if [ -n "$sys_path" ] && [ -e "$sys_path" ]; then
      from_system+=("$name")
    else
      ln -sfn "$f" "$work/runtime/$name"
      from_bundle+=("$name")
    fi
  done
  echo "run-time libraries from the bundle: ${from_bundle[*]:-none}; from the system: ${from_system[*]:-none}"

  local joined
  PKG_CONFIG_PATH="$bundle/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  joined="$(IFS=:; echo "$bundle/gloo-include${inc_dirs[*]:+:${inc_dirs[*]}}")"
  CPLUS_INCLUDE_PATH="$joined${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  LIBRARY_PATH="$bundle/lib:$work/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  # The loader must find gloo and its dependencies for the test executables,
  # and so must the linker when it links them.
  joined="$(IFS=:; echo "$work/runtime:$work/lib${rt_dirs[*]:+:${rt_dirs[*]}}")"
  LD_LIBRARY_PATH="$joined${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH PKG_CONFIG PKG_CONFIG_PATH CPLUS_INCLUDE_PATH LIBRARY_PATH LD_LIBRARY_PATH
}

print_exports() {
  local v
  for v in PATH PKG_CONFIG PKG_CONFIG_PATH CPLUS_INCLUDE_PATH LIBRARY_PATH LD_LIBRARY_PATH; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
}

env_main() {
  [ $# -eq 1 ] || die "--env takes one DIR"
  local bundle
  bundle="$(cd "$1" && pwd)" || die "no such folder: $1"
  cd "$root"
  setup_env "$bundle" "$root/${GPU_CHECK_BUILD_DIR:-build-gpu}-env" >&2
  print_exports
}

# ------------------------------------------------------------------- --run --

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
        --out "$out/$q-$dev" || { echo "(exit $?)"; rc=1; }
    done
  done
  train_verdict "$out" || rc=1
  return "$rc"
}

# train_verdict DIR: one line per quantizer, the last evaluation's test MSE
# on each device and their ratio; each must be within 5% (PASS/FAIL).
train_verdict() {
  python3 "$root/tools/gpu-check/train_verdict.py" "$1"
}

# The GPU bench suites, each row against its floor (a row whose op has no
# kernel yet says so): the NF4 and VQ rows first (short, and the ones
# with goals to meet: nf4_dequantize ratio <= 1.18, nf4_gemv_8192_b1 <= 0.33,
# vq_nearest_* <= 1.2), then the engine and train rows. Timings, not
# a test: the phase fails only when a command fails. The commands share
# LIMIT seconds, each getting what the ones before it left (phase_bench
# LIMIT).
phase_bench() {
  local quanta="$build/tools/quanta" suite rc=0 end=$((SECONDS + $1)) left
  [ -x "$quanta" ] || { echo "no quanta binary in $build"; return 1; }
  for suite in nf4 quant engine train; do
    left=$((end - SECONDS))
    [ "$left" -ge 10 ] || { echo "== bench $suite: no time left"; rc=1; continue; }
    echo "== bench $suite --device cuda"
    timeout -k 5 "$left" "$quanta" bench "$suite" --device cuda --repeat 3 \
      --threads "$(nproc)" || { echo "(exit $?)"; rc=1; }
  done
  return "$rc"
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

# suite_states before|after: prints `built NAME` for each test of the build
# dir, or `missing NAME` when its executable was not built, or (after) `notrun
# NAME` when testlog.json lacks it (meson test stopped before starting it).
suite_states() {
  python3 "$root/tools/gpu-check/suite_states.py" "$build" "$1"
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
  setup_opts=(-Dcuda=enabled -Dnative=true "${extra[@]}")
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

case "${1:-}" in
  --bundle) shift; bundle_main "$@" ;;
  --run) shift; run_main "$@" ;;
  --env) shift; env_main "$@" ;;
  -h|--help) usage ;;
  *) short_usage >&2; exit 2 ;;
esac
