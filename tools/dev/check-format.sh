#!/usr/bin/env bash
# Checks (or with --fix, applies) the one code format: .clang-format at the
# repository root (Google style, 100 columns), on every tracked C++ and CUDA
# source. CI's hygiene phase runs it; a file that differs fails the check.
#
#   tools/dev/check-format.sh          list the files that differ, exit 1 if any
#   tools/dev/check-format.sh --fix    format them in place
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
command -v clang-format >/dev/null || { echo "check-format: clang-format not found (tools/install-deps.sh installs it)"; exit 2; }
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
differ=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || differ+=("$f")
done
if [ ${#differ[@]} -gt 0 ]; then
  echo "check-format: ${#differ[@]} of ${#files[@]} files differ from clang-format's output (tools/dev/check-format.sh --fix):"
  printf '  %s\n' "${differ[@]}"
  exit 1
fi
echo "check-format: all ${#files[@]} C++/CUDA sources match .clang-format"
