#!/usr/bin/env bash
# Builds what scripts/device-check.sh needs on a bare GPU node (no MLIR, no
# LLVM, no network) into one ignored folder, build-bundle/ (or $1), at most
# 48 MiB (docs/Testing.md, "The device check"):
#   bin/          megaslide-exec and megaslide-runtime-tests of the
#                 runtime-only build (glibc, oneDNN and libgomp;
#                 test_runtime_only.py);
#   lib/          oneDNN (xz-compressed: 40 MB as is), its libgomp and
#                 OpenCL loader, which device-check.sh unpacks;
#   plans/        tiny, tiny-dsa (3D-DSA), tiny-f32-accum2 and tiny-f32-job2
#                 (one process and a job of 2 ranks), and for the
#                 calibration, sized so that filling their host memory
#                 fits the check:
#                 dit-xl-2-256 (DiT-XL/2 at 256x256, 10 GiB of host memory),
#                 wan-1block (Wan 2.1 14B cut to 1 block at 81x480x832, 10
#                 GiB) and 105b-1block (megaslide-105b cut to 1 block at
#                 81x720x1280, 57 GiB, a 56 GiB arena), with their configs;
#   reference/    the cpu backend's losses (20 steps) and first-step
#                 gradients of the small plans, deterministic for the seed;
#   dsa-kernels/  the 3D-DSA kernels of the device configurations
#                 (test/Target/Cuda/Inputs/dsa3d_device_configs.mlir) as
#                 sm_90a cubins with their manifest (scripts/dsa_gpu_check.py);
#   kernel-cache/ every plan's kernels and the CUDA unit tests' compiled
#                 by NVRTC for sm_90a: the cuda backend finds them by a
#                 key that includes the NVRTC version, so they are hits
#                 only where NVRTC is the same;
#   manifest.json what is where, sizes, SHA-256, versions.
# --with-llvm-support also carries the LLVM Support headers the runtime
# includes and libLLVMSupport.a/libLLVMDemangle.a (sizes in the manifest),
# so the runtime-only build can be configured on the GPU node itself
# (-DMEGASLIDE_LLVM_ROOT=<bundle>/llvm-support).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
with_llvm=0
if [ "${1:-}" = --with-llvm-support ]; then
  with_llvm=1
  shift
fi
bundle=${1:-$root/build-bundle}
full=${MEGASLIDE_BUILD_DIR:-$root/build}
runtime=${MEGASLIDE_RUNTIME_BUILD:-$root/build-runtime}
limit=$((48 * 1024 * 1024))
start=$SECONDS

"$root/scripts/build.sh"
MEGASLIDE_BUILD_DIR=$runtime "$root/scripts/build.sh" --runtime-only
run=$full/bin/megaslide-run
exec=$runtime/bin/megaslide-exec
translate=$full/bin/megaslide-translate

# Built next to the destination and renamed into place: an interrupted run
# leaves the previous bundle whole.
tmp=$(mktemp -d "$(dirname "$bundle")/.bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"/{bin,lib,plans,reference,kernel-cache}
cp "$exec" "$runtime/bin/megaslide-runtime-tests" "$tmp/bin/"
# oneDNN and what it needs beyond libc and libstdc++ (which any node with
# a CUDA toolkit has).
for lib in libdnnl.so.2 libgomp.so.1 libOpenCL.so.1; do
  path=$(ldd "$exec" | sed -n "s|^\s*$lib => \(\S*\).*|\1|p")
  [ -n "$path" ] || { echo "device bundle: $exec does not load $lib" >&2; exit 1; }
  case $lib in
  libdnnl*) xz -6 -c "$path" >"$tmp/lib/$lib.xz" ;;
  *) cp -L "$path" "$tmp/lib/$lib" ;;
  esac
done
# The plans. Big ones are saved by the sim backend, which holds no state.
python3 - "$root" "$tmp/plans" <<'EOF'
import json, sys
root, out = sys.argv[1], sys.argv[2]
for name, base, layers in [("wan-1block", "wan2.1-t2v-14b", 1),
                           ("105b-1block", "megaslide-105b", 1)]:
    c = json.load(open(f"{root}/configs/{base}.json"))
    c["name"], c["num_layers"] = name, layers
    json.dump(c, open(f"{out}/{name}.config.json", "w"), indent=2)
EOF
for plan in tiny tiny-dsa tiny-f32-accum2 tiny-f32-job2; do
  cp "$full/test/plans/$plan.json" "$tmp/plans/"
done
# quiet CMD...: runs CMD, showing its output only when it fails.
quiet() {
  "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
  rm "$tmp/log"
}
save_plan() { # NAME FLAGS...
  local name=$1
  shift
  quiet "$run" --backend sim --steps 0 --no-progress "$@" \
    --save-plan "$tmp/plans/$name.json"
}
save_plan dit-xl-2-256 --model dit-xl-2 --frames 1 --height 256 --width 256
save_plan wan-1block --model "$tmp/plans/wan-1block.config.json" \
  --frames 81 --height 480 --width 832
save_plan 105b-1block --model "$tmp/plans/105b-1block.config.json" \
  --frames 81 --height 720 --width 1280

# References on the cpu backend (seed 0, synthetic data), from the same
# megaslide-exec that runs on the GPU node.
for plan in tiny tiny-dsa; do
  quiet "$exec" --plan "$tmp/plans/$plan.json" --backend cpu --steps 20 \
    --seed 0 --no-progress --metrics "$tmp/reference/$plan.losses.jsonl"
  quiet "$exec" --plan "$tmp/plans/$plan.json" --backend cpu --steps 1 \
    --seed 0 --no-progress --metrics "$tmp/reference/$plan.step1.jsonl" \
    --save-gradients "$tmp/reference/$plan.gradients.safetensors"
