#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU (the lent H200), in under
# 8 minutes (a deadline caps every step; what does not fit is skipped and
# said so):
#   1. what the machine has (GPU, driver, toolkit, compilers);
#   2. configure + build with CUDA (when MLIR 22 is installed), then the unit
#      tests (the cuda backend's GPU tests run here: CudaBackendGpuTest) and
#      the lit tests of the CUDA target (GPU tests skip without a GPU);
#   3. training parity: `megaslide-run --model tiny --steps 20` on the cpu
#      and on the cuda backend (same seed, same synthetic data); the loss
#      sequences must agree: relative difference <= 1e-2 at step 1 (same
#      weights, only bf16 rounding and summation order differ) and <= 5e-2
#      at every step up to 20 (AdamW amplifies those differences a little).
#      The saved tiny plan, and the tiny model with 3D-DSA attention, then
#      run CudaBackendGpuTinyTest (losses and every gradient of 3 steps
#      against the cpu backend; the DSA one runs the generated kernels);
#   4. the 3D-DSA kernels of test/Target/Cuda/Inputs/dsa3d_device_configs.mlir
#      (small check configurations + the 105B video DiT) compiled by NVRTC
#      for sm_90a with their resource report (registers, shared memory,
#      spills, occupancy) and the HMMA count of their SASS;
#   5. with a GPU: scripts/dsa_gpu_check.py runs those kernels, checks the
#      small configurations against a float64 NumPy reference and times the
#      105B one (forward, backward, offsets);
#   6. benchmarks on the cuda backend: tiny step time with a Chrome trace of
#      every instruction (per-stream overlap), and a DiT-XL/2 256x256 step.
#
# Logs and reports go to $OUT (else build/device-check). Without MLIR on the
# machine, the kernels can come prebuilt: DSA_KERNELS=DIR (output of
# megaslide-translate --emit-dsa-kernels ... -o DIR --cubin sm_90a), and the
# tools from a carried build directory. DEVICE_CHECK_SECONDS overrides the
# 470 s deadline.
# Exit status: non-zero if a build, test, compilation, parity or numerics
# step failed.
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
deadline=$((SECONDS + ${DEVICE_CHECK_SECONDS:-470}))

# step NAME SECONDS CMD...: runs CMD with a time limit (never past the
# deadline), log in $out/NAME.log. Skipped (exit 124) when under 15 s remain.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "==== $name: SKIPPED, the 8-minute budget is spent" | tee -a "$summary"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "==== $name: $*" | tee -a "$summary"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$out/$name.log"
  echo "---- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$summary"
  return $rc
}

# compare_losses CPU.jsonl CUDA.jsonl STEPS: the parity rule of step 3.
compare_losses() {
  awk -v steps="$3" '
    function loss(line) { sub(/.*"loss": */, "", line); sub(/[,}].*/, "", line); return line + 0 }
    FNR == NR { cpu[FNR] = loss($0); n1 = FNR; next }
    { cuda[FNR] = loss($0); n2 = FNR }
    END {
      if (n1 != steps || n2 != steps) {
        printf "parity: expected %d steps, cpu logged %d, cuda %d\n", steps, n1, n2
        exit 1
      }
      bad = 0
      for (i = 1; i <= steps; i++) {
        d = cuda[i] - cpu[i]; if (d < 0) d = -d
        r = d / (cpu[i] < 0 ? -cpu[i] : (cpu[i] > 1e-6 ? cpu[i] : 1e-6))
        tol = i == 1 ? 1e-2 : 5e-2
        flag = r <= tol ? "ok" : "FAIL"
        if (r > tol) bad = 1
        printf "step %2d  cpu %.6f  cuda %.6f  rel %.2e (tol %.0e) %s\n", i, cpu[i], cuda[i], r, tol, flag
      }
      exit bad
    }' "$1" "$2"
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
    megaslide-translate megaslide-unit-tests megaslide-opt megaslide-plan \
    megaslide-run; then
    translate="$build/bin/megaslide-translate"
    step unit-tests 90 "$build/bin/megaslide-unit-tests" --gtest_brief=1 ||
      status=1
    # The cuda backend's GPU tests again, verbosely (a skip is a failure
    # here: this machine has the GPU they wait for).
    if step cuda-gtests 90 "$build/bin/megaslide-unit-tests" \
      --gtest_filter='CudaBackendGpuTest.*:CudaApiTest.*:*CudaBackendGpuTinyTest*'; then
      if grep -q "SKIPPED.*CudaBackendGpuTest.HandBuilt" "$out/cuda-gtests.log"; then
        echo "cuda-gtests: the GPU tests skipped on the GPU machine" |
          tee -a "$summary"
        status=1
      fi
    else
      status=1
    fi
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

