# shellcheck shell=bash source-path=SCRIPTDIR
# tools/gpu-check.sh --bundle DIR: copies the Debian build dependencies the GPU
# machines lack (headers, Gloo and libpng with the libraries they need,
# relocatable .pc files, pkgconf), a slice of Fashion-MNIST and the PyTorch
# peers' packages into DIR, and checks that DIR is self-contained, at most
# 40 MiB, and with the working tree within the device tool's 64. Why a bundle, and
# what it leaves out: the header of tools/gpu-check.sh.

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

readonly FMNIST=/usr/share/datasets/fashion-mnist
readonly BUNDLE_MAX_KIB=$((40 * 1024))
# What the device tool carries, the working tree and the bundle together.
readonly CARRY_MAX_KIB=$((64 * 1024))

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

# The PyTorch side of the GPU comparisons, unpacked into peer/site (one
# folder for PYTHONPATH; unpack_wheels.py, no pip needed there), for the
# GPU machines' Python 3.12, whose torch, transformers, peft and accelerate
# they use (PyPI is reached from here, never from there):
# - ../shared/peer's replica of quanta train (beside a developer's checkout
#   only, never in a plain clone) and vector-quantize-pytorch 1.32 with the
#   pure-Python packages it needs that the machines' image lacks;
# - bitsandbytes, the QLoRA row's peer, which the image lacks: of its 43 MB
#   wheel only the Python package and the libraries the machines' torch
#   loads (the CPU one, and the one for its CUDA, torch.version.cuda 13.0:
#   libbitsandbytes_cuda130.so), about 4.5 MB.
# Without the replica or its wheels, --run skips its peer phase; without
# bitsandbytes, the QLoRA row runs without its floor; each says why.
readonly PEER_SCRIPT="$root/../shared/peer/quanta_arch_fmnist.py"
readonly PEER_WHEELS=(vector-quantize-pytorch==1.32.0 einx==0.4.3 einops==0.8.2
                      torch-einops-utils==0.2.0 loguru==0.7.3 frozendict==2.5.1)
readonly BNB_WHEEL=bitsandbytes==0.50.2
readonly BNB_LIBS=libbitsandbytes_cpu.so,libbitsandbytes_cuda130.so

# pip download for the GPU machines' Python 3.12 on x86-64: PLATFORM WHEEL...
download_wheels() {
  local dest="$1" platform="$2"
  shift 2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform "$platform" -d "$dest" "$@"
}

bundle_peer() {
  local dir="$1" wheels
  wheels="$(mktemp -d)"
  mkdir -p "$dir/peer/site"
  if [ ! -f "$PEER_SCRIPT" ]; then
    echo "gpu-check: no $PEER_SCRIPT: the bundle has no PyTorch replica of quanta train" >&2
  elif ! download_wheels "$wheels/vq" manylinux2014_x86_64 "${PEER_WHEELS[@]}"; then
    echo "gpu-check: the replica's wheels could not be downloaded: the bundle has no replica" >&2
  else
    cp "$PEER_SCRIPT" "$dir/peer/"
    python3 "$gpu_check_dir/unpack_wheels.py" "$dir/peer/site" "$wheels"/vq/*.whl
    echo "peer: quanta_arch_fmnist.py and wheels ${PEER_WHEELS[*]}" >>"$dir/.sources"
  fi
  if download_wheels "$wheels/bnb" manylinux_2_24_x86_64 "$BNB_WHEEL"; then
    python3 "$gpu_check_dir/unpack_wheels.py" "$dir/peer/site" --libs "$BNB_LIBS" \
      "$wheels"/bnb/*.whl
    echo "peer: $BNB_WHEEL (Python package, ${BNB_LIBS//,/ })" >>"$dir/.sources"
  else
    echo "gpu-check: $BNB_WHEEL could not be downloaded: the QLoRA row will lack its floor" >&2
  fi
  rm -rf "$wheels"
  find "$dir/peer" -name __pycache__ -prune -exec rm -rf {} +
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
    python3 "$gpu_check_dir/fashion_mnist_subset.py" "$FMNIST" "$dir/fashion-mnist-subset"
    echo "fashion-mnist-subset: 4096 training and 1024 test images" >>"$dir/.sources"
  else
    echo "gpu-check: $FMNIST not found: the bundle has no data, --run skips its training phase" >&2
  fi

  bundle_peer "$dir"

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

  local kib tree_kib
  kib="$(du -sk "$dir" | cut -f1)"
  # The files that travel with the bundle: tracked ones and untracked ones
  # git does not ignore.
  tree_kib="$(cd "$root" && git ls-files -z -co --exclude-standard \
              | du -ck --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)" || tree_kib=0
  cat "$dir/MANIFEST.txt"
  echo "gpu-check: bundle $dir: $(du -sh "$dir" | cut -f1) (${kib} KiB, limit ${BUNDLE_MAX_KIB} KiB)"
  echo "gpu-check: with the working tree (${tree_kib} KiB): $((kib + tree_kib)) KiB of the" \
       "${CARRY_MAX_KIB} KiB the device tool carries"
  [ "$kib" -le "$BUNDLE_MAX_KIB" ] || die "bundle is larger than 40 MiB"
  [ $((kib + tree_kib)) -le "$CARRY_MAX_KIB" ] \
    || die "the bundle and the working tree exceed the 64 MiB the device tool carries"
}
