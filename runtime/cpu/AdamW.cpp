//===- AdamW.cpp - Host AdamW optimizer step ------------------------------===//
//
// The update is memory bound (five to seven streams, ~10 flops per element),
// so it is one fused pass: each thread owns a contiguous, cache-line aligned
// chunk and runs a branch-free loop that the compiler vectorises. The bias
// corrections and 1 - beta are scalars computed once per call in double
// precision from the double hyper-parameters, then rounded to fp32. The
// test (test/unit/runtime/cpu/AdamWTest.cpp) compares against a naive
// double-precision reference.
//
// The loop is compiled three times on x86-64 -- AVX-512, AVX2 and the
// baseline (SSE2) -- and picked at run time (cpu/Isa.h), because the build has
// no -march and at baseline width the compute (sqrt, divide, and above all the
// bf16 widening, rounding and narrowing) did not hide behind memory: the
// working copy cost the SSE2 loop a third of its speed at 64M parameters.
// This file is compiled with -ffp-contract=off (runtime/CMakeLists.txt):
// every variant then performs the same correctly rounded IEEE operations in
// the same order, so results are bitwise equal across instruction sets,
// thread counts and chunkings (the test checks both).
//
// benchmarks/host_adamw.py measures the step against torch.optim.AdamW and
// the memory-bandwidth bound (docs/Benchmarks.md, "Host AdamW"). Tried and
// not kept, for lack of a measurable gain on the benchmark machine:
// non-temporal stores for the working copy (the only write-only stream),
// both through an L1 block (slower) and directly from an AVX-512 loop
// (within noise).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/cpu/AdamWMath.h"
#include "megaslide/runtime/cpu/ParallelFor.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

using namespace megaslide::cpu;

namespace {

/// Below this many elements per thread, handing work to the pool's threads
/// costs more than it saves.
constexpr int64_t kMinChunk = 1 << 15;

using detail::Coefficients;
using detail::loadGrad;
using detail::makeCoefficients;

/// The update of elements [begin, end). `WriteWorking` lifts the null test
/// on the working copy out of the loop, `Scale` the multiply by a gradient
/// scale of 1 (bitwise the same, and the common case). Always inlined, so that
/// each instruction-set wrapper below vectorises its own copy.
template <bool WriteWorking, bool Scale, typename Grad>
[[gnu::always_inline]] inline void
updateLoop(const Coefficients &c, int64_t begin, int64_t end,
           float *__restrict master, float *__restrict m, float *__restrict v,
           const Grad *__restrict grad, uint16_t *__restrict working) {
  for (int64_t i = begin; i < end; ++i) {
    float g = loadGrad(grad, i);
    if constexpr (Scale)
      g *= c.gradScale;
    float mi = detail::firstMoment(c, m[i], g);
    float vi = detail::secondMoment(c, v[i], g);
    float p = detail::updatedMaster(c, master[i], mi, vi);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if constexpr (WriteWorking)
      working[i] = floatToBf16(p);
  }
}

using ChunkFn = void (*)(const Coefficients &, int64_t, int64_t, float *,
                         float *, float *, const void *, uint16_t *);

template <bool WriteWorking, bool Scale, typename Grad>
void updateGeneric(const Coefficients &c, int64_t begin, int64_t end,
                   float *master, float *m, float *v, const void *grad,
                   uint16_t *working) {
  updateLoop<WriteWorking, Scale>(c, begin, end, master, m, v,
                                  static_cast<const Grad *>(grad), working);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGASLIDE_ADAMW_X86 1
#if defined(__clang__)
#define MEGASLIDE_TARGET_AVX512                                                \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#else
// GCC's generic tuning would split AVX-512 loops into 256-bit halves.
#define MEGASLIDE_TARGET_AVX512                                                \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,"                  \
                        "prefer-vector-width=512")))
#endif

template <bool WriteWorking, bool Scale, typename Grad>
__attribute__((target("avx2"))) void
updateAvx2(const Coefficients &c, int64_t begin, int64_t end, float *master,
           float *m, float *v, const void *grad, uint16_t *working) {
  updateLoop<WriteWorking, Scale>(c, begin, end, master, m, v,
                                  static_cast<const Grad *>(grad), working);
}

