//===- LeanAdamWTest.cpp - 8-bit and factored AdamW moments ---------------===//
//
// runtime/cpu/LeanAdamW.cpp: bitsandbytes' dynamic maps (hand values of
// create_dynamic_map), nearest-code quantization with ties to the lower
// code, the 8-bit update against a reference written here (dequantize,
// AdamW in double, requantize), the factored update against R C^T / sum(R)
// computed here, thread-count independence (1 vs 4 threads, bitwise) and
// one call against the same update in block-aligned ranges (bitwise).
// test/python/test_adamw.py checks the same against numpy written from the
// definitions, element by element.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/Testing/ScopedThreads.h"

#include "gtest/gtest.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace megaslide::cpu;

namespace {

TEST(DynamicMap, HandValues) {
  const std::array<float, 256> &s = dynamicMap(true), &u = dynamicMap(false);
  EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end()));
  EXPECT_EQ(std::adjacent_find(s.begin(), s.end()), s.end()); // distinct
  EXPECT_EQ(std::adjacent_find(u.begin(), u.end()), u.end());
  // Signed: 127 negatives, 0, 127 positives, 1; the smallest decade is
  // the midpoint of linspace(0.1, 1, 2) = 0.55, times 1e-6.
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_FLOAT_EQ(s[128], 0.55e-6f);
  EXPECT_FLOAT_EQ(s[126], -0.55e-6f);
  // The last decade: linspace(0.1, 1, 65)'s top midpoint, 1 - 0.9 / 128.
  EXPECT_FLOAT_EQ(s[0], -(1.0f - 0.9f / 128));
  // Unsigned: 0, then linspace(0.1, 1, 3)'s midpoints 0.325, 0.775 times
  // 1e-6 first.
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_FLOAT_EQ(u[1], 0.325e-6f);
  EXPECT_FLOAT_EQ(u[2], 0.775e-6f);
}

TEST(QuantizeCode, NearestWithTiesToTheLowerCode) {
  const std::array<float, 256> &u = dynamicMap(false);
  EXPECT_EQ(quantizeCode(u, 0.0f), 0);
  EXPECT_EQ(quantizeCode(u, 1.0f), 255);
  EXPECT_EQ(quantizeCode(u, 2.0f), 255);
  EXPECT_EQ(quantizeCode(u, -1.0f), 0);
  EXPECT_EQ(quantizeCode(u, u[100]), 100);
  float mid = u[100] + (u[101] - u[100]) / 2;
  uint8_t code = quantizeCode(u, mid);
  // An exact tie (if the midpoint is representable) goes to 100.
  if (mid - u[100] == u[101] - mid) {
    EXPECT_EQ(code, 100);
  }
  EXPECT_EQ(quantizeCode(u, std::nextafter(mid, 1.0f)), 101);
  EXPECT_EQ(quantizeCode(u, std::nextafter(mid, 0.0f)), 100);
}

TEST(QuantizeBlockwise, RoundTripWithinHalfAGap) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1e-3f);
  const int64_t n = 3 * kQuantBlock + 17;
  std::vector<float> x(n), back(n), absmax(quantBlocks(n));
  std::vector<uint8_t> codes(n);
  for (float &f : x)
    f = dist(rng);
  std::fill(x.begin() + kQuantBlock, x.begin() + 2 * kQuantBlock, 0.0f);
  quantizeBlockwise(x.data(), n, true, codes.data(), absmax.data());
  dequantizeBlockwise(codes.data(), absmax.data(), n, true, back.data());
  EXPECT_EQ(absmax[1], 0.0f); // a block of zeros
  const std::array<float, 256> &s = dynamicMap(true);
  for (int64_t i = 0; i < n; ++i) {
    float a = absmax[i / kQuantBlock];
    if (a == 0) {
      EXPECT_EQ(back[i], 0.0f);
      continue;
    }
    int c = codes[i];
    // The nearest code: no neighbour is nearer.
    float y = x[i] / a;
    if (c > 0) {
      EXPECT_LE(std::fabs(s[c] - y), std::fabs(s[c - 1] - y)) << i;
    }
    if (c < 255) {
      EXPECT_LE(std::fabs(s[c] - y), std::fabs(s[c + 1] - y)) << i;
    }
  }
}

