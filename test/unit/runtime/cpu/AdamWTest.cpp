//===- AdamWTest.cpp - Host AdamW step against a naive reference ----------===//
//
// adamwStep (runtime/cpu/AdamW.cpp) over steps t = 1..5 on fixed-seed random
// data, against a reference written here from megaslide.adamw's definition
// (dialects/Graph/GraphOps.td) in double precision. Covered: bf16 and fp32
// gradients, weight decay 0 and > 0, n = 0 and 1, sizes that are not
// multiples of the vector width or of the thread chunk, the bf16 working
// copy (round-to-nearest-even, checked on hand values and ties against an
// independent rounding), thread-count independence, equality across the
// instruction sets the loop is compiled for (AVX-512, AVX2, SSE2) and
// between one large call and the same update in small calls.
//
// Tolerances (the kernel computes in fp32 with per-call coefficients
// rounded to fp32, the reference in double with the same double
// hyper-parameters):
//   master, m, v:  |got - ref| <= 1e-7 + 1e-6 |ref|
//   working bf16:  exactly the round-to-nearest-even bf16 of the kernel's
//                  new fp32 master, and within half a bf16 ulp
//                  (2^-8 |ref| + 1e-7) of the reference master
//   1 vs 4 threads: bitwise identical
//   each instruction set the CPU has vs the generic loop: bitwise identical
//   one large call vs the same update in small calls: bitwise identical
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/Testing/ScopedThreads.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace megaslide::cpu;

namespace {

uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float fromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

/// Round-to-nearest-even to bf16 by comparing the two neighbouring bf16
/// values in double (independent of the kernel's bit trick). Finite inputs
/// only; overflow past the largest bf16 gives infinity.
uint16_t referenceBf16(float f) {
  uint32_t bits = bitsOf(f);
  uint16_t lo = static_cast<uint16_t>(bits >> 16);
  if ((bits & 0xFFFFu) == 0)
    return lo;
  uint16_t hi = static_cast<uint16_t>(lo + 1); // next magnitude up
  double x = std::fabs(static_cast<double>(f));
  double dLo = x - std::fabs(static_cast<double>(bf16ToFloat(lo)));
  // The magnitude above the largest finite bf16 is 2^128 (rounds to inf).
  double hiMag = (hi & 0x7FFFu) == 0x7F80u
                     ? std::ldexp(1.0, 128)
                     : std::fabs(static_cast<double>(bf16ToFloat(hi)));
  double dHi = hiMag - x;
  if (dLo < dHi)
    return lo;
  if (dHi < dLo)
    return hi;
  return (lo & 1u) ? hi : lo;
}

/// Optimizer state of n parameters in fp32 (kernel) and double (reference).
struct State {
  std::vector<float> master, m, v;
  std::vector<uint16_t> working;
  std::vector<double> refMaster, refM, refV;

  State(int64_t n, std::mt19937 &rng) {
    std::uniform_real_distribution<float> param(-1.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i)
      master.push_back(param(rng));
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    working.assign(n, 0xFFFFu);
    refMaster.assign(master.begin(), master.end());
    refM.assign(n, 0.0);
    refV.assign(n, 0.0);
  }
};

/// megaslide.adamw in double from its definition; `grad` already holds the
/// fp32 values of the gradient.
void referenceStep(const AdamWHyper &h, State &s,
                   const std::vector<float> &grad) {
  double b1 = h.beta1, b2 = h.beta2, lr = h.lr, eps = h.eps, wd = h.weightDecay,
         t = static_cast<double>(h.step);
  for (size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i];
    s.refM[i] = b1 * s.refM[i] + (1 - b1) * g;
    s.refV[i] = b2 * s.refV[i] + (1 - b2) * g * g;
    double mHat = s.refM[i] / (1 - std::pow(b1, t));
    double vHat = s.refV[i] / (1 - std::pow(b2, t));
    double p = s.refMaster[i];
    s.refMaster[i] = p - lr * (wd * p + mHat / (std::sqrt(vHat) + eps));
  }
}

