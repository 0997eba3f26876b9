#!/usr/bin/env bash
# The device check: runs from the bundle of scripts/device-bundle.sh on a
# bare GPU node (NVIDIA driver and CUDA; no MLIR, LLVM or network) in at
# most 300 s of command time. Every step has a deadline; what does not fit
# is skipped and said so, and a step that needs the GPU says so where there
# is none (then the check is a dry run of everything else). The call a
# session with a device makes, and what each step checks: docs/Testing.md,
# "The device check".
#   1. machine: GPU, driver, memory (MemAvailable, cgroup), CPUs, libcuda,
#      cuBLASLt, NVRTC (its version against the bundle's), cuDNN, torch;
#   2. gtest: the runtime's GPU and CUDA unit tests; the GPU ones must run
#      (a skip is a failure where there is a GPU);
#   3. parity: the cuda backend against the cpu backend's stored reference
#      on the tiny plans (20 losses; every gradient of step 1), and the cpu
#      backend against the same reference (bit for bit);
#   4. dsa: the 3D-DSA kernels against a float64 reference (small
#      configurations whole, the 105B shape on a sample of tiles), timed,
#      with a FlexAttention baseline; the diffusers processor's FlexAttention
#      path (scripts/dsa_processor_gpu_check.py);
#   5. sanitizer: compute-sanitizer memcheck and racecheck of a tiny step;
#   6. calibration: per-op-kind times of DiT-XL/2, the mid Wan model and the
#      105B 2-block cut on the cuda backend against the sim's prediction for
#      the same plans.
# Results in $OUT (else build/device-check), at most 8 files, the summary
# first: 1-summary.txt, 2-machine.txt, 3-gtest.log, 4-parity.txt,
# 5-dsa.json, 6-sanitizer.txt, 7-calibration.txt, 8-logs.tar.gz (every
# step's log, metrics and JSON).
# Usage: scripts/device-check.sh [BUNDLE] (default build-bundle/).
# DEVICE_CHECK_SECONDS overrides the 300 s deadline. Exit status: non-zero
# if a step that ran failed.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$(cd "${1:-$root/build-bundle}" 2>/dev/null && pwd) || {
  echo "device check: no bundle at ${1:-$root/build-bundle}; make one with" \
    "scripts/device-bundle.sh" >&2
  exit 1
}
out=${OUT:-$root/build/device-check}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
logs=$work/logs
mkdir -p "$logs"
summary=$out/1-summary.txt
: >"$summary"
status=0
begin=$SECONDS
deadline=$((SECONDS + ${DEVICE_CHECK_SECONDS:-300}))
exec_=$bundle/bin/megaslide-exec
plans=$bundle/plans
ref=$bundle/reference
python=$(command -v python3 || true)
# The comparisons and the kernel check need NumPy (and torch for the
# FlexAttention baseline, which says so itself).
numpy=0
[ -n "$python" ] && "$python" -c 'import numpy' 2>/dev/null && numpy=1
say() { echo "$*" | tee -a "$summary"; }

# step NAME SECONDS CMD...: runs CMD with a time limit (never past the
# deadline), its output in $logs/NAME.log; returns its status (124 when it
# timed out, 125 when skipped for lack of time).
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    say "  $name: SKIPPED (the ${DEVICE_CHECK_SECONDS:-300} s are spent)"
    return 125
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -ne 0 ] && verdict="FAILED (exit $rc)"
  # 137: killed 5 s after the TERM of the time limit
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="TIMED OUT after $limit s"
    rc=124
  fi
  say "  $name: $verdict in $((SECONDS - start)) s"
  return $rc
}
# cmd || fail: a failed step fails the check, one skipped for time does not.
fail() {
  [ $? -eq 125 ] || status=1
}