# 3. Training parity, cpu against cuda, on the tiny model.
run="$build/bin/megaslide-run"
if [ -x "$run" ]; then
  step run-cpu 90 "$run" --model tiny --backend cpu --steps 20 --seed 0 \
    --no-progress --metrics "$out/tiny-cpu.jsonl" \
    --save-plan "$out/tiny-plan.json" || status=1
  if step run-cuda 90 "$run" --model tiny --backend cuda --steps 20 --seed 0 \
    --no-progress --metrics "$out/tiny-cuda.jsonl" \
    --trace "$out/tiny-cuda-trace.json"; then
    if compare_losses "$out/tiny-cpu.jsonl" "$out/tiny-cuda.jsonl" 20 \
      >"$out/parity.txt" 2>&1; then
      echo "parity: cpu and cuda losses agree over 20 steps" | tee -a "$summary"
    else
      echo "parity: cpu and cuda losses DIFFER (see parity.txt)" |
        tee -a "$summary"
      status=1
    fi
    cat "$out/parity.txt"
  else
    status=1
  fi
  if [ -f "$out/tiny-plan.json" ]; then
    step cuda-plan-gtest 90 env MEGASLIDE_CUDA_TEST_PLAN="$out/tiny-plan.json" \
      "$build/bin/megaslide-unit-tests" \
      --gtest_filter='*CudaBackendGpuTinyTest*' || status=1
  fi
else
  echo "no megaslide-run: parity steps skipped" | tee -a "$summary"
fi

# 4. Kernels for sm_90a and their resources.
if [ -n "$translate" ]; then
  rm -rf "$kernels"
  export MEGASLIDE_KERNEL_CACHE=${MEGASLIDE_KERNEL_CACHE:-$out/kernel-cache}
  step dsa-kernels 180 "$translate" --emit-dsa-kernels \
    "$root/test/Target/Cuda/Inputs/dsa3d_device_configs.mlir" \
    -o "$kernels" --cubin sm_90a || status=1
fi
if ls "$kernels"/*.resources.txt >/dev/null 2>&1; then
  cat "$kernels"/*.resources.txt >"$out/dsa-resources.txt"
  # Five lines per kernel (name, registers, two spill lines, occupancy)
  # become one row; the per-file "# compiled by" headers are left out.
  grep -h -E '^(kernel |  (registers|spill stores|spill loads|occupancy):)' \
    "$out/dsa-resources.txt" | paste - - - - - >"$out/dsa-resources-table.txt"
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

# 5. Run them on the GPU.
if ls "$kernels"/*.cubin >/dev/null 2>&1 && [ -n "$python" ]; then
  step dsa-gpu 240 "$python" "$root/scripts/dsa_gpu_check.py" "$kernels" \
    --check --bench || status=1
  cat "$out/dsa-gpu.log"
fi

# 6. Benchmarks on the cuda backend (step times; per-instruction timings
# and stream overlap in the traces, viewable in Perfetto).
if [ -x "$run" ]; then
  step bench-tiny-cuda 60 "$run" --model tiny --backend cuda --steps 50 \
    --seed 1 --no-progress --metrics "$out/bench-tiny-cuda.jsonl" || status=1
  step bench-dit-cuda 150 "$run" --model dit-xl-2 --frames 1 --height 256 \
    --width 256 --backend cuda --steps 3 --no-progress \
    --metrics "$out/bench-dit-cuda.jsonl" \
    --trace "$out/bench-dit-cuda-trace.json" || status=1
  for f in "$out"/bench-*.jsonl; do
    [ -f "$f" ] || continue
    awk -v name="$(basename "$f" .jsonl)" '
      { sub(/.*"seconds": */, ""); sub(/}.*/, ""); t[NR] = $0 + 0 }
      END {
        if (NR < 2) { printf "%s: %d steps\n", name, NR; exit }
        s = 0; for (i = 2; i <= NR; i++) s += t[i]
        printf "%s: %d steps, mean step %.4f s (first %.4f s)\n", name, NR, s / (NR - 1), t[1]
      }' "$f"
  done | tee "$out/benchmarks.txt" | tee -a "$summary"
fi

echo
cat "$summary"
echo "device check: $([ $status -eq 0 ] && echo passed || echo FAILED)" \
  "(logs in $out)"
exit $status