void expectClose(const std::vector<float> &got, const std::vector<double> &ref,
                 const char *what, int64_t step) {
  for (size_t i = 0; i < got.size(); ++i) {
    double tol = 1e-7 + 1e-6 * std::fabs(ref[i]);
    ASSERT_LE(std::fabs(got[i] - ref[i]), tol)
        << what << "[" << i << "] at step " << step << " of n = " << got.size();
  }
}

/// Runs steps 1..5 with fresh random gradients each step and checks every
/// step against the reference.
void runSteps(int64_t n, float weightDecay, bool bf16Grad, bool withWorking,
              uint32_t seed) {
  SCOPED_TRACE("n = " + std::to_string(n) + ", wd = " +
               std::to_string(weightDecay) + (bf16Grad ? ", bf16" : ", f32") +
               (withWorking ? " grads, working copy" : " grads"));
  std::mt19937 rng(seed);
  State s(n, rng);
  std::uniform_real_distribution<float> gradDist(-2.0f, 2.0f);
  AdamWHyper h;
  h.lr = 1e-2;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weightDecay = weightDecay;
  for (int64_t t = 1; t <= 5; ++t) {
    h.step = t;
    std::vector<float> grad(n);
    std::vector<uint16_t> gradBf16(n);
    for (int64_t i = 0; i < n; ++i) {
      gradBf16[i] = referenceBf16(gradDist(rng));
      grad[i] = bf16Grad ? bf16ToFloat(gradBf16[i]) : gradDist(rng);
    }
    uint16_t *working = withWorking ? s.working.data() : nullptr;
    if (bf16Grad)
      adamwStep(h, n, s.master.data(), s.m.data(), s.v.data(), gradBf16.data(),
                working);
    else
      adamwStep(h, n, s.master.data(), s.m.data(), s.v.data(), grad.data(),
                working);
    referenceStep(h, s, grad);
    expectClose(s.m, s.refM, "m", t);
    expectClose(s.v, s.refV, "v", t);
    expectClose(s.master, s.refMaster, "master", t);
    for (int64_t i = 0; i < n; ++i) {
      if (!withWorking) {
        ASSERT_EQ(s.working[i], 0xFFFFu) << "working copy written at " << i;
        continue;
      }
      ASSERT_EQ(s.working[i], referenceBf16(s.master[i]))
          << "working[" << i << "] at step " << t;
      double ref = s.refMaster[i];
      ASSERT_LE(std::fabs(bf16ToFloat(s.working[i]) - ref),
                std::ldexp(std::fabs(ref), -8) + 1e-7)
          << "working[" << i << "] at step " << t;
    }
  }
}

//===----------------------------------------------------------------------===//
// Tests
//===----------------------------------------------------------------------===//

TEST(AdamWBf16, HandValuesRoundToNearestEven) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80u}, // 1.0, exact
      {0x3F808000u, 0x3F80u}, // 1 + 2^-8: tie, lower is even
      {0x3F818000u, 0x3F82u}, // 1 + 3 * 2^-8: tie, upper is even
      {0x3F808001u, 0x3F81u}, // just above the tie
      {0x3F807FFFu, 0x3F80u}, // just below the tie
      {0xBF818000u, 0xBF82u}, // negative tie rounds away (to even)
      {0xBFC00000u, 0xBFC0u}, // -1.5, exact
      {0x80000000u, 0x8000u}, // -0
      {0x00008000u, 0x0000u}, // subnormal tie to even zero
      {0x00018000u, 0x0002u}, // subnormal tie to even
      {0x7F7FFFFFu, 0x7F80u}, // largest float overflows to inf
      {0x7F7F7FFFu, 0x7F7Fu}, // largest bf16 stays finite
      {0x7F800000u, 0x7F80u}, // inf
      {0xFF800000u, 0xFF80u}, // -inf
  };
  for (const Case &c : cases) {
    EXPECT_EQ(floatToBf16(fromBits(c.in)), c.out) << std::hex << c.in;
    if ((c.in & 0x7F800000u) != 0x7F800000u) { // referenceBf16: finite only
      EXPECT_EQ(referenceBf16(fromBits(c.in)), c.out) << std::hex << c.in;
    }
  }
  // NaNs stay NaNs, including those whose payload sits in the low bits.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    uint16_t b = floatToBf16(fromBits(nan));
    EXPECT_TRUE(std::isnan(bf16ToFloat(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;
  }
}

TEST(AdamWBf16, MatchesIndependentRoundingOnRandomBits) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = rng();
    if ((bits & 0x7F800000u) == 0x7F800000u)
      continue;
    ASSERT_EQ(floatToBf16(fromBits(bits)), referenceBf16(fromBits(bits)))
        << std::hex << bits;
  }
}