# The kernel cache is copied: the bundle may be read-only, and a run that
# compiles (another NVRTC) must not change it.
export MEGASLIDE_KERNEL_CACHE=$work/kernel-cache
cp -r "$bundle/kernel-cache" "$MEGASLIDE_KERNEL_CACHE"
export MEGASLIDE_TEST_PLANS=$plans
# The shared libraries the binaries need beyond libc (oneDNN and its
# OpenMP runtime), the biggest compressed: unpacked here, since the bundle
# may be read-only.
mkdir -p "$work/lib"
for f in "$bundle"/lib/*; do
  case $f in
  *.xz) python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
    "$f" "$work/lib/$(basename "${f%.xz}")" ;;
  *) cp "$f" "$work/lib/" ;;
  esac
done
export LD_LIBRARY_PATH=$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

#===------------------------------------------------------------------===#
say "== 1. machine"
gpu=0
if nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
fi
{
  date -u
  uname -a
  echo "bundle: $(sed -n 's/.*"commit": "\(.*\)",/\1/p' "$bundle/manifest.json")," \
    "NVRTC $(sed -n 's/.*"nvrtc_version": "\(.*\)",/\1/p' "$bundle/manifest.json")"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  grep -E '^(MemTotal|MemAvailable)' /proc/meminfo
  for f in /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes; do
    [ -r "$f" ] && echo "cgroup memory limit ($f): $(cat "$f")"
  done
  if [ -r /sys/devices/system/memory/block_size_bytes ]; then
    blocks=$(ls -d /sys/devices/system/memory/memory* 2>/dev/null | wc -l)
    online=$(cat /sys/devices/system/memory/memory*/online 2>/dev/null | grep -c 1)
    echo "MemBlocks: $blocks of 0x$(cat /sys/devices/system/memory/block_size_bytes) B, $online online"
  fi
  echo "MEGASLIDE_HOST_MEMORY: ${MEGASLIDE_HOST_MEMORY:-(not set)}"
  echo "CPUs: $(nproc)"
  ldd --version 2>&1 | head -n 1
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v compute-sanitizer || echo "no compute-sanitizer on PATH"
  # Where the libraries the runtime dlopens are, and what torch carries.
  for lib in libcuda.so.1 libcublasLt.so libnvrtc.so libcudnn.so; do
    echo "$lib: $(ldconfig -p 2>/dev/null | grep -m1 "$lib" | sed 's/.*=> //' || true)"
  done
  ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib64/libnvrtc.so* \
    /usr/local/cuda/lib64/libcudnn*.so* 2>/dev/null
  if [ -n "$python" ]; then
    "$python" - <<'EOF'
import glob, os
try:
    import torch
    print("torch", torch.__version__, "CUDA", torch.version.cuda,
          "cuDNN", torch.backends.cudnn.version(),
          "GPU" if torch.cuda.is_available() else "no GPU")
    import nvidia
    for d in nvidia.__path__:
        for p in sorted(glob.glob(os.path.join(d, "*", "lib", "lib*.so*"))):
            if any(k in p for k in ("cudnn.so", "cublasLt", "nvrtc.so")):
                print("torch's", p)
except Exception as e:  # torch is optional: say what is missing
    print("torch:", type(e).__name__, e)
EOF
  fi
} >"$out/2-machine.txt" 2>&1
# The runtime finds cuBLASLt and NVRTC in the toolkit; where only torch's
# wheels carry them, their folders go on the loader's path.
if ! ls /usr/local/cuda/lib64/libcublasLt.so* >/dev/null 2>&1; then
  for p in $(sed -n "s/^torch's //p" "$out/2-machine.txt"); do
    export LD_LIBRARY_PATH=$(dirname "$p")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
fi
grep -E '^(bundle:|Mem|MEGASLIDE_HOST|CPUs|ldd)' "$out/2-machine.txt" | sed 's/^/  /' |
  tee -a "$summary"
[ $gpu = 1 ] && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader 2>&1 | sed 's/^/  GPU: /' | tee -a "$summary"
[ $gpu = 0 ] &&
  say "  GPU: none here; the steps that need one say so and are skipped"
if [ $numpy = 0 ]; then
  say "  python3 with NumPy: not here; the comparisons and kernel checks" \
    "cannot run"
  fail
fi
nvrtc_here=$(timeout 60 "$exec_" --plan "$plans/tiny.json" \
  --precompile-kernels sm_90a 2>&1 | sed -n 's/.*(NVRTC \(.*\))$/\1/p')
nvrtc_bundle=$(sed -n 's/.*"nvrtc_version": "\(.*\)",/\1/p' "$bundle/manifest.json")
if [ -z "$nvrtc_here" ]; then
  say "  NVRTC: not found here (the cuda backend needs it)"
  [ $gpu = 1 ] && fail
elif [ "$nvrtc_here" = "$nvrtc_bundle" ]; then
  say "  NVRTC $nvrtc_here, as in the bundle: its kernel cache is used"
else
  say "  NVRTC $nvrtc_here here, $nvrtc_bundle in the bundle: kernels are" \
    "recompiled (the cache key includes the version)"
fi

