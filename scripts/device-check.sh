#!/usr/bin/env bash
# The device check: runs from the bundle of scripts/device-bundle.sh on a
# bare GPU node (NVIDIA driver and CUDA; no MLIR, LLVM or network) within
# DEVICE_CHECK_SECONDS (340) of command time, the bundle's unpacking
# included, so that the session's one call (timeout_s=360) returns whole.
# The call, what each step checks and the figures: docs/Testing.md, "The
# device check". Steps, most valuable first:
#   1. machine: GPU, driver, memory, CPUs, libcuda, cuBLASLt, NVRTC, cuDNN,
#      torch;
#   2. kernel cache: every plan's modules precompiled from the bundle's
#      cache: all hits where NVRTC's version is the bundle's;
#   3. gtest: the runtime's GPU unit tests (a skip of a GPU suite fails the
#      check where there is a GPU);
#   4. parity: the cuda backend against the cpu backend's stored reference
#      on the tiny plans (20 losses; every gradient of step 1), and the cpu
#      backend against the same reference;
#   5. sanitizer: compute-sanitizer memcheck, racecheck and synccheck of a
#      step of tiny and of tiny-dsa;
#   6. dsa: the 3D-DSA kernels against a float64 reference;
#   7. compile: the NVRTC compile-everything tests (after the GPU tests);
#   8. calibration: per-op-kind cuda times against the sim's prediction,
#      and the time the cuda backend takes to pin its host pools;
#   9. benchmarks: the 3D-DSA kernels and FlexAttention, the diffusers
#      processor against SDPA.
# Steps 2-7 are required: one that runs and fails, or exceeds its own time
# limit, fails the check. Calibration and benchmarks never fail it. A step
# with less time left than it needs is skipped ("skipped: needs N s, M
# left"); one stopped by the deadline is "cut short"; neither is a failure,
# but a required one makes the verdict "incomplete". Without a GPU the
# steps that need one say so (a dry run of everything else).
# Results in $OUT (else build/device-check), at most 8 files:
# 1-summary.txt (the step lines, then every figure on one screen),
# 2-machine.txt, 3-gtest.log, 4-parity.txt, 5-dsa.json, 6-sanitizer.txt,
# 7-calibration.txt, 8-logs.tar.gz (every step's log, metrics and JSON).
# Usage: scripts/device-check.sh [BUNDLE] (default build-bundle/).
# Exit status: 0 passed (or a dry run), 1 failed, 3 incomplete (a required
# step skipped or cut short for time).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$(cd "${1:-$root/build-bundle}" 2>/dev/null && pwd) || {
  echo "device check: no bundle at ${1:-$root/build-bundle}; make one with" \
    "scripts/device-bundle.sh" >&2
  exit 1
}
budget=${DEVICE_CHECK_SECONDS:-340}
case $budget in
'' | *[!0-9]*)
  echo "device check: DEVICE_CHECK_SECONDS must be a number of seconds," \
    "not '$budget'" >&2
  exit 1
  ;;
esac
begin=$SECONDS
deadline=$((begin + budget))
out=${OUT:-$root/build/device-check}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
logs=$work/logs
mkdir -p "$logs"
summary=$out/1-summary.txt
figures=$work/figures.txt
: >"$summary"
: >"$figures"
status=0
incomplete=()
exec_=$bundle/bin/megaslide-exec
tests=$bundle/bin/megaslide-runtime-tests
plans=$bundle/plans
ref=$bundle/reference
python=$(command -v python3 || true)
# The comparisons and the kernel check need NumPy (and torch for the
# FlexAttention baseline, which says so itself).
numpy=0
[ -n "$python" ] && "$python" -c 'import numpy' 2>/dev/null && numpy=1
say() { echo "$*" | tee -a "$summary"; }
fig() { # LABEL TEXT...: one line of the figures, the label in a column
  local label=$1
  shift
  printf '%-24s %s\n' "$label" "$*" >>"$figures"
}

