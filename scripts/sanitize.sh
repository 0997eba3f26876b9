#!/usr/bin/env bash
# The ASan + UBSan build (docs/Testing.md, "Hardening"): configures and
# builds build-sanitize/ ($MEGASLIDE_SANITIZE_BUILD_DIR) with clang-22,
# -DMEGASLIDE_SANITIZE=ON, then runs the GoogleTest binary and the lit
# suite in it, then scripts/fuzz.sh over the fuzz targets built there.
# Exits non-zero on any sanitizer report, test failure or fuzz crash.
#
# Only what those runs need is built: the unit tests, the tools lit calls,
# the fuzz targets and their replay binaries. The Python module is left
# out of this build (an instrumented extension needs the ASan runtime
# preloaded into the interpreter), so pytest runs only in the normal build.
#
# Environment: FUZZ_RUNS / FUZZ_SECONDS are passed on to fuzz.sh;
# SANITIZE_SKIP_FUZZ=1 stops after the test suites.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${MEGASLIDE_SANITIZE_BUILD_DIR:-$root/build-sanitize}
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
cc=${MEGASLIDE_SANITIZE_CC:-clang-22}
cxx=${MEGASLIDE_SANITIZE_CXX:-clang++-22}

for tool in "$cc" "$cxx"; do
  command -v "$tool" > /dev/null || {
    echo "sanitize.sh: $tool not found; run scripts/install-deps.sh" >&2
    exit 1
  }
done

# -O1 keeps the instrumented build fast to compile and its stacks readable;
# the runtime's kernels keep their own -O3.
if [ ! -f "$build/build.ninja" ]; then
  cmake -G Ninja -S "$root" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_C_FLAGS_RELEASE="-O1 -gline-tables-only" \
    -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" \
    -DMEGASLIDE_SANITIZE=ON \
    -DPython3_EXECUTABLE="$python" || exit 1
fi

targets=(megaslide-runtime-tests megaslide-compiler-tests megaslide-test-plans
  megaslide-opt megaslide-plan megaslide-run megaslide-exec megaslide-translate
  megaslide-docs megaslide-fuzz megaslide-calibrate megaslide-report)
start=$SECONDS
cmake --build "$build" --target "${targets[@]}" || exit 1
echo "sanitize.sh: build took $((SECONDS - start)) s"

# Sanitizer settings shared by every instrumented process (lit passes the
# environment through). Leak checking stays on: what Debian's LLVM keeps
# alive until exit (option and pass registries) is still reachable then,
# which LeakSanitizer does not report; the suppressions name only what
# libraries we do not build leak (cuBLASLt's load-time allocation).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:abort_on_error=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$root/scripts/lsan-suppressions.txt:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

status=0
run() {
  echo
  echo "==== $1"
  shift
  local start=$SECONDS
  "$@" || status=1
  echo "($((SECONDS - start)) s)"
}
run "GoogleTest under ASan+UBSan: the runtime" \
  "$build/bin/megaslide-runtime-tests" --gtest_brief=1
run "GoogleTest under ASan+UBSan: the compiler" \
  "$build/bin/megaslide-compiler-tests" --gtest_brief=1
run "lit under ASan+UBSan" /usr/lib/llvm-22/bin/lit -sv "$build/test"
run "signals on the stop path under ASan+UBSan" \
  "$python" "$root/scripts/signal-stress.py" --trials 30 --tools "$build/bin"
if [ "${SANITIZE_SKIP_FUZZ:-0}" != 1 ]; then
  run "fuzz targets" env MEGASLIDE_FUZZ_BUILD_DIR="$build" "$root/scripts/fuzz.sh"
fi
echo
[ $status -eq 0 ] && echo "Sanitizer build: all passed." || echo "Sanitizer build: FAILED."
exit $status