TEST(AdamWStep, WorkingCopyOfHandValues) {
  // lr = 0 leaves the master unchanged, so the working copy is the rounding
  // of the given values.
  const uint32_t in[] = {0x3F808000u, 0x3F818000u, 0x3F808001u, 0xBF818000u,
                         0x00018000u, 0x7F7F7FFFu, 0x40490FDBu /* pi */};
  const uint16_t out[] = {0x3F80u, 0x3F82u, 0x3F81u, 0xBF82u,
                          0x0002u, 0x7F7Fu, 0x4049u};
  int64_t n = sizeof(in) / sizeof(in[0]);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), grad(n, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    master[i] = fromBits(in[i]);
  std::vector<uint16_t> working(n, 0);
  AdamWHyper h;
  h.lr = 0.0;
  adamwStep(h, n, master.data(), m.data(), v.data(), grad.data(),
            working.data());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(bitsOf(master[i]), in[i]) << i;
    EXPECT_EQ(working[i], out[i]) << i;
  }
}

TEST(AdamWStep, EmptyTouchesNothing) {
  AdamWHyper h;
  adamwStep(h, 0, nullptr, nullptr, nullptr,
            static_cast<const uint16_t *>(nullptr), nullptr);
  adamwStep(h, 0, nullptr, nullptr, nullptr,
            static_cast<const float *>(nullptr), nullptr);
}

TEST(AdamWStep, MatchesReferenceOverFiveSteps) {
  std::mt19937 sizeRng(2024);
  std::vector<int64_t> sizes = {1, 7, 15, 16, 17, 1000, 4099, 70001};
  std::uniform_int_distribution<int64_t> sizeDist(2, 5000);
  for (int i = 0; i < 3; ++i)
    sizes.push_back(sizeDist(sizeRng));
  uint32_t seed = 1;
  for (int64_t n : sizes)
    for (float wd : {0.0f, 0.1f})
      for (bool bf16Grad : {true, false})
        for (bool withWorking : {true, false})
          runSteps(n, wd, bf16Grad, withWorking, seed++);
}