# step NAME NEED LIMIT KIND CMD...: runs CMD, its output in $logs/NAME.log,
# for at most LIMIT s, if at least NEED s are left before the deadline (at
# most what is left). KIND is required (a failure, or a time-out at its own
# LIMIT, fails the check) or optional (reported only). Returns 0 when CMD
# passed, 1 when it failed or timed out, 2 when skipped or cut short for
# time.
step() {
  local name=$1 need=$2 limit=$3 kind=$4
  shift 4
  local start=$SECONDS left=$((deadline - SECONDS)) capped=0
  [ "$left" -lt 0 ] && left=0
  if [ "$left" -lt "$need" ]; then
    say "  $name: skipped: needs $need s, $left left"
    [ "$kind" = required ] && incomplete+=("$name")
    return 2
  fi
  if [ "$limit" -gt "$left" ]; then
    limit=$left
    capped=1
  fi
  timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$? verdict
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    say "  $name: ok in $took s"
    return 0
  fi
  # 137: killed 5 s after the TERM of the time limit
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    if [ $capped = 1 ]; then
      say "  $name: cut short by the deadline after $took s"
      [ "$kind" = required ] && incomplete+=("$name")
      return 2
    fi
    verdict="TIMED OUT at its limit of $limit s"
  else
    verdict="FAILED (exit $rc) in $took s"
  fi
  if [ "$kind" = required ]; then
    say "  $name: $verdict"
    status=1
  else
    say "  $name: $verdict (optional: does not fail the check)"
  fi
  return 1
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
if [ $gpu = 1 ]; then
  gpu_name=$(nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader 2>&1 | head -n 1)
  say "  GPU: $gpu_name"
  fig GPU "$gpu_name"
else
  say "  GPU: none here; the steps that need one say so (a dry run)"
  fig GPU "none (a dry run)"
fi
if [ $numpy = 0 ]; then
  say "  python3 with NumPy: not here; the comparisons and kernel checks" \
    "cannot run"
  status=1
fi

#===------------------------------------------------------------------===#
say "== 2. kernel cache: every plan's modules from the bundle's cache"
# Hits are what the bundle is for: a miss with the bundle's NVRTC means
# the key depends on something that differs here (runtime/cuda/Nvrtc.cpp).
nvrtc_bundle=$(sed -n 's/.*"nvrtc_version": "\(.*\)",/\1/p' "$bundle/manifest.json")
step cache 5 25 optional bash -c 'exec_=$1; shift; for plan in "$@"; do
    echo "### $(basename "$plan")"
    "$exec_" --plan "$plan" --precompile-kernels sm_90a || exit 1
  done' _ "$exec_" $(ls "$plans"/*.json | grep -v '\.config\.json$')
cache_rc=$?
touch "$logs/cache.log"
nvrtc_here=$(sed -n 's/.*(NVRTC \(.*\))$/\1/p' "$logs/cache.log" | head -n 1)
modules=$(grep -cE '\.cu: [0-9]+ B cubin in' "$logs/cache.log")
hits=$(grep -cE '\.cu: [0-9]+ B cubin in .*\(cached\)$' "$logs/cache.log")
if [ $cache_rc -eq 2 ]; then
  fig "kernel cache" "not checked (no time left)"
elif [ -z "$nvrtc_here" ]; then
  say "  NVRTC: not found here, or it failed (cache.log; the cuda backend" \
    "needs it)"
  fig "kernel cache" "NVRTC not found (bundle's $nvrtc_bundle)"
  [ $gpu = 1 ] && status=1
elif [ "$nvrtc_here" = "$nvrtc_bundle" ]; then
  say "  NVRTC $nvrtc_here, as in the bundle: $hits of $modules modules" \
    "cached"
  fig "kernel cache" "$hits of $modules modules hit (NVRTC $nvrtc_here, as" \
    "the bundle's)"
  if [ $cache_rc -ne 0 ] || [ "$hits" -ne "$modules" ] || [ "$modules" -eq 0 ]; then
    say "  kernel cache: $((modules - hits)) misses with the bundle's NVRTC" \
      "(or the step did not finish): a failure"
    status=1
  fi
elif [ -n "$nvrtc_here" ]; then
  say "  NVRTC $nvrtc_here here, $nvrtc_bundle in the bundle: kernels are" \
    "recompiled (the key includes the version); $hits of $modules cached"
  fig "kernel cache" "$hits of $modules modules hit (NVRTC $nvrtc_here here," \
    "$nvrtc_bundle in the bundle: misses expected)"
fi

#===------------------------------------------------------------------===#
say "== 3. gtest: the runtime's GPU unit tests"
# The GPU suites are those whose name has "Gpu" (CudaBackendGpuTest,
# .../CudaBackendGpuTinyTest): where there is a GPU they must run, and a
# skip of one fails the check. Tests outside them that skip when a device
# exists (CudaApiTest.NoDeviceGivesAClearError,
# CudaBackendTest.CreateWithoutDeviceSaysWhy) are reported only.
gpu_suite='^([A-Za-z0-9_]+/)?[A-Za-z0-9_]*Gpu[A-Za-z0-9_]*\.'
step gtest 15 40 required "$tests" --gtest_filter='*Gpu*:CudaApiTest.*:CudaBackendTest.CreateWithoutDeviceSaysWhy'
gtest_rc=$?
touch "$logs/gtest.log" "$logs/gtest-compile.log"
cp "$logs/gtest.log" "$out/3-gtest.log"
gtest_line() { # LOG: "P passed, F failed, S skipped" from gtest's footer
  local p f s
  grep -q '^\[==========\] .* ran\.' "$1" || {
    echo "not run to the end"
    return
  }
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\.$/\1/p' "$1" | tail -n 1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests\?, listed below:$/\1/p' "$1" | tail -n 1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?, listed below:$/\1/p' "$1" | tail -n 1)
  echo "${p:-0} passed, ${f:-0} failed, ${s:-0} skipped"
}
gpu_ran=$(sed -n 's/^\[ RUN      \] //p' "$logs/gtest.log" | grep -cE "$gpu_suite")
gpu_skipped=$(sed -n 's/^\[  SKIPPED \] \([^ ]*\) (.*/\1/p' "$logs/gtest.log" |
  grep -E "$gpu_suite" | sort -u)
other_skipped=$(sed -n 's/^\[  SKIPPED \] \([^ ]*\) (.*/\1/p' "$logs/gtest.log" |
  grep -vE "$gpu_suite" | sort -u)
say "  $(gtest_line "$logs/gtest.log"); $gpu_ran of the GPU suites' tests ran"
fig "gtest GPU" "$(gtest_line "$logs/gtest.log") ($gpu_ran in the GPU suites)"
if [ $gpu = 1 ] && [ $gtest_rc -ne 2 ]; then
  if [ -n "$gpu_skipped" ]; then
    say "  GPU tests SKIPPED on the GPU machine, a failure:" $gpu_skipped
    status=1
  elif [ "$gpu_ran" -eq 0 ] && [ -s "$logs/gtest.log" ]; then
    say "  no test of the GPU suites ran on the GPU machine: a failure"
    status=1
  fi
  [ -n "$other_skipped" ] &&
    say "  skipped where a device exists, as they should:" $other_skipped
elif [ $gpu = 0 ]; then
  say "  the GPU suites need the GPU (skipped here)"
fi

#===------------------------------------------------------------------===#
say "== 4. parity: cuda and cpu against the stored cpu reference"
: >"$out/4-parity.txt"
for plan in tiny tiny-dsa; do
  # The reference is deterministic: the cpu backend here must give it again.
  if step "cpu-$plan" 3 10 required "$exec_" --plan "$plans/$plan.json" \
    --backend cpu --steps 1 --seed 0 --no-progress \
    --metrics "$logs/cpu-$plan.jsonl" \
    --save-gradients "$logs/cpu-$plan.safetensors"; then
    if cmp -s "$logs/cpu-$plan.safetensors" "$ref/$plan.gradients.safetensors" &&
      cut -d, -f1,2 "$logs/cpu-$plan.jsonl" | cmp -s - <(cut -d, -f1,2 "$ref/$plan.step1.jsonl"); then
      say "  cpu-$plan: loss and gradients bit-identical to the bundle's reference"
      fig "cpu $plan" "bit-identical to the reference"
    elif [ $numpy = 1 ] && "$python" "$root/scripts/compare_steps.py" --steps 1 \
      "$ref/$plan.step1.jsonl" "$logs/cpu-$plan.jsonl" \
      --gradients "$ref/$plan.gradients.safetensors" \
      "$logs/cpu-$plan.safetensors" >"$logs/cpu-$plan.compare.txt" 2>&1; then
      # The cpu kernels are bitwise reproducible on one machine, not across
      # instruction sets (docs/Runtime.md, "Determinism").
      say "  cpu-$plan: within tolerance of the bundle's reference, not" \
        "bit-identical (another CPU: the kernels' bits follow its instruction set)"
      fig "cpu $plan" "within tolerance, not bit-identical"
    else
      say "  cpu-$plan: DIFFERS from the bundle's reference"
      fig "cpu $plan" "DIFFERS from the reference"
      status=1
    fi
  fi
  if [ $gpu = 0 ]; then
    say "  cuda-$plan: needs the GPU (skipped here)"
    continue
  fi
  step "cuda-$plan" 8 20 required "$exec_" --plan "$plans/$plan.json" \
    --backend cuda --steps 20 --seed 0 --no-progress \
    --metrics "$logs/cuda-$plan.jsonl"
  step "cuda-$plan-grad" 5 10 required "$exec_" --plan "$plans/$plan.json" \
    --backend cuda --steps 1 --seed 0 --no-progress \
    --metrics "$logs/cuda-$plan.step1.jsonl" \
    --save-gradients "$logs/cuda-$plan.safetensors"
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
    "$python" - "$logs/parity-$plan.json" "$logs/parity-$plan-grad.json" \
      "$plan" >>"$figures" 2>&1 <<'EOF'
import json, sys
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return {}
losses, grads, plan = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
rel = [r["rel"] for r in losses.get("losses", []) if r["rel"] is not None]
g = [r["rel"] for r in grads.get("gradients", []) if r["rel"] is not None]
print("%-24s losses max rel %s over %d steps; gradients max err/scale "
      "%s over %d tensors: %s" % (
          "parity " + plan, "%.2e" % max(rel) if rel else "-", len(rel),
          "%.2e" % max(g) if g else "-", len(g),
          "ok" if losses.get("ok") and grads.get("ok") else "DIFFERS"))
EOF
  else
    fig "parity $plan" "not compared (a cuda run did not finish)"
  fi
done

#===------------------------------------------------------------------===#
say "== 5. compute-sanitizer: memcheck, racecheck, synccheck of a step"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
: >"$out/6-sanitizer.txt"
if [ $gpu = 0 ]; then
  say "  memcheck, racecheck, synccheck: need the GPU (skipped here)"
elif [ -z "$sanitizer" ]; then
  say "  compute-sanitizer: not found on the GPU machine (PATH," \
    "/usr/local/cuda/bin); not run"
  fig sanitizer "not found: not run"
  incomplete+=(sanitizer)
else
  for plan in tiny tiny-dsa; do
    verdicts=""
    for tool in memcheck racecheck synccheck; do
      name=sanitizer-$tool-$plan
      step "$name" 8 20 required "$sanitizer" --tool "$tool" \
        --error-exitcode 9 "$exec_" --plan "$plans/$plan.json" \
        --backend cuda --steps 1 --no-progress
      rc=$?
      { echo "### $tool, $plan"; tail -n 20 "$logs/$name.log"; } >>"$out/6-sanitizer.txt"
      # "ERROR SUMMARY: 0 errors", "RACECHECK SUMMARY: 0 hazards displayed
      # (0 errors, 0 warnings)"
      verdict=$(grep -oE '[A-Z]+ SUMMARY: .*' "$logs/$name.log" | tail -n 1 |
        sed 's/^[A-Z]* SUMMARY: //; s/ hazards displayed / hazards /')
      case $rc in
      0) verdicts+="$tool ${verdict:-ok}; " ;;
      2) verdicts+="$tool not run (time); " ;;
      *) verdicts+="$tool FAILED ${verdict}; " ;;
      esac
    done
    fig "sanitizer $plan" "${verdicts%; }"
  done