done

# Kernels: the 3D-DSA device configurations, and every plan's modules
# into the cache the cuda backend reads.
quiet "$translate" --emit-dsa-kernels \
  "$root/test/Target/Cuda/Inputs/dsa3d_device_configs.mlir" \
  -o "$tmp/dsa-kernels" --cubin sm_90a
for plan in "$tmp"/plans/*.json; do
  case $plan in *.config.json) continue ;; esac
  MEGASLIDE_KERNEL_CACHE=$tmp/kernel-cache "$exec" --plan "$plan" \
    --precompile-kernels sm_90a >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
done
nvrtc=$(tail -n 1 "$tmp/log" | sed 's/.*(NVRTC \(.*\))$/\1/')
# And the CUDA unit tests' kernels (every dense kernel, the tensor-core
# attention at the 105B shapes: ~90 s of NVRTC on 2 cores), so that the
# device check's gtest step reads them from the cache within its limit.
MEGASLIDE_KERNEL_CACHE=$tmp/kernel-cache "$runtime/bin/megaslide-runtime-tests" \
  --gtest_filter='CudaKernelsTest.*' >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
rm "$tmp/log"

if [ $with_llvm = 1 ]; then
  # Exactly the LLVM headers the runtime-only build included (its ninja
  # dependency log), and the two static libraries.
  llvm_root=$(sed -n 's/^MEGASLIDE_LLVM_ROOT:PATH=//p' "$runtime/CMakeCache.txt")
  mkdir -p "$tmp/llvm-support/lib"
  (cd "$runtime" && ninja -t deps) | python3 -c '
import os, shutil, sys
root, out = sys.argv[1] + "/include", sys.argv[2]
used = {os.path.realpath(l.strip()) for l in sys.stdin if l.startswith(" ")}
for top in ("llvm", "llvm-c"):
    for d, _, names in os.walk(os.path.join(root, top), followlinks=True):
        for n in names:
            p = os.path.join(d, n)
            if os.path.realpath(p) in used:
                rel = os.path.relpath(p, root)
                os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
                shutil.copy(p, os.path.join(out, rel))
' "$llvm_root" "$tmp/llvm-support/include"
  cp "$llvm_root/lib/libLLVMSupport.a" "$llvm_root/lib/libLLVMDemangle.a" \
    "$tmp/llvm-support/lib/"
  # oneDNN's headers, for MEGASLIDE_DNNL_INCLUDE_DIR (docs/Runtime.md).
  dnnl_include=$(sed -n 's/^MEGASLIDE_DNNL_INCLUDE_DIR:PATH=//p' "$runtime/CMakeCache.txt")
  cp -r "$dnnl_include/oneapi" "$tmp/llvm-support/include/"
fi

python3 - "$tmp" "$root" "$nvrtc" <<'EOF'
import hashlib, json, os, platform, subprocess, sys
tmp, root, nvrtc = sys.argv[1:4]
files = {}
for d, _, names in os.walk(tmp):
    for n in sorted(names):
        p = os.path.join(d, n)
        rel = os.path.relpath(p, tmp)
        files[rel] = {"bytes": os.path.getsize(p),
                      "sha256": hashlib.sha256(open(p, "rb").read()).hexdigest()}
plans = {}
for n in sorted(os.listdir(f"{tmp}/plans")):
    if n.endswith(".json") and not n.endswith(".config.json"):
        p = json.load(open(f"{tmp}/plans/{n}"))
        plans[n[:-5]] = {
            "model": os.path.basename(p["model"]), "grid": p["grid"],
            "batch": p["batch"], "instructions": len(p["instructions"]),
            "arena_bytes": p["arena_bytes"],
            "parameters": sum(1 for q in p["params"] if q["role"] == "master"),
            "kernel_modules": len(p["kernel_modules"])}
commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"],
                        capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "-C", root, "status", "--porcelain"],
                       capture_output=True, text=True).stdout != ""
manifest = {
    "format": "megaslide-device-bundle", "version": 1,
    "megaslide_version": json.load(open(f"{tmp}/plans/tiny.json"))["runtime_version"],
    "commit": commit + ("-dirty" if dirty else ""),
    "built_on": f"{platform.node()} glibc {platform.libc_ver()[1]}",
    "nvrtc_version": nvrtc, "kernel_arch": "sm_90a",
    "reference": {"backend": "cpu", "seed": 0, "data": "synthetic",
                  "plans": ["tiny", "tiny-dsa"], "steps": 20,
                  "gradients": "step 1"},
    "plans": plans, "files": files,
    "total_bytes": sum(f["bytes"] for f in files.values())}
json.dump(manifest, open(f"{tmp}/manifest.json", "w"), indent=2)
EOF

bytes=$(du -sb "$tmp" | cut -f1)
if [ "$bytes" -gt $limit ]; then
  echo "device bundle: $bytes bytes, over the 48 MiB that may travel" >&2
  exit 1
fi
rm -rf "$bundle"
mv "$tmp" "$bundle"
trap - EXIT
echo "device bundle: $bundle, $bytes bytes ($((bytes / 1024 / 1024)) MiB of" \
  "48), NVRTC $nvrtc, in $((SECONDS - start)) s"