TEST(AdamWStep, ThreadCountIndependent) {
  // Large enough that 4 threads each get a chunk, and not a multiple of
  // the chunk alignment.
  const int64_t n = 300007;
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> master0(n);
  std::vector<uint16_t> gradBf16(n);
  for (int64_t i = 0; i < n; ++i) {
    master0[i] = dist(rng);
    gradBf16[i] = floatToBf16(dist(rng));
  }
  struct Result {
    std::vector<float> master, m, v;
    std::vector<uint16_t> working;
  };
  auto run = [&](const char *threads) {
    megaslide::cpu::test::ScopedThreads scoped(threads);
    Result r{master0, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f),
             std::vector<uint16_t>(n, 0)};
    AdamWHyper h;
    h.lr = 1e-3;
    h.weightDecay = 0.01;
    for (int64_t t = 1; t <= 3; ++t) {
      h.step = t;
      adamwStep(h, n, r.master.data(), r.m.data(), r.v.data(), gradBf16.data(),
                r.working.data());
    }
    return r;
  };
  Result one = run("1"), four = run("4");
  EXPECT_EQ(std::memcmp(one.master.data(), four.master.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(one.m.data(), four.m.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(one.v.data(), four.v.data(), n * 4), 0);
  EXPECT_EQ(one.working, four.working);
}

TEST(AdamWStep, InstructionSetsBitwiseEqual) {
  // Misaligned starts and an odd length exercise every peel and tail loop;
  // magnitudes over 2^-20..2^20 keep v away from underflow and overflow
  // alike, and weight decay > 0 makes every term count.
  const int64_t n = 100003;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  std::vector<float> master0(n + 1), grad(n + 1);
  std::vector<uint16_t> gradBf16(n + 1);
  for (int64_t i = 0; i <= n; ++i) {
    master0[i] = unit(rng);
    grad[i] = unit(rng) * std::exp2(exponent(rng));
    gradBf16[i] = floatToBf16(grad[i]);
  }
  struct Result {
    std::vector<float> master, m, v;
    std::vector<uint16_t> working;
  };
  auto run = [&](CpuIsa isa, bool bf16Grad) {
    Result r{master0, std::vector<float>(n + 1, 0.0f),
             std::vector<float>(n + 1, 0.0f), std::vector<uint16_t>(n + 1, 0)};
    AdamWHyper h;
    h.lr = 1e-3;
    h.weightDecay = 0.01;
    for (int64_t t = 1; t <= 3; ++t) {
      h.step = t;
      if (bf16Grad)
        adamwStep(h, n, r.master.data() + 1, r.m.data() + 1, r.v.data() + 1,
                  gradBf16.data() + 1, r.working.data() + 1, isa);
      else
        adamwStep(h, n, r.master.data() + 1, r.m.data() + 1, r.v.data() + 1,
                  grad.data() + 1, r.working.data() + 1, isa);
    }
    return r;
  };
  std::vector<CpuIsa> isas = {CpuIsa::Avx2, CpuIsa::Avx512};
  for (bool bf16Grad : {true, false}) {
    Result generic = run(CpuIsa::Generic, bf16Grad);
    for (CpuIsa isa : isas) {
      if (static_cast<int>(isa) > static_cast<int>(cpuBestIsa()))
        continue; // the CPU lacks it (adamwStep would lower it anyway)
      SCOPED_TRACE(std::string(cpuIsaName(isa)) +
                   (bf16Grad ? ", bf16 grads" : ", fp32 grads"));
      Result r = run(isa, bf16Grad);
      EXPECT_EQ(
          std::memcmp(generic.master.data(), r.master.data(), (n + 1) * 4), 0);
      EXPECT_EQ(std::memcmp(generic.m.data(), r.m.data(), (n + 1) * 4), 0);
      EXPECT_EQ(std::memcmp(generic.v.data(), r.v.data(), (n + 1) * 4), 0);
      EXPECT_EQ(generic.working, r.working);
    }
  }
}

TEST(AdamWStep, LargeCallMatchesSmallCalls) {
  // One call splits the work into a chunk per thread; calls of 1000
  // elements run on one thread each, with other peel and tail loops. The
  // update is elementwise, so both must give the same bits, from any
  // alignment.
  const int64_t n = 300007, piece = 1000;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> master0(n + 3);
  std::vector<uint16_t> gradBf16(n + 3);
  for (int64_t i = 0; i < n + 3; ++i) {
    master0[i] = dist(rng);
    gradBf16[i] = floatToBf16(dist(rng));
  }
  for (int64_t offset : {0, 3}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    std::vector<float> p1 = master0, m1(n + 3, 0.0f), v1(n + 3, 0.0f);
    std::vector<float> p2 = master0, m2(n + 3, 0.0f), v2(n + 3, 0.0f);
    std::vector<uint16_t> w1(n + 3, 0), w2(n + 3, 0);
    AdamWHyper h;
    h.lr = 1e-3;
    h.weightDecay = 0.01;
    for (int64_t t = 1; t <= 2; ++t) {
      h.step = t;
      const uint16_t *g = gradBf16.data() + offset;
      adamwStep(h, n, p1.data() + offset, m1.data() + offset,
                v1.data() + offset, g, w1.data() + offset);
      for (int64_t b = 0; b < n; b += piece) {
        int64_t o = offset + b, len = std::min(piece, n - b);
        adamwStep(h, len, p2.data() + o, m2.data() + o, v2.data() + o, g + b,
                  w2.data() + o);
      }
    }
    EXPECT_EQ(std::memcmp(p1.data(), p2.data(), (n + 3) * 4), 0);
    EXPECT_EQ(std::memcmp(m1.data(), m2.data(), (n + 3) * 4), 0);
    EXPECT_EQ(std::memcmp(v1.data(), v2.data(), (n + 3) * 4), 0);
    ASSERT_EQ(w1, w2);
    // And the working copy is the rounding of the new master.
    for (int64_t i = offset; i < n + offset; ++i)
      ASSERT_EQ(w1[i], referenceBf16(p1[i])) << i;
  }
}

TEST(AdamWStep, OneMinusBetaIsFormedInDouble) {
  // v' = (1 - b2) g^2 from v = 0: with 1 - b2 formed in double and rounded
  // once, v' is within an ulp or two of 0.001 * 0.25; forming it from
  // fp32(0.999) would be 1.3e-5 relative off (torch.optim.AdamW, which
  // works with double scalars, would disagree at that level).
  std::vector<float> master(64, 1.0f), m(64, 0.0f), v(64, 0.0f), grad(64, 0.5f);
  AdamWHyper h;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  adamwStep(h, 64, master.data(), m.data(), v.data(), grad.data(), nullptr);
  for (int i = 0; i < 64; ++i) {
    EXPECT_NEAR(v[i], 0.00025, 0.00025 * 3e-7) << i;
    EXPECT_NEAR(m[i], 0.05, 0.05 * 3e-7) << i;
  }
}

TEST(AdamWStep, BestIsaIsNamed) {
  EXPECT_STRNE(cpuIsaName(cpuBestIsa()), "unknown");
}

} // namespace

