#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine: installs what is
# missing, builds, then runs lit, GoogleTest and pytest, each printing its
# summary. Exits non-zero if any of them fails.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_BUILD_DIR:-$root/build}
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')

"$root/scripts/install-deps.sh" || exit 1
"$root/scripts/build.sh" || exit 1

status=0
run() {
  echo
  echo "==== $1"
  shift
  "$@" || status=1
}
run "lit (IR and tool tests)" /usr/lib/llvm-22/bin/lit -sv "$build/test"
run "GoogleTest: the compiler" "$build/bin/megaslide-compiler-tests" --gtest_brief=1
run "GoogleTest: the runtime" "$build/bin/megaslide-runtime-tests" --gtest_brief=1
# The runtime without MLIR (docs/Runtime.md, "A runtime without MLIR"),
# what runs on a bare GPU node, goes into the device bundle; the device
# check then runs as a dry run without a GPU (docs/Testing.md, "The device
# check"), the runtime-only megaslide-runtime-tests included. Both keep
# working between the sessions that have a GPU. test_runtime_only.py
# (pytest, below) checks the binaries' dependencies and their bit-for-bit
# parity with the full build.
runtime=${MEGASLIDE_RUNTIME_BUILD:-$root/build-runtime}
run "runtime-only build, device bundle, device check (dry run without a GPU)" \
  env MEGASLIDE_BUILD_DIR="$build" MEGASLIDE_RUNTIME_BUILD="$runtime" \
  sh -c '"$0/scripts/device-bundle.sh" && OUT="$1/device-check" "$0/scripts/device-check.sh"' \
  "$root" "$build"
# MEGASLIDE_REQUIRE_CHROMIUM / _MPI: the browser test of the training
# report and the mpirun tests fail, not skip, where install-deps.sh did not
# give a chromium or Open MPI.
run "pytest (Python module)" env PYTHONPATH="$build/python_packages" \
  MEGASLIDE_RUNTIME_BUILD="$runtime" MEGASLIDE_REQUIRE_RUNTIME_BUILD=1 \
  MEGASLIDE_REQUIRE_CHROMIUM=1 MEGASLIDE_REQUIRE_MPI=1 \
  "$python" -m pytest -q "$root/test/python"
# `pip install .` into a venv and pytest on the installed package: ~4.5 min
# after the build above (ccache serves it), ~10 min cold (docs/Python.md).
run "pip install . (packaging) and pytest on the installed package" \
  env PYTHON="$python" "$root/scripts/pip-install-check.sh"
# ASan+UBSan build into build-sanitize/, its GoogleTest and lit runs, then
# bounded fuzzing (docs/Testing.md, "Hardening"; timings there).
# MEGASLIDE_SKIP_SANITIZE=1 leaves it out of a local run.
[ "${MEGASLIDE_SKIP_SANITIZE:-0}" = 1 ] ||
  run "ASan+UBSan: GoogleTest, lit and fuzz targets" "$root/scripts/sanitize.sh"
echo
[ $status -eq 0 ] && echo "All test suites passed." || echo "Some test suites FAILED."
exit $status