#===------------------------------------------------------------------===#
say "== 2. gtest (the runtime's GPU and CUDA unit tests)"
# The rest of the suite runs on every CI run (scripts/test.sh).
step gtest 60 "$bundle/bin/megaslide-runtime-tests" \
  --gtest_filter='*Gpu*:CudaApiTest.*:CudaKernelsTest.*:*CudaTinyPlanTest.*' || fail
cp "$logs/gtest.log" "$out/3-gtest.log"
grep -E '^\[  (PASSED|FAILED|SKIPPED) \]|tests? from .* ran' "$logs/gtest.log" |
  tail -n 4 | tee -a "$summary"
gpu_skips=$(grep '^\[  SKIPPED \] .*Gpu' "$logs/gtest.log" | sed 's/ (.*//' |
  sort -u | wc -l)
if [ $gpu = 1 ] && [ "$gpu_skips" -gt 0 ]; then
  say "  $gpu_skips GPU tests SKIPPED on the GPU machine: a failure here"
  fail
elif [ $gpu = 0 ]; then
  say "  the $gpu_skips GPU tests need the GPU (skipped here)"
fi

#===------------------------------------------------------------------===#
say "== 3. parity: cuda and cpu against the stored cpu reference"
: >"$out/4-parity.txt"
for plan in tiny tiny-dsa; do
  # The reference is deterministic: the cpu backend here must give it again.
  if step "cpu-$plan" 30 "$exec_" --plan "$plans/$plan.json" --backend cpu \
    --steps 1 --seed 0 --no-progress --metrics "$logs/cpu-$plan.jsonl" \
    --save-gradients "$logs/cpu-$plan.safetensors"; then
    if cmp -s "$logs/cpu-$plan.safetensors" "$ref/$plan.gradients.safetensors" &&
      cut -d, -f1,2 "$logs/cpu-$plan.jsonl" | cmp -s - <(cut -d, -f1,2 "$ref/$plan.step1.jsonl"); then
      say "  cpu-$plan: loss and gradients bit-identical to the bundle's reference"
    elif [ $numpy = 1 ] && "$python" "$root/scripts/compare_steps.py" --steps 1 \
      "$ref/$plan.step1.jsonl" "$logs/cpu-$plan.jsonl" \
      --gradients "$ref/$plan.gradients.safetensors" \
      "$logs/cpu-$plan.safetensors" >"$logs/cpu-$plan.compare.txt" 2>&1; then
      # The cpu kernels are bitwise reproducible on one machine, not across
      # instruction sets (docs/Runtime.md, "Determinism").
      say "  cpu-$plan: within tolerance of the bundle's reference, not" \
        "bit-identical (another CPU: the kernels' bits follow its instruction set)"
    else
      say "  cpu-$plan: DIFFERS from the bundle's reference"
      fail
    fi
  else
    fail
  fi
  if [ $gpu = 0 ]; then
    say "  cuda-$plan: needs the GPU (skipped here)"
    continue
  fi
  step "cuda-$plan" 30 "$exec_" --plan "$plans/$plan.json" --backend cuda \
    --steps 20 --seed 0 --no-progress --metrics "$logs/cuda-$plan.jsonl" || fail
  step "cuda-$plan-grad" 30 "$exec_" --plan "$plans/$plan.json" --backend cuda \
    --steps 1 --seed 0 --no-progress --metrics "$logs/cuda-$plan.step1.jsonl" \
    --save-gradients "$logs/cuda-$plan.safetensors" || fail
  if [ -f "$logs/cuda-$plan.jsonl" ] && [ -f "$logs/cuda-$plan.safetensors" ] &&
    [ $numpy = 1 ]; then
    echo "### $plan: 20 losses, then every gradient of step 1" >>"$out/4-parity.txt"
    "$python" "$root/scripts/compare_steps.py" --steps 20 \
      "$ref/$plan.losses.jsonl" "$logs/cuda-$plan.jsonl" \
      --json "$logs/parity-$plan.json" >>"$out/4-parity.txt" 2>&1
    losses=$?
    "$python" "$root/scripts/compare_steps.py" --steps 1 \
      "$ref/$plan.step1.jsonl" "$logs/cuda-$plan.step1.jsonl" \
      --gradients "$ref/$plan.gradients.safetensors" \
      "$logs/cuda-$plan.safetensors" --json "$logs/parity-$plan-grad.json" \
      >>"$out/4-parity.txt" 2>&1
    grads=$?
    if [ $losses -eq 0 ] && [ $grads -eq 0 ]; then
      say "  parity $plan: cuda agrees with the cpu reference"
    else
      say "  parity $plan: cuda DIFFERS (losses exit $losses, gradients" \
        "exit $grads; 4-parity.txt)"
      status=1
    fi
  fi