namespace {

// Tests adamwStepBf16Moments (bf16-moments) over five steps, each against
// the double reference of one step from the kernel's own state before it
// (its bf16 m and v widened, its master), with m and v rounded to bf16 by
// the independent rounding above: m and v within one bf16 ulp plus 1e-7
// (the kernel rounds fp32 values, the reference doubles, which may fall
// either side of a rounding boundary, and an m whose two terms nearly
// cancel keeps their fp32 error, about 1e-8 here), the master within
// 1e-7 + 1e-6 |ref|; over more than a million elements (two of the
// kernel's blocks).
TEST(AdamWStep, Bf16MomentsMatchReferenceEachStep) {
  int64_t n = (int64_t(1) << 20) + 1234;
  std::mt19937 rng(11);
  State s(n, rng);
  std::vector<uint16_t> m16(n, 0), v16(n, 0);
  std::uniform_real_distribution<float> gradDist(-2.0f, 2.0f);
  AdamWHyper h;
  h.lr = 1e-2;
  h.weightDecay = 0.01;
  auto ulp = [](double x) { return std::ldexp(std::fabs(x), -7) + 1e-7; };
  for (int64_t t = 1; t <= 5; ++t) {
    h.step = t;
    std::vector<float> grad(n);
    for (float &g : grad)
      g = gradDist(rng);
    for (int64_t i = 0; i < n; ++i) {
      s.refM[i] = bf16ToFloat(m16[i]);
      s.refV[i] = bf16ToFloat(v16[i]);
      s.refMaster[i] = s.master[i];
    }
    referenceStep(h, s, grad);
    adamwStepBf16Moments(h, n, s.master.data(), m16.data(), v16.data(),
                         grad.data());
    for (int64_t i = 0; i < n; ++i) {
      double m = bf16ToFloat(referenceBf16(float(s.refM[i])));
      double v = bf16ToFloat(referenceBf16(float(s.refV[i])));
      ASSERT_LE(std::fabs(bf16ToFloat(m16[i]) - m), ulp(m))
          << "m[" << i << "] at step " << t;
      ASSERT_LE(std::fabs(bf16ToFloat(v16[i]) - v), ulp(v))
          << "v[" << i << "] at step " << t;
      double tol = 1e-7 + 1e-6 * std::fabs(s.refMaster[i]);
      ASSERT_LE(std::fabs(s.master[i] - s.refMaster[i]), tol)
          << "master[" << i << "] at step " << t;
    }
  }
}

} // namespace
