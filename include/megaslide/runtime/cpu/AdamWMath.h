//===- AdamWMath.h - The AdamW update of one element ------------*- C++ -*-===//
//
// The one home of megaslide.adamw's arithmetic on the host: the per-call
// coefficients and the moment and master updates of one element, shared
// by the fp32 kernel (AdamW.cpp) and the int8 and factored ones
// (LeanAdamW.cpp). Both files are compiled without FMA contraction
// (runtime/CMakeLists.txt), so every caller performs the same IEEE
// operations in the same order. For runtime/cpu alone.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_ADAMWMATH_H
#define MEGASLIDE_RUNTIME_CPU_ADAMWMATH_H

#include "megaslide/runtime/cpu/AdamW.h"

#include <cassert>
#include <cmath>

namespace megaslide::cpu::detail {

/// Per-call scalars of the update, each formed in double and rounded to
/// fp32 once.
struct Coefficients {
  float beta1, oneMinusBeta1, beta2, oneMinusBeta2;
  float invBiasCorrection1, invBiasCorrection2;
  float lr, eps, weightDecay;
  float gradScale;
};

inline Coefficients makeCoefficients(const AdamWHyper &h) {
  assert(h.step >= 1 && "AdamW step is 1-based");
  double t = static_cast<double>(h.step);
  double bc1 = 1.0 - std::pow(h.beta1, t);
  double bc2 = 1.0 - std::pow(h.beta2, t);
  auto f = [](double x) { return static_cast<float>(x); };
  return {f(h.beta1),       f(1.0 - h.beta1), f(h.beta2), f(1.0 - h.beta2),
          f(1.0 / bc1),     f(1.0 / bc2),     f(h.lr),    f(h.eps),
          f(h.weightDecay), h.gradScale};
}

inline float loadGrad(const float *g, int64_t i) { return g[i]; }
inline float loadGrad(const uint16_t *g, int64_t i) {
  return bf16ToFloat(g[i]);
}

/// m = b1 m + (1 - b1) g.
[[gnu::always_inline]] inline float firstMoment(const Coefficients &c, float m,
                                                float g) {
  return c.beta1 * m + c.oneMinusBeta1 * g;
}

/// v = b2 v + (1 - b2) g^2.
[[gnu::always_inline]] inline float secondMoment(const Coefficients &c, float v,
                                                 float g) {
  return c.beta2 * v + c.oneMinusBeta2 * (g * g);
}

/// p - lr (wd p + m^ / (sqrt(v^) + eps)) from the new moments m and v.
[[gnu::always_inline]] inline float updatedMaster(const Coefficients &c,
                                                  float p, float m, float v) {
  float mHat = m * c.invBiasCorrection1;
  float vHat = v * c.invBiasCorrection2;
  return p - c.lr * (c.weightDecay * p + mHat / (std::sqrt(vHat) + c.eps));
}

} // namespace megaslide::cpu::detail

#endif // MEGASLIDE_RUNTIME_CPU_ADAMWMATH_H
