//===- cpu_gemm.cpp - Single-threaded sgemm of the BLAS candidates --------===//
//
// One binary per library (benchmarks/cpu_gemm.sh compiles this file against
// each that is installed): single-threaded fp32 GEMM on the shapes the cpu
// backend's kernels call (cpu/Gemm.h: 128-row tiles of the linear ops, the
// attention blocks, a 3D-DSA tile), best of three timings of each, as
// GFLOP/s, one line per shape. The caller interleaves the libraries.
//
//===----------------------------------------------------------------------===//

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#if defined(USE_DNNL)
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
static void sgemm(bool tb, int m, int n, int k, const float *a, const float *b,
                  float *c) {
  dnnl_sgemm('N', tb ? 'T' : 'N', m, n, k, 1.0f, a, k, b, tb ? k : n, 1.0f, c,
             n);
}
static void setup() { omp_set_num_threads(1); }
#else
#include <cblas.h>
static void sgemm(bool tb, int m, int n, int k, const float *a, const float *b,
                  float *c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m,
              n, k, 1.0f, a, k, b, tb ? k : n, 1.0f, c, n);
}
static void setup() {}
#endif

int main() {
  setup();
  struct Shape {
    int m, n, k;
    bool tb;
    const char *what;
  } shapes[] = {
      {128, 512, 512, true, "linear tile, d512"},
      {128, 1536, 512, true, "ffn up tile"},
      {128, 512, 1536, true, "ffn down tile"},
      {128, 512, 4096, true, "text projection tile"},
      {64, 1024, 64, true, "attention S = Q K^T"},
      {64, 64, 1024, false, "attention O = P V"},
      {1024, 64, 64, false, "attention dK block"},
      {24, 480, 64, true, "3D-DSA tile S"},
  };
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (const Shape &s : shapes) {
    std::vector<float> a(size_t(s.m) * s.k), b(size_t(s.k) * s.n),
        c(size_t(s.m) * s.n);
    for (float &x : a)
      x = dist(rng);
    for (float &x : b)
      x = dist(rng);
    double flops = 2.0 * s.m * s.n * s.k;
    int reps = int(1e9 / flops) + 1;
    sgemm(s.tb, s.m, s.n, s.k, a.data(), b.data(), c.data());
    double best = 1e30;
    for (int t = 0; t < 3; ++t) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r)
        sgemm(s.tb, s.m, s.n, s.k, a.data(), b.data(), c.data());
      std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      best = std::min(best, dt.count() / reps);
    }
    std::printf("%s\t%d\t%d\t%d\t%.1f\n", s.what, s.m, s.n, s.k,
                flops / best / 1e9);
  }
}
