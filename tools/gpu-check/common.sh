# shellcheck shell=bash
# What tools/gpu-check.sh's modes share: where the checkout is, die, and the
# environment a CUDA build against a bundle needs (setup_env, print_exports),
# which --run sets up before it configures and --env prints. Sourced once, by
# the mode's own file (bundle.sh, run.sh, env.sh).

# Absolute, since --run and --env cd to the repository root before they use it.
gpu_check_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly gpu_check_dir
root="$(cd "$gpu_check_dir/../.." && pwd)"
# shellcheck disable=SC2034  # for the files that source this one
readonly root
readonly MARKER=.gpu-check-bundle
# meson.build's cuda_lib_dirs: a library there needs nothing from us.
readonly CUDA_LIB_DIRS=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
readonly CUDA_INCLUDE=/usr/local/cuda/include
# The CUDA libraries meson.build links (cublasLt: cuBLAS needs it at run time).
readonly CUDA_LIBS=(cudart cublas cublasLt cudnn nccl)
readonly CUDA_HEADERS=(cuda_runtime.h cublas_v2.h cudnn.h nccl.h)

die() {
  echo "gpu-check: $*" >&2
  exit 1
}

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
    # HOME may be unset where the device tool runs us (and set -u is on).
    for d in /opt/torch/.venv/bin /opt/*/.venv/bin /opt/*/venv/bin "${HOME:-}/.local/bin"; do
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
    # awk reads to the end: leaving early would kill ldconfig with SIGPIPE,
    # and under pipefail that ended the whole run silently (status 141).
    sys_path="$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n && !found {found = 1; print $NF}')"
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
