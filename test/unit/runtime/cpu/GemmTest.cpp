//===- GemmTest.cpp - The CPU kernels' GEMM -------------------------------===//
//
// cpu/Gemm.h against a double-precision reference over every transpose,
// padded leading dimensions, tile borders and the alpha/beta cases, its
// thread-count independence, and its safety under signal handlers.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/Testing/ScopedThreads.h"

#include "gtest/gtest.h"

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <sys/time.h>

using namespace megaslide::cpu;

namespace {

struct Case {
  int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
};

/// op(X) of `rows` x `cols` stored with a padded leading dimension.
struct Stored {
  std::vector<float> data;
  int64_t ld;
  bool transposed;
  float at(int64_t i, int64_t j) const {
    return transposed ? data[j * ld + i] : data[i * ld + j];
  }
};

Stored makeOperand(int64_t rows, int64_t cols, bool transposed,
                   std::mt19937 &rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  int64_t storedRows = transposed ? cols : rows;
  int64_t ld = (transposed ? rows : cols) + 3;
  Stored s{std::vector<float>(storedRows * ld), ld, transposed};
  for (float &x : s.data)
    x = dist(rng);
  return s;
}

/// Runs `c` through `fn` (gemm or gemmSerial) and checks it against double
/// products: |error| <= 4 k eps sum |terms| (a sum of k rounded products
/// in any order), plus the rounding of beta C.
template <typename Gemm> void check(const Case &t, Gemm fn) {
  SCOPED_TRACE(::testing::Message()
               << t.m << "x" << t.n << "x" << t.k << " ta=" << t.ta
               << " tb=" << t.tb << " alpha=" << t.alpha << " beta=" << t.beta);
  std::mt19937 rng(static_cast<unsigned>(t.m * 131 + t.n * 17 + t.k));
  Stored a = makeOperand(t.m, t.k, t.ta, rng),
         b = makeOperand(t.k, t.n, t.tb, rng);
  const int64_t ldc = t.n + 5;
  std::vector<float> c(t.m * ldc);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float &x : c)
    x = t.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : dist(rng);
  std::vector<float> before = c;
  fn(t.m, t.n, t.k, t.alpha, GemmOperand{a.data.data(), a.ld, t.ta},
     GemmOperand{b.data.data(), b.ld, t.tb}, t.beta, c.data(), ldc);
  const double eps = std::numeric_limits<float>::epsilon();
  for (int64_t i = 0; i < t.m; ++i) {
    for (int64_t j = 0; j < t.n; ++j) {
      double sum = 0, mag = 0;
      for (int64_t p = 0; p < t.k; ++p) {
        double term = double(a.at(i, p)) * b.at(p, j);
        sum += term;
        mag += std::fabs(term);
      }
      double old = t.beta == 0.0f ? 0.0 : double(t.beta) * before[i * ldc + j];
      double ref = t.alpha * sum + old;
      double bound =
          4 * (t.k + 2) * eps * (std::fabs(t.alpha) * mag + std::fabs(old)) +
          1e-30;
      ASSERT_NEAR(c[i * ldc + j], ref, bound)
          << "at (" << i << ", " << j << ")";
    }
    // The padding of C is never written.
    for (int64_t j = t.n; j < ldc; ++j)
      ASSERT_TRUE(std::isnan(c[i * ldc + j])
                      ? std::isnan(before[i * ldc + j])
                      : c[i * ldc + j] == before[i * ldc + j]);
  }
}

const Case kCases[] = {
    {1, 1, 1, false, false, 1.0f, 0.0f},
    {7, 5, 3, false, true, 1.0f, 1.0f},
    {33, 65, 64, true, false, 0.125f, 0.0f},
    {64, 48, 17, true, true, -2.0f, 0.5f},
    // Past one tile of the parallel split in rows and columns, with
    // partial border tiles.
    {300, 520, 40, false, true, 1.0f, 1.0f},
    {129, 257, 33, true, true, 1.0f, 0.0f},
    {2, 3000, 200, false, false, 1.0f, 1.0f},
    // No products: C = beta C.
    {4, 6, 0, false, false, 1.0f, 0.5f},
    {4, 6, 0, false, false, 1.0f, 0.0f},
};

