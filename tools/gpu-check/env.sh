# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck disable=SC2164  # sourced under set -e: a failed cd ends it
# tools/gpu-check.sh --env DIR: sets up the environment --run would (its log
# to stderr) and prints it as `export` lines for a shell to eval, so that a
# shell on the GPU machine can run meson, ninja or a suite by hand as --run
# would.

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

env_main() {
  [ $# -eq 1 ] || die "--env takes one DIR"
  local bundle
  bundle="$(cd "$1" && pwd)" || die "no such folder: $1"
  cd "$root"
  setup_env "$bundle" "$root/${GPU_CHECK_BUILD_DIR:-build-gpu}-env" >&2
  print_exports
}