fi

#===------------------------------------------------------------------===#
say "== 6. 3D-DSA kernels against a float64 reference (105B tiles sampled)"
if [ $gpu = 1 ] && [ $numpy = 1 ]; then
  step dsa 10 35 required "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --check --json "$out/5-dsa.json"
  grep -E 'FAIL|ok' "$logs/dsa.log" | tail -n 8 | tee -a "$summary"
elif [ $gpu = 1 ]; then
  say "  3D-DSA kernels: need python3 with NumPy (not here)"
else
  say "  kernels on the GPU: need the GPU; the sampled reference is self-tested"
  step dsa-self-test 5 30 required "$python" "$root/scripts/dsa_gpu_check.py" \
    --self-test
  step dsa 5 30 required "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --check --json "$out/5-dsa.json"
fi
if [ -f "$out/5-dsa.json" ] && [ -n "$python" ]; then
  "$python" - "$out/5-dsa.json" >>"$figures" 2>&1 <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
parts = []
for c in r.get("configs", []):
    checks = c.get("checks", {})
    worst = max((v["max_err"] / v["atol"] for v in checks.values()
                 if v.get("max_err") is not None and v.get("atol")),
                default=None)
    parts.append("%s %s%s" % (c.get("name"), "ok" if c.get("ok") else "FAIL",
                              "" if worst is None else
                              " (max err %.2f of tol)" % worst))
