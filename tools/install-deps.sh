#!/usr/bin/env bash
# Installs every system package that quanta's build, tests and main job need.
# Idempotent and non-interactive: safe to run on every CI start.
set -euo pipefail

packages=(
  meson ninja-build pkg-config g++ cmake   # build (cmake: doctest's config)
  libeigen3-dev                            # CPU kernels
  libopenblas-openmp-dev                   # CPU GEMM (OpenMP build: shares our threads)
  libdnnl-dev                              # CPU f32 GEMM: oneDNN picks the CPU's widest kernels
  doctest-dev                              # tests
  libgloo-dev                              # dist: CPU collectives
  nlohmann-json3-dev                       # JSON (metadata, bench output)
  libcli11-dev                             # command-line flags
  libpng-dev zlib1g-dev                    # PNG of reconstructions
  libsentencepiece-dev                     # text through a model's tokenizer.model
  libicu-dev                               # text through a model's tokenizer.json
  dataset-fashion-mnist                    # `quanta train` default data
  python3                                  # CI summary script
  clang-format                             # CI's format check (tools/dev/check-format.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${missing[*]}"
