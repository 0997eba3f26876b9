//===- Gemm.cpp - fp32 GEMM of the CPU kernels ----------------------------===//
//
// oneDNN's sgemm is the library kernel (docs/Benchmarks.md, "CPU GEMM",
// has the measurements that chose it over OpenBLAS and BLIS). It is only
// ever asked for one thread: oneDNN may split the reduction between its
// threads, which would make a sum's order depend on the thread count.
// Parallelism comes from gemm() below instead, which hands fixed tiles of C
// to the project's worker pool; a tile's shape depends only on (m, n), so
// each call, and hence each element's summation order, is the same for any
// MEGASLIDE_NUM_THREADS.
//
// oneDNN picks its own kernels by CPU; MEGASLIDE_CPU_ISA (cpu/Isa.h) caps
// them like the project's loops, so a capped run measures and exercises the
// same level throughout.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/cpu/ParallelFor.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

// oneDNN's Debian build runs its kernels on OpenMP (libgomp); the library
// is linked directly (runtime/CMakeLists.txt), so this call binds to the
// same runtime oneDNN's own calls do. Declared here because clang ships no
// omp.h without libomp.
extern "C" void omp_set_num_threads(int);

using namespace megaslide::cpu;

namespace {

/// Tile of C per pool item: 128 rows keep oneDNN near its large-matrix
/// speed (docs/Benchmarks.md, "CPU GEMM"), and 256 columns give the
/// adaLN projections (a row or two, thousands of columns) several items.
constexpr int64_t kTileRows = 128;
constexpr int64_t kTileCols = 256;
/// Below this many multiply-adds a GEMM is one call on the calling thread:
/// handing it to the pool would cost a noticeable share of it.
constexpr int64_t kParallelMacs = 1 << 20;

[[noreturn]] void fatal(const char *what) {
  std::fprintf(stderr, "megaslide: %s\n", what);
  std::abort();
}

/// Holds oneDNN to cpuIsa(), once per process and before its first kernel
/// (afterwards it can no longer change). Generic caps at SSE4.1, oneDNN's
/// lowest JIT level.
void capIsa() {
  static const bool capped = [] {
    CpuIsa isa = cpuIsa();
    if (isa == CpuIsa::Avx512)
      return true;
    if (dnnl_set_max_cpu_isa(isa == CpuIsa::Avx2
                                 ? dnnl_cpu_isa_avx2
                                 : dnnl_cpu_isa_sse41) != dnnl_success)
      fatal("oneDNN refused the instruction-set cap of MEGASLIDE_CPU_ISA");
    return true;
  }();
  (void)capped;
}

/// Makes oneDNN run single-threaded when called from this thread. OpenMP's
/// thread count is a per-thread setting, so every pool worker (and any
/// caller) sets it once.
void useOneThread() {
  thread_local bool done = false;
  if (done)
    return;
  static const unsigned runtime = dnnl_version()->cpu_runtime;
  if (runtime == DNNL_RUNTIME_OMP)
    omp_set_num_threads(1);
  else if (runtime != DNNL_RUNTIME_SEQ)
    fatal("oneDNN was built with a threading runtime other than OpenMP or "
          "sequential; its thread count cannot be held at one per call");
  done = true;
}

} // namespace

void megaslide::cpu::gemmSerial(int64_t m, int64_t n, int64_t k, float alpha,
                                GemmOperand a, GemmOperand b, float beta,
                                float *c, int64_t ldc) {
  if (m <= 0 || n <= 0)
    return;
  if (k <= 0) {
    // No products: C = beta C, with beta = 0 overwriting whatever C held.
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  capIsa();
  useOneThread();
  AsyncSignalsHeld held; // oneDNN moves the stack pointer (WorkerPool.h)
  dnnl_status_t status = dnnl_sgemm(
      a.transposed ? 'T' : 'N', b.transposed ? 'T' : 'N', m, n, k, alpha,
      a.data, a.ld, b.data, b.ld, beta, c, ldc);
  if (status != dnnl_success)
    fatal("oneDNN sgemm rejected its arguments (a caller's shape check is "
          "missing)");
}

void megaslide::cpu::gemm(int64_t m, int64_t n, int64_t k, float alpha,
                          GemmOperand a, GemmOperand b, float beta, float *c,
                          int64_t ldc) {
  if (m <= 0 || n <= 0)
    return;
  if (m * n * std::max<int64_t>(k, 1) < kParallelMacs) {
    gemmSerial(m, n, k, alpha, a, b, beta, c, ldc);
    return;
  }
  const int64_t rowTiles = (m + kTileRows - 1) / kTileRows;
  const int64_t colTiles = (n + kTileCols - 1) / kTileCols;
  // Row i of op(A) and column j of op(B), whichever way they are stored.
  auto rowsOf = [](GemmOperand x, int64_t i) {
    return GemmOperand{x.transposed ? x.data + i : x.data + i * x.ld, x.ld,
                       x.transposed};
  };
  auto colsOf = [](GemmOperand x, int64_t j) {
    return GemmOperand{x.transposed ? x.data + j * x.ld : x.data + j, x.ld,
                       x.transposed};
  };
  parallelFor(rowTiles * colTiles, [&] {
    return [&](int64_t tile) {
      int64_t i0 = tile / colTiles * kTileRows, j0 = tile % colTiles * kTileCols;
      gemmSerial(std::min(kTileRows, m - i0), std::min(kTileCols, n - j0), k,
                 alpha, rowsOf(a, i0), colsOf(b, j0), beta, c + i0 * ldc + j0,
                 ldc);
    };
  });
}

const char *megaslide::cpu::gemmIsaName() {
  capIsa();
  switch (dnnl_get_effective_cpu_isa()) {
  case dnnl_cpu_isa_sse41:
    return "sse41";
  case dnnl_cpu_isa_avx:
    return "avx";
  case dnnl_cpu_isa_avx2:
    return "avx2";
  case dnnl_cpu_isa_avx2_vnni:
    return "avx2_vnni";
  case dnnl_cpu_isa_avx512_core:
    return "avx512_core";
  case dnnl_cpu_isa_avx512_core_vnni:
    return "avx512_core_vnni";
  case dnnl_cpu_isa_avx512_core_bf16:
    return "avx512_core_bf16";
  case dnnl_cpu_isa_avx512_core_amx:
    return "avx512_core_amx";
  default:
    return "other";
  }
}