/// The 8-bit update written from its definition, in double between the
/// quantizations (the kernel's fp32 AdamW differs by rounding only).
void reference8bit(const AdamWHyper &h, int64_t n, std::vector<float> &p,
                   std::vector<uint8_t> &mc, std::vector<float> &ma,
                   std::vector<uint8_t> &vc, std::vector<float> &va,
                   const std::vector<float> &g) {
  std::vector<float> m(n), v(n);
  dequantizeBlockwise(mc.data(), ma.data(), n, true, m.data());
  dequantizeBlockwise(vc.data(), va.data(), n, false, v.data());
  double bc1 = 1 - std::pow(h.beta1, h.step),
         bc2 = 1 - std::pow(h.beta2, h.step);
  for (int64_t i = 0; i < n; ++i) {
    double mi = h.beta1 * m[i] + (1 - h.beta1) * g[i];
    double vi = h.beta2 * v[i] + (1 - h.beta2) * double(g[i]) * g[i];
    p[i] = float(p[i] - h.lr * (h.weightDecay * p[i] +
                                (mi / bc1) / (std::sqrt(vi / bc2) + h.eps)));
    m[i] = float(mi);
    v[i] = float(vi);
  }
  quantizeBlockwise(m.data(), n, true, mc.data(), ma.data());
  quantizeBlockwise(v.data(), n, false, vc.data(), va.data());
}

struct State8 {
  std::vector<float> p;
  std::vector<uint8_t> mc, vc;
  std::vector<float> ma, va;
  explicit State8(const std::vector<float> &p0)
      : p(p0), mc(p0.size()), vc(p0.size()), ma(quantBlocks(p0.size())),
        va(quantBlocks(p0.size())) {
    // Zero moments: every code that of 0.
    std::vector<float> zeros(p0.size(), 0.0f);
    quantizeBlockwise(zeros.data(), p0.size(), true, mc.data(), ma.data());
    quantizeBlockwise(zeros.data(), p0.size(), false, vc.data(), va.data());
  }
};

TEST(Adamw8bitStep, MatchesReferenceOverFiveSteps) {
  const int64_t n = 2 * kQuantBlock + 100;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> p0(n);
  for (float &f : p0)
    f = dist(rng);
  State8 got(p0), ref(p0);
  AdamWHyper h;
  h.lr = 1e-3;
  h.weightDecay = 0.01;
  for (int64_t t = 1; t <= 5; ++t) {
    std::vector<float> g(n);
    for (float &f : g)
      f = dist(rng) * 1e-2f;
    h.step = t;
    adamw8bitStep(h, n, got.p.data(), got.mc.data(), got.ma.data(),
                  got.vc.data(), got.va.data(), g.data());
    reference8bit(h, n, ref.p, ref.mc, ref.ma, ref.vc, ref.va, g);
  }
  int64_t codeDiffs = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(got.p[i], ref.p[i], 1e-6 + 1e-5 * std::fabs(ref.p[i])) << i;
    // fp32 vs double AdamW may land a value on the other side of a code
    // boundary, one code away at most.
    EXPECT_LE(std::abs(int(got.mc[i]) - int(ref.mc[i])), 1) << i;
    EXPECT_LE(std::abs(int(got.vc[i]) - int(ref.vc[i])), 1) << i;
    codeDiffs += got.mc[i] != ref.mc[i] || got.vc[i] != ref.vc[i];
  }
  EXPECT_LT(codeDiffs, n / 50);
  for (size_t b = 0; b < got.ma.size(); ++b) {
    EXPECT_NEAR(got.ma[b], ref.ma[b], 1e-6 * ref.ma[b]);
    EXPECT_NEAR(got.va[b], ref.va[b], 1e-5 * ref.va[b]);
  }
}

TEST(Adamw8bitStep, ThreadsAndRangesBitwiseEqual) {
  const int64_t n = 300 * kQuantBlock + 77;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> p0(n);
  std::vector<uint16_t> g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = dist(rng);
    g[i] = floatToBf16(dist(rng));
  }
  AdamWHyper h;
  h.lr = 1e-3;
  auto run = [&](const char *threads, int64_t range) {
    megaslide::cpu::test::ScopedThreads scoped(threads);
    State8 s(p0);
    for (int64_t t = 1; t <= 3; ++t) {
      h.step = t;
      // Ranges [a, b) with a, b multiples of the block (the last to n).
      for (int64_t a = 0; a < n; a += range) {
        int64_t k = a / kQuantBlock, len = std::min(range, n - a);
        adamw8bitStep(h, len, s.p.data() + a, s.mc.data() + a, s.ma.data() + k,
                      s.vc.data() + a, s.va.data() + k, g.data() + a);
      }
    }
    return s;
  };
  State8 one = run("1", n), four = run("4", n),
         ranges = run("2", 7 * kQuantBlock);
  for (const State8 *other : {&four, &ranges}) {
    EXPECT_EQ(std::memcmp(one.p.data(), other->p.data(), n * 4), 0);
    EXPECT_EQ(one.mc, other->mc);
    EXPECT_EQ(one.vc, other->vc);
    EXPECT_EQ(one.ma, other->ma);
    EXPECT_EQ(one.va, other->va);
  }
}