done

#===------------------------------------------------------------------===#
say "== 4. 3D-DSA kernels: float64 reference, 105B tiles, FlexAttention"
if [ $gpu = 1 ] && [ $numpy = 1 ]; then
  # Numerics, then times with the baseline: a timeout of the second (its
  # torch.compile) keeps the first's report.
  step dsa 75 "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --check --seconds 30 --json "$out/5-dsa.json" || fail
  grep -E 'FAIL|ok' "$logs/dsa.log" | tail -n 8 | tee -a "$summary"
  command -v cc >/dev/null || command -v gcc >/dev/null ||
    say "  no C compiler: torch.compile (FlexAttention) may fail"
  step dsa-bench 75 "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --bench --flex --json "$logs/dsa-bench.json" || fail
  grep -iE 'ratio|TFLOP|FAIL|skipped' "$logs/dsa-bench.log" | tail -n 8 |
    tee -a "$summary"
  # The diffusers processor's path: offsets and compiled FlexAttention on
  # the GPU against a float64 reference, and its time against SDPA.
  step dsa-processor 90 "$python" "$root/scripts/dsa_processor_gpu_check.py" \
    --json "$logs/dsa-processor.json" || fail
  grep -E 'ok|FAIL|ratio|skipped' "$logs/dsa-processor.log" | tail -n 5 |
    tee -a "$summary"
elif [ $gpu = 1 ]; then
  say "  3D-DSA kernels: need python3 with NumPy (not here)"
else
  say "  kernels on the GPU: need the GPU; the sampled reference is self-tested"
  step dsa-self-test 60 "$python" "$root/scripts/dsa_gpu_check.py" \
    --self-test || fail
  step dsa 30 "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --check --bench --flex --json "$out/5-dsa.json" || fail
fi

#===------------------------------------------------------------------===#
say "== 5. compute-sanitizer on a tiny cuda step"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
: >"$out/6-sanitizer.txt"
if [ $gpu = 0 ] || [ -z "$sanitizer" ]; then
  say "  memcheck, racecheck: need the GPU and compute-sanitizer (skipped here)"
else
  for tool in memcheck racecheck; do
    step "sanitizer-$tool" 40 "$sanitizer" --tool "$tool" --error-exitcode 9 \
      "$exec_" --plan "$plans/tiny-dsa.json" --backend cuda --steps 1 \
      --no-progress || fail
    { echo "### $tool"; tail -n 20 "$logs/sanitizer-$tool.log"; } >>"$out/6-sanitizer.txt"
  done
fi

#===------------------------------------------------------------------===#
say "== 6. calibration: cuda trace against the sim's prediction"
: >"$out/7-calibration.txt"
for plan in dit-xl-2-256 wan-mid 105b-2blocks; do
  step "sim-$plan" 30 "$exec_" --plan "$plans/$plan.json" --backend sim \
    --steps 1 --no-progress --trace "$logs/sim-$plan.trace.json" || { fail; continue; }
  if [ $gpu = 0 ]; then
    say "  cuda-$plan: needs the GPU (the sim's prediction is in the logs)"
    continue
  fi
  step "cuda-$plan" 45 "$exec_" --plan "$plans/$plan.json" --backend cuda \
    --steps 3 --no-progress --metrics "$logs/cuda-$plan.jsonl" \
    --trace "$logs/cuda-$plan.trace.json" || { fail; continue; }
  {
    echo "### $plan"
    "$python" "$root/scripts/compare_trace_sim.py" \
      "$logs/cuda-$plan.trace.json" "$logs/sim-$plan.trace.json" \
      --json "$logs/calibration-$plan.json"
  } >>"$out/7-calibration.txt" 2>&1 || fail
  grep -iE 'step|total' "$out/7-calibration.txt" | tail -n 2 | sed "s/^/  $plan: /" |
    tee -a "$summary"
done

#===------------------------------------------------------------------===#
tar -czf "$out/8-logs.tar.gz" -C "$work" logs
say "== device check: $([ $status -eq 0 ] && echo passed || echo FAILED)" \
  "in $((SECONDS - begin)) s (results in $out)"
exit $status