print("%-24s %s" % ("dsa kernels", "; ".join(parts) if parts else
                   "; ".join(r.get("skipped", [])) or "none checked"))
EOF
fi

#===------------------------------------------------------------------===#
say "== 7. NVRTC compile-everything tests (after the GPU tests)"
step gtest-compile 8 25 required "$tests" \
  --gtest_filter='CudaKernelsTest.*:*CudaTinyPlanTest.*:Nvrtc.*:KernelCache.*'
cat "$logs/gtest-compile.log" >>"$out/3-gtest.log"
say "  $(gtest_line "$logs/gtest-compile.log")"
fig "gtest compile" "$(gtest_line "$logs/gtest-compile.log")"

#===------------------------------------------------------------------===#
say "== 8. calibration: cuda trace against the sim's prediction; pinning"
# Sized to fit what is left (docs/Testing.md, "The device check"): each
# cuda run fills its host state (12 B per trained parameter) and pins its
# pools before the first step; the backend says on stderr how long pinning
# took (docs/Runtime.md, "cuda backend limits and settings").
: >"$out/7-calibration.txt"
# plan, seconds it needs, its limit, cuda steps
for row in "dit-xl-2-256 20 45 3" "wan-1block 30 60 3" "105b-1block 50 90 2"; do
  set -- $row
  plan=$1 need=$2 limit=$3 steps=$4
  step "sim-$plan" 3 30 optional "$exec_" --plan "$plans/$plan.json" \
    --backend sim --steps 1 --no-progress \
    --trace "$logs/sim-$plan.trace.json" || continue
  if [ $gpu = 0 ]; then
    say "  cuda-$plan: needs the GPU (the sim's prediction is in the logs)"
    continue
  fi
  step "cuda-$plan" "$need" "$limit" optional "$exec_" \
    --plan "$plans/$plan.json" --backend cuda --steps "$steps" \
    --no-progress --metrics "$logs/cuda-$plan.jsonl" \
    --trace "$logs/cuda-$plan.trace.json"
  # Pinning, even of a run that went no further.
  pinned=$(sed -n 's/^megaslide: cuda backend: pinned \([0-9]*\) bytes of host memory in \([0-9.]*\) s.*/\1 \2/p' \
    "$logs/cuda-$plan.log" 2>/dev/null | awk '{b += $1; s += $2; n++}
    END{if (n) printf "%.2f GiB in %.2f s (%.1f GiB/s)",
      b / 2^30, s, (s > 0 ? b / 2^30 / s : 0)}')
  [ -n "$pinned" ] && fig "pinning $plan" "$pinned"
  [ -f "$logs/cuda-$plan.trace.json" ] || continue
  {
    echo "### $plan"
    "$python" "$root/scripts/compare_trace_sim.py" \
      "$logs/cuda-$plan.trace.json" "$logs/sim-$plan.trace.json" \
      --json "$logs/calibration-$plan.json"
  } >>"$out/7-calibration.txt" 2>&1
  [ -f "$logs/calibration-$plan.json" ] &&
    "$python" - "$logs/calibration-$plan.json" "$plan" >>"$figures" 2>&1 <<'EOF'
import json, sys
r, plan = json.load(open(sys.argv[1])), sys.argv[2]
step = r["step"]
kinds = sorted((k for k in r["kinds"] if k["ratio"] is not None),
               key=lambda k: -k["measured_s"])[:3]
print("%-24s step %.1f ms measured / %.1f predicted = %s; %s" % (
    "calibration " + plan, step["measured_s"] * 1e3, step["predicted_s"] * 1e3,
    "-" if step["ratio"] is None else "%.2f" % step["ratio"],
    ", ".join("%s %.2f" % (k["kind"], k["ratio"]) for k in kinds)))
EOF
done
grep -q '^pinning' "$figures" || fig pinning "not measured (no cuda calibration run)"

#===------------------------------------------------------------------===#
say "== 9. benchmarks: 3D-DSA and FlexAttention, the diffusers processor"
if [ $gpu = 1 ] && [ $numpy = 1 ]; then
  command -v cc >/dev/null || command -v gcc >/dev/null ||
    say "  no C compiler: torch.compile (FlexAttention) may fail"
  step dsa-bench 30 75 optional "$python" "$root/scripts/dsa_gpu_check.py" \
    "$bundle/dsa-kernels" --bench --flex --json "$logs/dsa-bench.json"
  grep -iE 'ratio|TFLOP|FAIL|skipped' "$logs/dsa-bench.log" | tail -n 8 |
    tee -a "$summary"
  # The diffusers processor's path: offsets and compiled FlexAttention on
  # the GPU against a float64 reference, and its time against SDPA.
  step dsa-processor 30 90 optional "$python" \
    "$root/scripts/dsa_processor_gpu_check.py" --json "$logs/dsa-processor.json"
  grep -E 'ok|FAIL|ratio|skipped' "$logs/dsa-processor.log" | tail -n 5 |
    tee -a "$summary"
  "$python" - "$logs/dsa-bench.json" "$logs/dsa-processor.json" \
    >>"$figures" 2>&1 <<'EOF'
import json, sys
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return {}
for t in load(sys.argv[1]).get("timings", []):
    flex = t.get("flex") or {}
    print("%-24s %s%s" % ("bench " + t["name"], ", ".join(
        "%s %.3f ms" % kv for kv in sorted(t["ms"].items())),
        "; FlexAttention/ours fwd %.2f, fwd+bwd %.2f" % (
            1 / flex["ratio_forward"], 1 / flex["ratio_forward_backward"])
        if "ratio_forward" in flex else ""))
p = load(sys.argv[2]).get("timing")
if p:
    print("%-24s %.2f ms, SDPA %.2f ms (SDPA/processor %.2f)" % (
        "bench processor", p["dsa_ms"], p["sdpa_ms"], p["ratio_sdpa_over_dsa"]))
EOF
else
  say "  need the GPU and NumPy (skipped here)"
fi

#===------------------------------------------------------------------===#
tar -czf "$out/8-logs.tar.gz" -C "$work" logs
if [ $status -ne 0 ]; then
  verdict=FAILED
elif [ ${#incomplete[@]} -gt 0 ]; then
  verdict="INCOMPLETE (${#incomplete[@]} required steps skipped or cut short"
  verdict+=" for time: ${incomplete[*]})"
  status=3
elif [ $gpu = 0 ]; then
  verdict="passed (a dry run: no GPU)"
else
  verdict=passed
fi
{
  echo "== figures"
  cat "$figures"
  echo "== device check: $verdict in $((SECONDS - begin)) s of $budget" \
    "(results in $out)"
} | tee -a "$summary"
exit $status