TEST(GemmTest, SerialMatchesDoubleReference) {
  for (const Case &t : kCases)
    check(t, gemmSerial);
}

TEST(GemmTest, ParallelMatchesDoubleReference) {
  megaslide::cpu::test::ScopedThreads threads("3");
  for (const Case &t : kCases)
    check(t, gemm);
}

TEST(GemmTest, BitwiseEqualAtAnyThreadCount) {
  const int64_t m = 700, n = 600, k = 300;
  std::mt19937 rng(7);
  Stored a = makeOperand(m, k, false, rng), b = makeOperand(k, n, true, rng);
  auto run = [&](const char *count) {
    megaslide::cpu::test::ScopedThreads threads(count);
    std::vector<float> c(m * n, 0.25f);
    gemm(m, n, k, 1.0f, {a.data.data(), a.ld}, {b.data.data(), b.ld, true},
         1.0f, c.data(), n);
    return c;
  };
  std::vector<float> one = run("1");
  for (const char *count : {"2", "4", "7"})
    EXPECT_EQ(run(count), one) << count << " threads";
}

TEST(GemmTest, NamesItsInstructionSet) { EXPECT_STRNE(gemmIsaName(), ""); }

volatile std::sig_atomic_t alarms = 0;
extern "C" void countAlarm(int) { alarms = alarms + 1; }

/// Runs GEMMs under a 37 us SIGALRM timer, then exits 0 (3: no signal came).
[[noreturn]] void gemmsUnderSignals() {
  megaslide::cpu::test::ScopedThreads threads("2");
  struct sigaction action = {};
  action.sa_handler = countAlarm;
  action.sa_flags = SA_RESTART;
  sigaction(SIGALRM, &action, nullptr);
  struct itimerval every = {{0, 37}, {0, 37}};
  setitimer(ITIMER_REAL, &every, nullptr);
  std::mt19937 rng(3);
  // Long reductions (weight gradients sum over tokens) take the kernels
  // that move the stack.
  const Case shapes[] = {{128, 128, 256, false, false, 1.0f, 0.0f},
                         {64, 256, 320, true, false, 1.0f, 1.0f},
                         {128, 256, 64, false, true, 1.0f, 0.0f}};
  for (const Case &t : shapes) {
    Stored a = makeOperand(t.m, t.k, t.ta, rng);
    Stored b = makeOperand(t.k, t.n, t.tb, rng);
    for (int round = 0; round < 2000; ++round) {
      std::vector<float> c(t.m * t.n, 0.5f);
      gemm(t.m, t.n, t.k, t.alpha, {a.data.data(), a.ld, t.ta},
           {b.data.data(), b.ld, t.tb}, t.beta, c.data(), t.n);
    }
  }
  struct itimerval off = {};
  setitimer(ITIMER_REAL, &off, nullptr);
  std::exit(alarms > 0 ? 0 : 3);
}

// A signal handler that runs while a thread is inside oneDNN's AVX-512
// sgemm gets its frame written into the heap (the kernel's stack pointer
// points into a buffer of its own): before the fix this child died of
// SIGFPE, SIGSEGV or a glibc heap check within a fraction of a second, on
// a machine with AVX-512 (elsewhere oneDNN's kernels keep the stack and the
// test cannot fail). A timer raises SIGALRM every 37 us, on whichever
// thread of the pool it lands, while GEMMs of the sizes the models use run.
TEST(GemmTest, SignalHandlersDuringAGemmLeaveTheHeapWhole) {
  std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(gemmsUnderSignals(), ::testing::ExitedWithCode(0), "");
  GTEST_FLAG_SET(death_test_style, style);
}

} // namespace
