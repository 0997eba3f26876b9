#!/usr/bin/env bash
# Configures (once) and builds MegaSlide into build/ ($MEGASLIDE_BUILD_DIR).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}
# Paths under the repository hash relative to the build directory, so
# ccache also serves `pip install .`'s build-python/ (docs/Python.md).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
# Pin the interpreter: `python3` may be a pyenv shim (TOOLCHAIN.md).
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')

if [ ! -f "$build/build.ninja" ]; then
  cmake -G Ninja -S "$root" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$python"
fi
cmake --build "$build"
