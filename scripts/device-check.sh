#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU (the lent H200), in under
# 8 minutes:
#   1. what the machine has (GPU, driver, toolkit, compilers);
#   2. configure + build with CUDA (when MLIR 22 is installed), then the unit
#      tests and the lit tests of the CUDA target (GPU tests skip without a
#      GPU);
#   3. the 3D-DSA kernels of test/Target/Cuda/Inputs/dsa3d_device_configs.mlir
#      (small check configurations + the 105B video DiT) compiled by NVRTC
#      for sm_90a with their resource report (registers, shared memory,
#      spills, occupancy) and the HMMA count of their SASS;
#   4. with a GPU: scripts/dsa_gpu_check.py runs the kernels, checks the small
#      configurations against a float64 NumPy reference and times the 105B
#      one (forward, backward, offsets).
#      TODO(runtime issue): the CUDA runtime backend will launch these
#      kernels from an execution plan; the Python ctypes launcher is the
#      stop-gap until then.
#
# Logs and reports go to $OUT (else build/device-check). Without MLIR on the
# machine, the kernels can come prebuilt: DSA_KERNELS=DIR (output of
# megaslide-translate --emit-dsa-kernels ... -o DIR --cubin sm_90a).
# Exit status: non-zero if a build, test, compilation or numerics step failed.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/build/device-check}
build=${MEGASLIDE_BUILD_DIR:-$root/build}
kernels=${DSA_KERNELS:-$out/dsa-kernels}
python=$(python3 -c "import sys; print(sys.executable)" 2>/dev/null || true)
jobs=$(nproc 2>/dev/null || echo 4)
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
status=0

# step NAME SECONDS CMD...: runs CMD with a time limit, log in $out/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "==== $name: $*" | tee -a "$summary"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$out/$name.log"
  echo "---- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$summary"
  return $rc
}

# 1. The machine.
{
  date -u
  uname -a
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  ls /usr/local/cuda/lib64/libnvrtc.so* 2>/dev/null || echo "no /usr/local/cuda NVRTC"
  command -v nvcc && nvcc --version | tail -n 2
  command -v cmake ninja g++ || true
  ls -d /usr/lib/llvm-22/lib/cmake/mlir 2>/dev/null || echo "no MLIR 22"
  [ -n "$python" ] && "$python" -c 'import numpy; print("numpy", numpy.__version__)'
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# 2. Build and tests.
translate=""
if [ -d /usr/lib/llvm-22/lib/cmake/mlir ] && command -v cmake >/dev/null &&
  command -v ninja >/dev/null; then
  if [ ! -f "$build/build.ninja" ]; then
    step configure 120 cmake -G Ninja -S "$root" -B "$build" \
      -DCMAKE_BUILD_TYPE=Release ${python:+-DPython3_EXECUTABLE=$python} ||
      status=1
  fi
  if step build 300 cmake --build "$build" -j "$jobs" --target \
    megaslide-translate megaslide-unit-tests megaslide-opt megaslide-plan; then
    translate="$build/bin/megaslide-translate"
    step unit-tests 60 "$build/bin/megaslide-unit-tests" --gtest_brief=1 ||
      status=1
    step lit-cuda 120 /usr/lib/llvm-22/bin/lit -sv "$build/test/Target/Cuda" ||
      status=1
  else
    status=1
  fi
elif [ -x "$build/bin/megaslide-translate" ] &&
  "$build/bin/megaslide-translate" --version >/dev/null 2>&1; then
  translate="$build/bin/megaslide-translate"
  echo "no MLIR 22 here: using the prebuilt $translate" | tee -a "$summary"
else
  echo "no MLIR 22 and no working megaslide-translate: build and compile" \
    "steps skipped (pass DSA_KERNELS=DIR with prebuilt cubins)" |
    tee -a "$summary"
fi

# 3. Kernels for sm_90a and their resources.
if [ -n "$translate" ]; then
  rm -rf "$kernels"
  export MEGASLIDE_KERNEL_CACHE=${MEGASLIDE_KERNEL_CACHE:-$out/kernel-cache}
  step dsa-kernels 180 "$translate" --emit-dsa-kernels \
    "$root/test/Target/Cuda/Inputs/dsa3d_device_configs.mlir" \
    -o "$kernels" --cubin sm_90a || status=1
fi
if ls "$kernels"/*.resources.txt >/dev/null 2>&1; then
  cat "$kernels"/*.resources.txt >"$out/dsa-resources.txt"
  grep -h -E '^kernel|registers|spill|occupancy' "$out/dsa-resources.txt" |
    paste - - - - - >"$out/dsa-resources-table.txt"
  if grep -E 'spill (stores|loads): +[1-9]' "$out/dsa-resources.txt"; then
    echo "register spills in the 3D-DSA kernels" | tee -a "$summary"
    status=1
  fi
fi
cuobjdump=$(command -v cuobjdump || true)
if [ -z "$cuobjdump" ] && [ -n "$python" ]; then
  cuobjdump=$("$python" -c 'import glob, os, nvidia; print(next(iter(sorted(
    p for d in nvidia.__path__
    for p in glob.glob(os.path.join(d, "*", "bin", "cuobjdump")))), ""))' \
    2>/dev/null || true)
fi
if [ -n "$cuobjdump" ] && ls "$kernels"/*.cubin >/dev/null 2>&1; then
  export PATH="$(dirname "$cuobjdump"):$PATH" # nvdisasm lives next to it
  for cubin in "$kernels"/*.cubin; do
    echo "$(basename "$cubin"): $("$cuobjdump" -sass "$cubin" 2>&1 |
      grep -c HMMA) HMMA instructions"
  done | tee "$out/dsa-sass.txt"
fi

# 4. Run them on the GPU.
if ls "$kernels"/*.cubin >/dev/null 2>&1 && [ -n "$python" ]; then
  step dsa-gpu 240 "$python" "$root/scripts/dsa_gpu_check.py" "$kernels" \
    --check --bench || status=1
  cat "$out/dsa-gpu.log"
fi

echo
cat "$summary"
echo "device check: $([ $status -eq 0 ] && echo passed || echo FAILED)" \
  "(logs in $out)"
exit $status
