#!/usr/bin/env bash
# Single-threaded sgemm of the BLAS libraries Debian 12 packages, on the
# cpu backend's GEMM shapes (benchmarks/cpu_gemm.cpp), side by side in
# interleaved rounds; medians of the rounds, GFLOP/s (docs/Benchmarks.md,
# "CPU GEMM"). oneDNN is a build dependency; the others are measured when
# installed: apt-get install libopenblas-serial-dev libblis-serial-dev.
# OpenBLAS runs twice, with the kernel it detects and with
# OPENBLAS_CORETYPE=SkylakeX, since 0.3.21 maps CPUs it does not know to
# older kernels.
# Usage: benchmarks/cpu_gemm.sh [ROUNDS] (default 5).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rounds=${1:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
multiarch=$(gcc -print-multiarch)
libs=()
g++ -O2 -DUSE_DNNL "$here/cpu_gemm.cpp" -o "$tmp/onednn" -ldnnl -fopenmp
libs+=(onednn)
ob=/usr/lib/$multiarch/openblas-serial
if [ -f "$ob/libopenblas.so" ]; then
  g++ -O2 -I"/usr/include/$multiarch/openblas-serial" "$here/cpu_gemm.cpp" \
    -o "$tmp/openblas" "$ob/libopenblas.so" -Wl,-rpath,"$ob"
  ln -s openblas "$tmp/openblas-skylakex"
  libs+=(openblas openblas-skylakex)
fi
blis=/usr/lib/$multiarch/blis-serial
if [ -f "$blis/libblis.so" ]; then
  g++ -O2 -I"/usr/include/$multiarch/blis-serial" "$here/cpu_gemm.cpp" \
    -o "$tmp/blis" "$blis/libblis.so" -Wl,-rpath,"$blis"
  libs+=(blis)
fi
for ((r = 0; r < rounds; r++)); do
  for lib in "${libs[@]}"; do
    case $lib in
    openblas-skylakex) OPENBLAS_CORETYPE=SkylakeX "$tmp/$lib" ;;
    *) OMP_NUM_THREADS=1 "$tmp/$lib" ;;
    esac >"$tmp/$lib.$r"
  done
done
OPENBLAS_VERBOSE=2 "$tmp/openblas" 2>&1 >/dev/null | sed -n 's/^Core: /OpenBLAS detected core: /p' || true
python3 - "$tmp" "$rounds" "${libs[@]}" <<'PY'
import statistics, sys
tmp, rounds, libs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
for lib in libs:
    for r in range(rounds):
        for line in open(f"{tmp}/{lib}.{r}"):
            what, m, n, k, g = line.rstrip("\n").split("\t")
            rows.setdefault((what, m, n, k), {}).setdefault(lib, []).append(float(g))
print(f"single-threaded sgemm, GFLOP/s, median of {rounds} interleaved rounds")
print(f"{'shape':24} {'m x n x k':>16} " + " ".join(f"{l:>17}" for l in libs))
for (what, m, n, k), per in rows.items():
    print(f"{what:24} {m + 'x' + n + 'x' + k:>16} " +
          " ".join(f"{statistics.median(per[l]):17.1f}" for l in libs))
PY
