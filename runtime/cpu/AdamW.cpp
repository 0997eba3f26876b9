//===- AdamW.cpp - Host AdamW optimizer step ------------------------------===//
//
// The update is memory bound (five to seven streams, ~10 flops per element),
// so it is one fused pass: each thread owns a contiguous, cache-line aligned
// chunk and runs a branch-free loop that the compiler vectorises. The bias
// corrections are scalars computed once per call in double precision. The
// test (test/unit/AdamWTest.cpp) compares against a naive double-precision
// reference.
//
//===----------------------------------------------------------------------===//

#include "cpu/AdamW.h"
#include "cpu/Dsa3d.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <thread>
#include <vector>

using namespace megaslide::cpu;

namespace {

/// Below this many elements per thread, spawning threads costs more than
/// it saves.
constexpr int64_t kMinChunk = 1 << 15;
/// Chunk boundaries are multiples of this (one 64-byte line of floats).
constexpr int64_t kChunkAlign = 16;

/// Per-call scalars of the update.
struct Coefficients {
  float beta1, oneMinusBeta1, beta2, oneMinusBeta2;
  float invBiasCorrection1, invBiasCorrection2;
  float lr, eps, weightDecay;
};

Coefficients makeCoefficients(const AdamWHyper &h) {
  assert(h.step >= 1 && "AdamW step is 1-based");
  double t = static_cast<double>(h.step);
  double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  return {h.beta1,
          1.0f - h.beta1,
          h.beta2,
          1.0f - h.beta2,
          static_cast<float>(1.0 / bc1),
          static_cast<float>(1.0 / bc2),
          h.lr,
          h.eps,
          h.weightDecay};
}

inline float loadGrad(const float *g, int64_t i) { return g[i]; }
inline float loadGrad(const uint16_t *g, int64_t i) {
  return bf16ToFloat(g[i]);
}

/// The update of elements [begin, end). `WriteWorking` lifts the null test
/// on the working copy out of the loop.
template <bool WriteWorking, typename Grad>
void updateChunk(const Coefficients &c, int64_t begin, int64_t end,
                 float *__restrict master, float *__restrict m,
                 float *__restrict v, const Grad *__restrict grad,
                 uint16_t *__restrict working) {
  for (int64_t i = begin; i < end; ++i) {
    float g = loadGrad(grad, i);
    float mi = c.beta1 * m[i] + c.oneMinusBeta1 * g;
    float vi = c.beta2 * v[i] + c.oneMinusBeta2 * (g * g);
    float p = master[i];
    float mHat = mi * c.invBiasCorrection1;
    float vHat = vi * c.invBiasCorrection2;
    p -= c.lr * (c.weightDecay * p + mHat / (std::sqrt(vHat) + c.eps));
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if constexpr (WriteWorking)
      working[i] = floatToBf16(p);
  }
}

template <typename Grad>
void adamwStepImpl(const AdamWHyper &hyper, int64_t n, float *master, float *m,
                   float *v, const Grad *grad, uint16_t *working) {
  if (n <= 0)
    return;
  Coefficients c = makeCoefficients(hyper);
  auto run = [&](int64_t begin, int64_t end) {
    if (working)
      updateChunk<true>(c, begin, end, master, m, v, grad, working);
    else
      updateChunk<false>(c, begin, end, master, m, v, grad, working);
  };

  int64_t numThreads = std::clamp<int64_t>(n / kMinChunk, 1, dsa3dNumThreads());
  if (numThreads == 1) {
    run(0, n);
    return;
  }
  int64_t chunk = (n + numThreads - 1) / numThreads;
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  std::vector<std::thread> threads;
  threads.reserve(numThreads - 1);
  for (int64_t begin = chunk; begin < n; begin += chunk)
    threads.emplace_back(run, begin, std::min(n, begin + chunk));
  run(0, std::min(n, chunk));
  for (std::thread &t : threads)
    t.join();
}

} // namespace

void megaslide::cpu::adamwStep(const AdamWHyper &hyper, int64_t n,
                               float *master, float *m, float *v,
                               const uint16_t *gradBf16,
                               uint16_t *workingBf16) {
  adamwStepImpl(hyper, n, master, m, v, gradBf16, workingBf16);
}

void megaslide::cpu::adamwStep(const AdamWHyper &hyper, int64_t n,
                               float *master, float *m, float *v,
                               const float *grad, uint16_t *workingBf16) {
  adamwStepImpl(hyper, n, master, m, v, grad, workingBf16);
}
