//===- VecMathTest.cpp - Vector math of the CPU kernels vs references -----===//
//
// Every instruction-set variant of cpu/VecMath.h this CPU runs:
//   - exp and tanh within their stated ulp bounds of a double reference
//     over a strided sweep of all 2^32 fp32 bit patterns (every 1021st, so
//     every binade and both signs) and the edge cases: ±0, subnormals,
//     overflow to +inf, underflow to 0, ±inf, NaN;
//   - the activations, norm rows, RoPE rotation and softmax halves within
//     the dense kernels' forward tolerance (1e-6 + 1e-5 |ref|, as
//     kernels/DenseTest.cpp) of double references, and of the generic
//     variant;
//   - each element's result independent of where a call starts and ends
//     (bitwise), which the kernels' thread-count independence rests on.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/VecMath.h"

#include "gtest/gtest.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace megaslide::cpu;

namespace {

/// The stated bounds (VecMath.h, docs/Runtime.md).
constexpr double kExpUlp = 1.5, kTanhUlp = 2.0;
constexpr double kAtol = 1e-6, kRtol = 1e-5;

std::vector<CpuIsa> supportedIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
    if (static_cast<int>(isa) <= static_cast<int>(cpuBestIsa()))
      isas.push_back(isa);
  return isas;
}

float fromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

/// |got - ref| in units of the fp32 spacing at ref (2^-149 among the
/// subnormals). Where ref rounds to an infinity, only that infinity is
/// right; elsewhere an infinite `got` counts as 2^128, the next binade.
double ulpError(float got, double ref) {
  if (std::isnan(ref))
    return std::isnan(got) ? 0 : INFINITY;
  if (std::isnan(got))
    return INFINITY;
  if (std::isinf(static_cast<float>(ref)))
    return got == static_cast<float>(ref) ? 0 : INFINITY;
  double g = std::isinf(got) ? std::copysign(std::ldexp(1.0, 128), got) : got;
  int e;
  std::frexp(std::fabs(ref), &e);
  double ulp = std::ldexp(1.0, std::max(e - 24, -149));
  return std::fabs(g - ref) / ulp;
}

std::vector<float> sweepInputs() {
  std::vector<float> x;
  for (uint64_t b = 0; b < (uint64_t(1) << 32); b += 1021)
    x.push_back(fromBits(static_cast<uint32_t>(b)));
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.0f,
                  -0.0f,
                  inf,
                  -inf,
                  std::nanf(""),
                  fromBits(1),
                  fromBits(0x807fffffu),
                  88.72f,
                  88.7228f,
                  88.73f,
                  89.0f,
                  -87.33f,
                  -100.0f,
                  -103.97f,
                  -103.98f,
                  -104.0f,
                  -200.0f,
                  0.625f,
                  -0.625f,
                  0.62499994f,
                  9.0f,
                  9.1f,
                  -9.1f,
                  20.0f,
                  -20.0f,
                  1e-20f,
                  -1e-20f})
    x.push_back(v);
  return x;
}

template <typename Ref>
void expectUlpBound(void (*fn)(const float *, float *, int64_t), Ref ref,
                    double bound, const char *name) {
  std::vector<float> x = sweepInputs(), y(x.size());
  fn(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst = 0;
  float worstX = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double e = ulpError(y[i], ref(static_cast<double>(x[i])));
    if (!(e <= worst)) {
      worst = e;
      worstX = x[i];
    }
  }
  EXPECT_LE(worst, bound) << name << ": worst at x = " << worstX;
}

TEST(CpuVecMath, ExpWithinItsUlpBound) {
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    expectUlpBound(
        vecKernels(isa).exp, [](double x) { return std::exp(x); }, kExpUlp,
        "exp");
  }
}

TEST(CpuVecMath, TanhWithinItsUlpBound) {
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    expectUlpBound(
        vecKernels(isa).tanh, [](double x) { return std::tanh(x); }, kTanhUlp,
        "tanh");
  }
}

