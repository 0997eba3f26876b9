//===- Gemm.h - fp32 GEMM of the CPU kernels --------------------*- C++ -*-===//
//
// One GEMM for every CPU kernel (the dense ops, global attention, 3D-DSA):
// oneDNN's sgemm, always called single-threaded, on tiles of C whose shape
// depends only on the problem shape. Each element of C is then summed by
// one call in an order fixed by (m, n, k, transposes) and the instruction
// set oneDNN runs on this CPU: bitwise the same at any thread count, though
// not across instruction sets (docs/Runtime.md, "Determinism").
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_GEMM_H
#define MEGASLIDE_RUNTIME_CPU_GEMM_H

#include <cstdint>

namespace megaslide::cpu {

/// A row-major operand: op(X)(i, j) is data[i * ld + j], or data[j * ld + i]
/// when `transposed`.
struct GemmOperand {
  const float *data;
  int64_t ld;
  bool transposed = false;
};

/// C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C (row stride ldc) on the
/// calling thread. beta = 0 ignores what C held (NaN included). For kernels
/// that already run one item per worker.
void gemmSerial(int64_t m, int64_t n, int64_t k, float alpha, GemmOperand a,
                GemmOperand b, float beta, float *c, int64_t ldc);

/// The same, split into fixed tiles of C run on the worker pool (small
/// products stay on the calling thread). The result equals gemmSerial's on
/// each tile, whatever the thread count.
void gemm(int64_t m, int64_t n, int64_t k, float alpha, GemmOperand a,
          GemmOperand b, float beta, float *c, int64_t ldc);

/// The instruction set oneDNN's kernels use here ("avx512_core", "avx2",
/// ...), for benchmark and report lines.
const char *gemmIsaName();

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_GEMM_H
