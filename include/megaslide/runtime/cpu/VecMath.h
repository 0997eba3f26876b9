//===- VecMath.h - Vectorised math of the CPU kernels -----------*- C++ -*-===//
//
// The cpu kernels' transcendental and row-wise loops, compiled once per
// instruction set (cpu/Isa.h) from one source (runtime/cpu/VecKernels.inc)
// and picked at run time: exp and tanh, GELU and SiLU with their
// derivatives, the row statistics and updates of layer and RMS norm, RoPE's
// rotation, and the two halves of a softmax row.
//
// Each loop works on vectors one register wide (4, 8 or 16 floats; the
// double sums at half that), and a partial last vector is padded rather
// than run through scalar code: an element's result depends only on its
// inputs, never on where a caller's chunk boundary falls, and every sum
// keeps one partial sum per lane combined in one fixed tree, so it depends
// on the length alone. Results are therefore bit-identical across thread
// counts on one machine; across instruction sets they differ in the last
// bits (FMA, and the lane count of the sums), within the bounds below.
//
// Accuracy, in ulp of the fp32 result against a double reference, over
// all 2^32 fp32 inputs (docs/Runtime.md, "Vector math"): exp within 1.5 ulp
// (1.01 measured on every variant), subnormal results included, +inf
// wherever the rounded exp(x) overflows, exp(-inf) = 0; tanh within 2 ulp
// (1.33 measured), tanh(±inf) = ±1, ±0 and subnormals kept. NaN gives NaN.
// test/unit/runtime/cpu/VecMathTest.cpp checks the bounds for every
// variant the CPU runs.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_VECMATH_H
#define MEGASLIDE_RUNTIME_CPU_VECMATH_H

#include "megaslide/runtime/cpu/Isa.h"

#include <cstdint>

namespace megaslide::cpu {

/// One instruction set's copy of the loops. Lengths are >= 0; an output
/// may alias its first input.
struct VecKernels {
  /// y = exp(x), y = tanh(x).
  void (*exp)(const float *x, float *y, int64_t n);
  void (*tanh)(const float *x, float *y, int64_t n);
  /// GELU, tanh form: y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
  /// and dx = dy GELU'(x) (0 where sech^2 underflows, even for x^3 = inf).
  void (*gelu)(const float *x, float *y, int64_t n);
  void (*geluGrad)(const float *x, const float *dy, float *dx, int64_t n);
  /// SiLU y = x sigmoid(x) and dx = dy s (1 + x (1 - s)).
  void (*silu)(const float *x, float *y, int64_t n);
  void (*siluGrad)(const float *x, const float *dy, float *dx, int64_t n);

  /// max of x[0, n) (-inf for n = 0; NaNs are passed over).
  float (*maxOf)(const float *x, int64_t n);
  /// x[i] = exp(x[i] - shift); returns their sum (fp32, one partial sum per
  /// lane).
  float (*expSubAndSum)(float *x, int64_t n, float shift);

  /// Mean and 1/sqrt(var + eps) of a row, accumulated in double (two
  /// passes, so a large mean does not cancel the variance), rounded to fp32.
  void (*meanRstd)(const float *x, int64_t d, float eps, float *mean,
                   float *rstd);
  /// 1/sqrt(mean(x^2) + eps) of a row, accumulated in double.
  float (*rmsRstd)(const float *x, int64_t d, float eps);
  /// y = (x - mean) rstd, then * gamma when given, then + beta when given
  /// (beta only with gamma).
  void (*normApply)(const float *x, int64_t d, float mean, float rstd,
                    const float *gamma, const float *beta, float *y);
  /// A norm's input gradient with g = dy (* gamma when given) and xhat =
  /// (x - mean) rstd: dx = rstd (g - mean(g) - xhat mean(g xhat)), where
  /// the mean(g) term is dropped unless `centered` (RMS norm passes mean 0
  /// and false). The means accumulate in double.
  void (*normGrad)(const float *x, const float *dy, const float *gamma,
                   int64_t d, float mean, float rstd, bool centered, float *dx);
  /// One row's terms of the affine gradients: dgamma += dy xhat and, when
  /// given, dbeta += dy, in double.
  void (*normParamGrad)(const float *x, const float *dy, int64_t d, float mean,
                        float rstd, double *dgamma, double *dbeta);

  /// RoPE on one row of interleaved pairs (n even): out = x cosines +
  /// swap(x) sines, where swap exchanges each pair's elements, `cosines`
  /// holds each pair's cosine twice and `sines` its sine as (-sin, sin).
  void (*rotatePairs)(const float *x, const float *cosines, const float *sines,
                      float *out, int64_t n);
};

/// The loops compiled for `isa`; one the CPU lacks must not be called.
const VecKernels &vecKernels(CpuIsa isa);

/// The loops for cpuIsa().
inline const VecKernels &vecKernels() { return vecKernels(cpuIsa()); }

/// Softmax building blocks at cpuIsa(): the row's max, then
/// x[i] = exp(x[i] - shift) and their sum, each a function of n alone.
inline float maxOf(const float *x, int64_t n) {
  return vecKernels().maxOf(x, n);
}
inline float expSubAndSum(float *x, int64_t n, float shift) {
  return vecKernels().expSubAndSum(x, n, shift);
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_VECMATH_H