TEST(CpuVecMath, EdgeCasesAreExact) {
  const float inf = std::numeric_limits<float>::infinity();
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    const VecKernels &k = vecKernels(isa);
    std::vector<float> x = {0.0f,          -0.0f, inf,     -inf,
                            std::nanf(""), 89.0f, -104.0f, fromBits(1),
                            -fromBits(1),  30.0f, -30.0f};
    std::vector<float> e(x.size()), t(x.size());
    k.exp(x.data(), e.data(), x.size());
    k.tanh(x.data(), t.data(), x.size());
    EXPECT_EQ(e[0], 1.0f);
    EXPECT_EQ(e[1], 1.0f);
    EXPECT_EQ(e[2], inf);
    EXPECT_EQ(e[3], 0.0f);
    EXPECT_TRUE(std::isnan(e[4]));
    EXPECT_EQ(e[5], inf);
    EXPECT_EQ(e[6], 0.0f);
    EXPECT_EQ(e[7], 1.0f);
    EXPECT_EQ(t[0], 0.0f);
    EXPECT_FALSE(std::signbit(t[0]));
    EXPECT_EQ(t[1], 0.0f);
    EXPECT_TRUE(std::signbit(t[1]));
    EXPECT_EQ(t[2], 1.0f);
    EXPECT_EQ(t[3], -1.0f);
    EXPECT_TRUE(std::isnan(t[4]));
    EXPECT_EQ(t[7], fromBits(1)); // tanh of a subnormal is itself
    EXPECT_EQ(t[8], -fromBits(1));
    EXPECT_EQ(t[9], 1.0f);
    EXPECT_EQ(t[10], -1.0f);
  }
}

//===----------------------------------------------------------------------===//
// Kernels against double references and the generic variant
//===----------------------------------------------------------------------===//

std::vector<float> randoms(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float &f : v)
    f = dist(rng);
  return v;
}

void expectNear(const std::vector<float> &got, const std::vector<double> &ref,
                const std::string &what) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(got[i] - ref[i]), kAtol + kRtol * std::fabs(ref[i]))
        << what << " at " << i << ": " << got[i] << " vs " << ref[i];
}

void expectNear(const std::vector<float> &got, const std::vector<float> &ref,
                const std::string &what) {
  expectNear(got, std::vector<double>(ref.begin(), ref.end()), what);
}

double geluRef(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

double geluGradRef(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
}

double sigmoidRef(double x) { return 1 / (1 + std::exp(-x)); }

/// Inputs across the activations' whole shape, saturated tails included.
std::vector<float> activationInputs() {
  std::vector<float> x = randoms(1000, 1, 3.0f);
  for (float v = -30.0f; v <= 30.0f; v += 0.0625f)
    x.push_back(v);
  return x;
}

TEST(CpuVecMath, ActivationsMatchDoubleReferences) {
  std::vector<float> x = activationInputs(), dy = randoms(x.size(), 2, 1.0f);
  int64_t n = x.size();
  std::vector<double> gelu(n), geluGrad(n), silu(n), siluGrad(n);
  for (int64_t i = 0; i < n; ++i) {
    double s = sigmoidRef(x[i]);
    gelu[i] = geluRef(x[i]);
    geluGrad[i] = dy[i] * geluGradRef(x[i]);
    silu[i] = x[i] * s;
    siluGrad[i] = dy[i] * s * (1 + x[i] * (1 - s));
  }
  std::vector<float> y(n), generic[4];
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    const VecKernels &k = vecKernels(isa);
    int j = 0;
    auto check = [&](const std::vector<double> &ref, const char *what) {
      expectNear(y, ref, what);
      if (isa == CpuIsa::Generic)
        generic[j] = y;
      else
        expectNear(y, generic[j], std::string(what) + " vs generic");
      ++j;
    };
    k.gelu(x.data(), y.data(), n);
    check(gelu, "gelu");
    k.geluGrad(x.data(), dy.data(), y.data(), n);
    check(geluGrad, "gelu_grad");
    k.silu(x.data(), y.data(), n);
    check(silu, "silu");
    k.siluGrad(x.data(), dy.data(), y.data(), n);
    check(siluGrad, "silu_grad");
  }
}

