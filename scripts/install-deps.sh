#!/usr/bin/env bash
# Installs everything MegaSlide needs to build and test on Debian 12.
# Idempotent: re-running only installs what is missing.
set -euo pipefail

APT_PACKAGES=(
  # MLIR/LLVM 22: all four are needed (MLIRTargets.cmake wants the tools).
  llvm-22-dev llvm-22-tools libmlir-22-dev mlir-22-tools
  # Build.
  cmake ninja-build lld ccache g++
  # The cpu backend's GEMM (runtime/cpu/Gemm.cpp): oneDNN's sgemm.
  libdnnl-dev
  # Tests and bindings.
  libgtest-dev pybind11-dev python3-dev python3-pip
  # scripts/pip-install-check.sh: `pip install .` into a venv (PEP 668).
  python3-venv
  # The ASan+UBSan build and libFuzzer targets (scripts/sanitize.sh).
  clang-22 libclang-rt-22-dev
  # Data parallelism (docs/Distributed.md): Open MPI's mpirun and headers
  # for the MPI plugin (runtime/dist/MpiCollectives.cpp).
  libopenmpi-dev openmpi-bin
  # The NVMe tier's asynchronous I/O (runtime/host/NvmeTier.cpp): io_uring.
  liburing-dev
  # The training report rendered by a real browser, headless
  # (test/python/test_training_report.py): 122 MB to fetch, 414 MB
  # installed, about a minute (docs/Testing.md).
  chromium
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Python test packages, pinned. Installed for the interpreter the build uses.
PYTHON="${PYTHON:-$(command -v python3)}"
pip_flags=(-q --disable-pip-version-check)
# Debian's own Python refuses pip installs (PEP 668) unless told otherwise.
if "$PYTHON" -c 'import sys, sysconfig, os; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
  pip_flags+=(--break-system-packages)
fi
"$PYTHON" -m pip install "${pip_flags[@]}" -r "$(dirname "$0")/requirements-test.txt"
