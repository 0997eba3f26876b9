#!/usr/bin/env bash
# Configures (once) and builds MegaSlide into build/ ($MEGASLIDE_BUILD_DIR).
#   --runtime-only: the runtime without MLIR (megaslide-exec,
#   megaslide-calibrate, megaslide-report and the runtime's tests, LLVM
#   Support linked statically) into build-runtime/
#   (docs/Runtime.md, "A runtime without MLIR").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
runtime_only=OFF
if [ "${1:-}" = --runtime-only ]; then
  runtime_only=ON
  shift
fi
if [ $# -gt 0 ]; then
  echo "usage: $0 [--runtime-only]" >&2
  exit 2
fi
default_build=$root/build
[ $runtime_only = ON ] && default_build=$root/build-runtime
build=${MEGASLIDE_BUILD_DIR:-$default_build}
# Paths under the repository hash relative to the build directory, so
# ccache also serves `pip install .`'s build-python/ (docs/Python.md).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
# Pin the interpreter: `python3` may be a pyenv shim (docs/Architecture.md,
# "Toolchain").
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')

if [ ! -f "$build/build.ninja" ]; then
  cmake -G Ninja -S "$root" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DMEGASLIDE_RUNTIME_ONLY=$runtime_only \
    -DPython3_EXECUTABLE="$python"
fi
cmake --build "$build"