TEST(CpuVecMath, GeluGradOfSaturatedUnitsIsFinite) {
  std::vector<float> x = {1e20f, -1e20f, std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::infinity()};
  std::vector<float> dy(x.size(), 1.0f), dx(x.size());
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    vecKernels(isa).geluGrad(x.data(), dy.data(), dx.data(), x.size());
    EXPECT_EQ(dx[0], 1.0f);
    EXPECT_EQ(dx[1], 0.0f);
    EXPECT_EQ(dx[2], 1.0f);
    EXPECT_EQ(dx[3], 0.0f);
  }
}

/// Lengths that cover whole vectors, tails and rows shorter than a vector.
const int64_t kLengths[] = {1, 7, 16, 33, 64, 100, 512};

TEST(CpuVecMath, NormRowsMatchDoubleReferences) {
  for (int64_t d : kLengths) {
    // A mean twice the spread: a one-pass variance would lose digits, while
    // fp32 x - mean stays within the forward tolerance.
    std::vector<float> x = randoms(d, 3 + d, 2.0f),
                       dy = randoms(d, 4 + d, 1.0f);
    std::vector<float> gamma = randoms(d, 5 + d, 1.0f),
                       beta = randoms(d, 6 + d, 1.0f);
    for (float &v : x)
      v += 4.0f;
    const float eps = 1e-5f;
    double mu = 0, var = 0, sq = 0;
    for (float v : x)
      mu += v, sq += double(v) * v;
    mu /= d;
    for (float v : x)
      var += (v - mu) * (v - mu);
    var /= d;
    double rstdRef = 1 / std::sqrt(var + eps),
           rmsRef = 1 / std::sqrt(sq / d + eps);
    std::vector<double> yRef(d), dxRef(d), rmsDxRef(d), dgRef(d);
    double sumG = 0, sumGX = 0, rmsSumGX = 0;
    for (int64_t i = 0; i < d; ++i) {
      double xhat = (x[i] - mu) * rstdRef, g = double(dy[i]) * gamma[i];
      yRef[i] = xhat * gamma[i] + beta[i];
      sumG += g, sumGX += g * xhat, rmsSumGX += g * x[i] * rmsRef;
      dgRef[i] = dy[i] * xhat;
    }
    for (int64_t i = 0; i < d; ++i) {
      double g = double(dy[i]) * gamma[i], xhat = (x[i] - mu) * rstdRef;
      dxRef[i] = rstdRef * (g - sumG / d - xhat * sumGX / d);
      rmsDxRef[i] = rmsRef * (g - x[i] * rmsRef * rmsSumGX / d);
    }
    for (CpuIsa isa : supportedIsas()) {
      SCOPED_TRACE(std::string(cpuIsaName(isa)) + ", d = " + std::to_string(d));
      const VecKernels &k = vecKernels(isa);
      float mean, rstd;
      k.meanRstd(x.data(), d, eps, &mean, &rstd);
      EXPECT_NEAR(mean, mu, 1e-5 * std::fabs(mu));
      EXPECT_NEAR(rstd, rstdRef, 1e-5 * rstdRef);
      EXPECT_NEAR(k.rmsRstd(x.data(), d, eps), rmsRef, 1e-5 * rmsRef);
      std::vector<float> y(d), dx(d);
      k.normApply(x.data(), d, mean, rstd, gamma.data(), beta.data(), y.data());
      expectNear(y, yRef, "layer norm");
      k.normGrad(x.data(), dy.data(), gamma.data(), d, mean, rstd, true,
                 dx.data());
      // Relative to the row's scale: dx is a difference of O(rstd) terms.
      for (int64_t i = 0; i < d; ++i)
        ASSERT_NEAR(dx[i], dxRef[i], 1e-4 * rstdRef) << "layer norm dx " << i;
      float rms = k.rmsRstd(x.data(), d, eps);
      k.normGrad(x.data(), dy.data(), gamma.data(), d, 0.0f, rms, false,
                 dx.data());
      for (int64_t i = 0; i < d; ++i)
        ASSERT_NEAR(dx[i], rmsDxRef[i], 1e-4 * rmsRef) << "rms norm dx " << i;
      std::vector<double> dgamma(d, 0.0), dbeta(d, 0.0);
      k.normParamGrad(x.data(), dy.data(), d, mean, rstd, dgamma.data(),
                      dbeta.data());
      for (int64_t i = 0; i < d; ++i) {
        EXPECT_NEAR(dgamma[i], dgRef[i], kAtol + kRtol * std::fabs(dgRef[i]));
        EXPECT_EQ(dbeta[i], dy[i]);
      }
    }
  }
}

