//===- AdamW.h - Host AdamW optimizer step ----------------------*- C++ -*-===//
//
// The runtime's host optimizer: one fused AdamW update over an fp32 master
// copy and its moments, applied per layer as gradients arrive. The math is
// exactly that of the graph op megaslide.adamw (dialects/Graph/GraphOps.td).
// No MLIR: the runtime and the Python module call this on host buffers.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_ADAMW_H
#define MEGASLIDE_RUNTIME_CPU_ADAMW_H

#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/plan/HyperParameters.h"

#include <cstdint>
#include <cstring>

namespace megaslide::cpu {

/// Hyper-parameters of one AdamW step (megaslide.adamw's f64 attributes
/// plus its step operand). Double, like the attributes: the per-call
/// coefficients (1 - beta, the bias corrections) are formed in double and
/// each rounded to fp32 once; rounding beta2 = 0.999 to fp32 first would
/// make 1 - beta2 wrong by 1.3e-5 relative.
struct AdamWHyper {
  double lr = exec::kDefaultLr;
  double beta1 = exec::kDefaultBeta1;
  double beta2 = exec::kDefaultBeta2;
  double eps = exec::kDefaultEps;
  double weightDecay = exec::kDefaultWeightDecay;
  int64_t step = 1; ///< 1-based: the first update uses step 1
  /// Multiplies the gradient first (fp32): clipping's factor, or the 1/K
  /// of K accumulated micro-batches. 1 leaves the update bitwise as without.
  float gradScale = 1;
};

/// adamwStep splits its work at multiples of this many elements (one
/// 64-byte line of floats), so no two threads write the same cache line.
inline constexpr int64_t kAdamWChunkAlign = 16;

/// One AdamW update of n parameters, in place, with t = hyper.step:
///   g  = float(grad) * gradScale
///   m  = b1 m + (1 - b1) g
///   v  = b2 v + (1 - b2) g^2
///   p -= lr (wd p + (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps))
/// (decoupled weight decay, as megaslide.adamw). When `workingBf16` is not
/// null it also receives the round-to-nearest-even bf16 of the new master.
/// Single fused pass over contiguous chunks on up to cpuThreads()
/// threads, vectorised for `isa` (lowered to cpuBestIsa() if the CPU lacks
/// it; tests ask for each variant); the result depends on neither: the
/// loop is compiled without FMA contraction, so every variant performs the
/// same IEEE operations in the same order. Requires hyper.step >= 1 and
/// n >= 0; buffers must not overlap.
void adamwStep(const AdamWHyper &hyper, int64_t n, float *master, float *m,
               float *v, const uint16_t *gradBf16, uint16_t *workingBf16,
               CpuIsa isa = cpuIsa());

/// As above with fp32 gradients.
void adamwStep(const AdamWHyper &hyper, int64_t n, float *master, float *m,
               float *v, const float *grad, uint16_t *workingBf16,
               CpuIsa isa = cpuIsa());

/// adamwStep with the moments kept in bf16 (--host-state-policy
/// bf16-moments): m and v widened exactly to fp32, updated as adamwStep
/// updates them, and rounded back to nearest even; the master stays fp32.
/// Elementwise, so the result depends on neither the blocks it works in
/// nor the threads.
void adamwStepBf16Moments(const AdamWHyper &hyper, int64_t n, float *master,
                          uint16_t *m, uint16_t *v, const uint16_t *gradBf16);
void adamwStepBf16Moments(const AdamWHyper &hyper, int64_t n, float *master,
                          uint16_t *m, uint16_t *v, const float *grad);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_ADAMW_H