template <bool WriteWorking, bool Scale, typename Grad>
MEGASLIDE_TARGET_AVX512 void
updateAvx512(const Coefficients &c, int64_t begin, int64_t end, float *master,
             float *m, float *v, const void *grad, uint16_t *working) {
  updateLoop<WriteWorking, Scale>(c, begin, end, master, m, v,
                                  static_cast<const Grad *>(grad), working);
}
#endif

/// The loop for `isa` (already resolved and supported).
template <bool WriteWorking, bool Scale, typename Grad>
ChunkFn chunkFn(CpuIsa isa) {
#ifdef MEGASLIDE_ADAMW_X86
  if (isa == CpuIsa::Avx512)
    return &updateAvx512<WriteWorking, Scale, Grad>;
  if (isa == CpuIsa::Avx2)
    return &updateAvx2<WriteWorking, Scale, Grad>;
#endif
  return &updateGeneric<WriteWorking, Scale, Grad>;
}

template <typename Grad> ChunkFn chunkFn(CpuIsa isa, bool working, bool scale) {
  if (working)
    return scale ? chunkFn<true, true, Grad>(isa)
                 : chunkFn<true, false, Grad>(isa);
  return scale ? chunkFn<false, true, Grad>(isa)
               : chunkFn<false, false, Grad>(isa);
}

template <typename Grad>
void adamwStepImpl(const AdamWHyper &hyper, int64_t n, float *master, float *m,
                   float *v, const Grad *grad, uint16_t *working, CpuIsa isa) {
  if (n <= 0)
    return;
  Coefficients c = makeCoefficients(hyper);
  // The enumerators are ordered by width.
  if (static_cast<int>(isa) > static_cast<int>(cpuBestIsa()))
    isa = cpuBestIsa();
  ChunkFn fn = chunkFn<Grad>(isa, working, hyper.gradScale != 1.0f);
  int64_t numThreads = std::clamp<int64_t>(n / kMinChunk, 1, cpuThreads());
  parallelChunks(n, numThreads, kAdamWChunkAlign,
                 [&](int64_t begin, int64_t end) {
                   fn(c, begin, end, master, m, v, grad, working);
                 });
}

} // namespace

void megaslide::cpu::adamwStep(const AdamWHyper &hyper, int64_t n,
                               float *master, float *m, float *v,
                               const uint16_t *gradBf16, uint16_t *workingBf16,
                               CpuIsa isa) {
  adamwStepImpl(hyper, n, master, m, v, gradBf16, workingBf16, isa);
}

void megaslide::cpu::adamwStep(const AdamWHyper &hyper, int64_t n,
                               float *master, float *m, float *v,
                               const float *grad, uint16_t *workingBf16,
                               CpuIsa isa) {
  adamwStepImpl(hyper, n, master, m, v, grad, workingBf16, isa);
}

namespace {
/// Blocks of fp32 moments widened from bf16: 2 x 4 MiB at a time.
template <typename Grad>
void bf16MomentsImpl(const AdamWHyper &hyper, int64_t n, float *master,
                     uint16_t *m, uint16_t *v, const Grad *grad) {
  constexpr int64_t kBlock = int64_t(1) << 20;
  std::vector<float> wideM(std::min(n, kBlock)), wideV(wideM.size());
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    int64_t count = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < count; ++i) {
      wideM[i] = bf16ToFloat(m[begin + i]);
      wideV[i] = bf16ToFloat(v[begin + i]);
    }
    adamwStepImpl(hyper, count, master + begin, wideM.data(), wideV.data(),
                  grad + begin, nullptr, cpuIsa());
    for (int64_t i = 0; i < count; ++i) {
      m[begin + i] = floatToBf16(wideM[i]);
      v[begin + i] = floatToBf16(wideV[i]);
    }
  }
}
} // namespace

void megaslide::cpu::adamwStepBf16Moments(const AdamWHyper &hyper, int64_t n,
                                          float *master, uint16_t *m,
                                          uint16_t *v,
                                          const uint16_t *gradBf16) {
  bf16MomentsImpl(hyper, n, master, m, v, gradBf16);
}

void megaslide::cpu::adamwStepBf16Moments(const AdamWHyper &hyper, int64_t n,
                                          float *master, uint16_t *m,
                                          uint16_t *v, const float *grad) {
  bf16MomentsImpl(hyper, n, master, m, v, grad);
}