TEST(CpuVecMath, RotatePairsMatchesDoubleReference) {
  for (int64_t n : {2, 16, 34, 128}) {
    std::vector<float> x = randoms(n, 7, 1.0f), cosines(n), sines(n);
    std::vector<double> ref(n);
    for (int64_t p = 0; p < n / 2; ++p) {
      double angle = 0.37 * p + 0.1;
      cosines[2 * p] = cosines[2 * p + 1] = static_cast<float>(std::cos(angle));
      float s = static_cast<float>(std::sin(angle));
      sines[2 * p] = -s;
      sines[2 * p + 1] = s;
      double x0 = x[2 * p], x1 = x[2 * p + 1];
      ref[2 * p] = x0 * cosines[2 * p] - x1 * double(s);
      ref[2 * p + 1] = x0 * double(s) + x1 * cosines[2 * p];
    }
    for (CpuIsa isa : supportedIsas()) {
      SCOPED_TRACE(std::string(cpuIsaName(isa)) + ", n = " + std::to_string(n));
      std::vector<float> out(n);
      vecKernels(isa).rotatePairs(x.data(), cosines.data(), sines.data(),
                                  out.data(), n);
      expectNear(out, ref, "rope");
    }
  }
}

TEST(CpuVecMath, SoftmaxHalvesMatchDoubleReference) {
  for (int64_t n : kLengths) {
    std::vector<float> x = randoms(n, 8 + n, 4.0f);
    double maxRef = -INFINITY;
    for (float v : x)
      maxRef = std::max<double>(maxRef, v);
    for (CpuIsa isa : supportedIsas()) {
      SCOPED_TRACE(std::string(cpuIsaName(isa)) + ", n = " + std::to_string(n));
      const VecKernels &k = vecKernels(isa);
      float m = k.maxOf(x.data(), n);
      EXPECT_EQ(m, maxRef);
      std::vector<float> e = x;
      float sum = k.expSubAndSum(e.data(), n, m);
      std::vector<double> ref(n);
      double sumRef = 0;
      for (int64_t i = 0; i < n; ++i)
        sumRef += ref[i] = std::exp(double(x[i]) - m);
      expectNear(e, ref, "exp(x - max)");
      EXPECT_NEAR(sum, sumRef, kRtol * sumRef);
    }
  }
  EXPECT_EQ(vecKernels(CpuIsa::Generic).maxOf(nullptr, 0),
            -std::numeric_limits<float>::infinity());
}

TEST(CpuVecMath, ElementsDoNotDependOnTheCallBoundaries) {
  std::vector<float> x = activationInputs(), dy = randoms(x.size(), 9, 1.0f);
  int64_t n = x.size();
  for (CpuIsa isa : supportedIsas()) {
    SCOPED_TRACE(cpuIsaName(isa));
    const VecKernels &k = vecKernels(isa);
    std::vector<float> whole(n), parts(n), wholeGrad(n), partsGrad(n);
    k.gelu(x.data(), whole.data(), n);
    k.geluGrad(x.data(), dy.data(), wholeGrad.data(), n);
    // Odd-sized pieces: every element lands at another lane or in a tail.
    for (int64_t i = 0, step = 1; i < n; i += step, step = step % 37 + 3) {
      int64_t m = std::min(step, n - i);
      k.gelu(x.data() + i, parts.data() + i, m);
      k.geluGrad(x.data() + i, dy.data() + i, partsGrad.data() + i, m);
    }
    EXPECT_EQ(std::memcmp(whole.data(), parts.data(), n * sizeof(float)), 0);
    EXPECT_EQ(
        std::memcmp(wholeGrad.data(), partsGrad.data(), n * sizeof(float)), 0);
  }
}

} // namespace