TEST(AdamwFactoredStep, MatchesReference) {
  const FactoredShape shape{37, 53};
  const int64_t n = shape.rows * shape.cols;
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> p(n), pRef(n), m32(n, 0.0f);
  for (float &f : p)
    f = dist(rng);
  pRef = p;
  std::vector<uint16_t> m(n, 0);
  std::vector<float> R(shape.rows, 0.0f), C(shape.cols, 0.0f);
  std::vector<double> rRef(shape.rows, 0.0), cRef(shape.cols, 0.0);
  AdamWHyper h;
  h.lr = 1e-2;
  h.beta2 = 0.99;
  for (int64_t t = 1; t <= 4; ++t) {
    std::vector<float> g(n);
    for (float &f : g)
      f = dist(rng) * 0.1f;
    h.step = t;
    factoredStatsStep(h, shape, g.data(), R.data(), C.data());
    adamwFactoredStep(h, shape, 0, n, p.data(), m.data(), R.data(), C.data(),
                      factoredRowTotal(shape, R.data()), g.data());
    // The reference: row and column EMAs of g^2 + eps1, v = R C^T / sum R.
    for (int64_t i = 0; i < shape.rows; ++i) {
      double s = 0;
      for (int64_t j = 0; j < shape.cols; ++j)
        s += double(g[i * shape.cols + j]) * g[i * shape.cols + j] + 1e-30;
      rRef[i] = h.beta2 * rRef[i] + (1 - h.beta2) * s;
    }
    for (int64_t j = 0; j < shape.cols; ++j) {
      double s = 0;
      for (int64_t i = 0; i < shape.rows; ++i)
        s += double(g[i * shape.cols + j]) * g[i * shape.cols + j] + 1e-30;
      cRef[j] = h.beta2 * cRef[j] + (1 - h.beta2) * s;
    }
    double total = 0;
    for (double r : rRef)
      total += r;
    double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
    for (int64_t e = 0; e < n; ++e) {
      double mi = h.beta1 * m32[e] + (1 - h.beta1) * g[e];
      double v = rRef[e / shape.cols] * cRef[e % shape.cols] / total;
      pRef[e] =
          float(pRef[e] - h.lr * (mi / bc1) / (std::sqrt(v / bc2) + h.eps));
      m32[e] = bf16ToFloat(floatToBf16(float(mi))); // m is kept in bf16
    }
  }
  for (int64_t i = 0; i < shape.rows; ++i)
    EXPECT_NEAR(R[i], rRef[i], 1e-6 * rRef[i]);
  for (int64_t j = 0; j < shape.cols; ++j)
    EXPECT_NEAR(C[j], cRef[j], 1e-6 * cRef[j]);
  for (int64_t e = 0; e < n; ++e)
    EXPECT_NEAR(p[e], pRef[e], 2e-5 + 1e-4 * std::fabs(pRef[e])) << e;
}

TEST(AdamwFactoredStep, ThreadsAndRangesBitwiseEqual) {
  const FactoredShape shape{300, 517};
  const int64_t n = shape.rows * shape.cols;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = dist(rng);
    g[i] = dist(rng);
  }
  struct S {
    std::vector<float> p, R, C;
    std::vector<uint16_t> m;
  };
  auto run = [&](const char *threads, int64_t range) {
    megaslide::cpu::test::ScopedThreads scoped(threads);
    S s{p0, std::vector<float>(shape.rows), std::vector<float>(shape.cols),
        std::vector<uint16_t>(n)};
    AdamWHyper h;
    for (int64_t t = 1; t <= 3; ++t) {
      h.step = t;
      factoredStatsStep(h, shape, g.data(), s.R.data(), s.C.data());
      float total = factoredRowTotal(shape, s.R.data());
      for (int64_t a = 0; a < n; a += range)
        adamwFactoredStep(h, shape, a, std::min(n, a + range), s.p.data() + a,
                          s.m.data() + a, s.R.data(), s.C.data(), total,
                          g.data() + a);
    }
    return s;
  };
  S one = run("1", n), four = run("4", n), ranges = run("3", 40 * kQuantBlock);
  for (const S *o : {&four, &ranges}) {
    EXPECT_EQ(std::memcmp(one.p.data(), o->p.data(), n * 4), 0);
    EXPECT_EQ(one.m, o->m);
    EXPECT_EQ(one.R, o->R);
    EXPECT_EQ(one.C, o->C);
  }
}

} // namespace
