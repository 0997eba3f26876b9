//===- Dsa3dCpuTest.cpp - CPU 3D-DSA kernels against naive references -----===//
//
// dsa3dForward, dsa3dBackward and dsa3dOffsets (runtime/cpu/Dsa3d.cpp) on
// random shapes with fixed seeds, against references written here from
// docs/Dsa3d.md alone: each query's explicit key list, a direct softmax over it
// in double precision, analytic gradients, central finite differences, and
// block matching by direct window means. Covered: partial border tiles,
// windows equal to the grid (dense attention), offsets pushing windows past
// the borders, batch and heads > 1, head dims 8..64, the Python
// [B, H, T, Y, X, D] and graph [B, N, H, D] layouts, tiles and windows
// larger than the kernels' query and key chunks, tie-breaking and
// thread-count independence.
//
// Tolerances (the kernels accumulate in fp32, the references in double):
//   forward:           |got - ref| <= 1e-5 + 1e-4 |ref|
//   backward analytic: |got - ref| <= 1e-4 max(1, max|ref|) + 1e-4 |ref|
//   finite differences (eps 1e-3, truncation ~1e-6):
//                      |got - ref| <= 1e-4 max(1, max|ref|) + 1e-3 |ref|
//   offsets:           exact equality
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/ScopedThreads.h"
#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/WorkerPool.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

using namespace megaslide::cpu;

namespace {

//===----------------------------------------------------------------------===//
// Problems
//===----------------------------------------------------------------------===//

/// Inputs of one call; q, k, v in the Python layout [B, H, N, D].
struct Problem {
  Dsa3dConfig cfg;
  std::vector<float> q, k, v;
  std::vector<int32_t> offsets;
};

Dsa3dConfig makeConfig(int64_t batch, int64_t heads,
                       std::array<int64_t, 3> grid, int64_t headDim,
                       std::array<int64_t, 3> window,
                       std::array<int64_t, 3> tile) {
  Dsa3dConfig cfg;
  cfg.batch = batch;
  cfg.heads = heads;
  cfg.T = grid[0];
  cfg.Y = grid[1];
  cfg.X = grid[2];
  cfg.headDim = headDim;
  cfg.window = window;
  cfg.tile = tile;
  cfg.scale = 1.0 / std::sqrt(static_cast<double>(headDim));
  return cfg;
}

int64_t tensorSize(const Dsa3dConfig &cfg) {
  return cfg.batch * cfg.heads * cfg.tokens() * cfg.headDim;
}

/// Random q, k, v (normal, sd 1.5 so softmaxes are far from uniform) and
/// offsets uniform in [-maxOffset, maxOffset].
Problem makeProblem(const Dsa3dConfig &cfg, unsigned seed, int maxOffset) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::uniform_int_distribution<int32_t> offset(-maxOffset, maxOffset);
  Problem p;
  p.cfg = cfg;
  for (std::vector<float> *t : {&p.q, &p.k, &p.v}) {
    t->resize(tensorSize(cfg));
    for (float &x : *t)
      x = normal(rng);
  }
  p.offsets.resize(cfg.offsetsSize());
  for (int32_t &o : p.offsets)
    o = offset(rng);
  return p;
}

/// A random configuration: grids up to 5x6x6, any tile (so border tiles
/// are usually partial), any window up to the grid.
Dsa3dConfig randomConfig(std::mt19937 &rng) {
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::array<int64_t, 3> grid{uniform(1, 5), uniform(1, 6), uniform(1, 6)};
  std::array<int64_t, 3> window, tile;
  for (int a = 0; a < 3; ++a) {
    window[a] = uniform(1, grid[a]);
    tile[a] = uniform(1, grid[a]);
  }
  static const int64_t dims[] = {8, 12, 16, 32, 64};
  return makeConfig(uniform(1, 2), uniform(1, 3), grid, dims[uniform(0, 4)],
                    window, tile);
}

std::string describe(const Dsa3dConfig &c) {
  std::ostringstream os;
  os << "B=" << c.batch << " H=" << c.heads << " grid=" << c.T << "x" << c.Y
     << "x" << c.X << " D=" << c.headDim << " window=" << c.window[0] << "x"
     << c.window[1] << "x" << c.window[2] << " tile=" << c.tile[0] << "x"
     << c.tile[1] << "x" << c.tile[2];
  return os.str();
}

/// [B, H, N, D] <-> [B, N, H, D].
template <typename T>
std::vector<T> toGraphLayout(const Dsa3dConfig &c, const std::vector<T> &x) {
  std::vector<T> y(x.size());
  int64_t N = c.tokens(), H = c.heads, D = c.headDim;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          y[((b * N + n) * H + h) * D + d] = x[((b * H + h) * N + n) * D + d];
  return y;
}

template <typename T>
std::vector<T> fromGraphLayout(const Dsa3dConfig &c, const std::vector<T> &y) {
  std::vector<T> x(y.size());
  int64_t N = c.tokens(), H = c.heads, D = c.headDim;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d)
          x[((b * H + h) * N + n) * D + d] = y[((b * N + n) * H + h) * D + d];
  return x;
}

//===----------------------------------------------------------------------===//
// Naive references (from docs/Dsa3d.md; no code shared with the kernels)
//===----------------------------------------------------------------------===//

/// ⌊(first + last) / 2⌋ of the tile containing index i along one axis.
int64_t tileCentre(int64_t i, int64_t tile, int64_t extent) {
  int64_t first = i / tile * tile;
  int64_t last = std::min(first + tile, extent) - 1;
  return (first + last) / 2;
}

int64_t clampTo(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

/// The explicit key list of query token n of head (b, h).
std::vector<int64_t> naiveKeys(const Dsa3dConfig &c,
                               const std::vector<int32_t> &offsets, int64_t b,
                               int64_t h, int64_t n) {
  int64_t t = n / (c.Y * c.X), y = n / c.X % c.Y, x = n % c.X;
  int64_t kt = c.window[0], ky = c.window[1], kx = c.window[2];
  int64_t nT = (c.T + c.tile[0] - 1) / c.tile[0];
  int64_t nY = (c.Y + c.tile[1] - 1) / c.tile[1];
  int64_t nX = (c.X + c.tile[2] - 1) / c.tile[2];
  int64_t it = t / c.tile[0], iy = y / c.tile[1], ix = x / c.tile[2];
  int64_t st = clampTo(tileCentre(t, c.tile[0], c.T) - kt / 2, 0, c.T - kt);
  int64_t cy = tileCentre(y, c.tile[1], c.Y);
  int64_t cx = tileCentre(x, c.tile[2], c.X);
  std::vector<int64_t> keys;
  for (int64_t j = 0; j < kt; ++j) {
    int64_t base =
        ((((b * c.heads + h) * nT + it) * nY + iy) * nX + ix) * kt + j;
    int64_t dy = offsets[2 * base], dx = offsets[2 * base + 1];
    int64_t sy = clampTo(cy + dy - ky / 2, 0, c.Y - ky);
    int64_t sx = clampTo(cx + dx - kx / 2, 0, c.X - kx);
    for (int64_t yy = sy; yy < sy + ky; ++yy)
      for (int64_t xx = sx; xx < sx + kx; ++xx)
        keys.push_back(((st + j) * c.Y + yy) * c.X + xx);
  }
  return keys;
}

/// All tokens: what a window equal to the grid must reduce to.
std::vector<int64_t> allKeys(const Dsa3dConfig &c, const std::vector<int32_t> &,
                             int64_t, int64_t, int64_t) {
  std::vector<int64_t> keys(c.tokens());
  for (int64_t n = 0; n < c.tokens(); ++n)
    keys[n] = n;
  return keys;
}

using KeyFn = std::vector<int64_t> (*)(const Dsa3dConfig &,
                                       const std::vector<int32_t> &, int64_t,
                                       int64_t, int64_t);

/// Softmax attention over the given key lists, in double; [B, H, N, D].
std::vector<double>
naiveForward(const Dsa3dConfig &c, const std::vector<double> &q,
             const std::vector<double> &k, const std::vector<double> &v,
             const std::vector<int32_t> &offsets, KeyFn keysOf = naiveKeys) {
  int64_t N = c.tokens(), D = c.headDim;
  std::vector<double> out(q.size(), 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h) {
      int64_t base = (b * c.heads + h) * N;
      for (int64_t n = 0; n < N; ++n) {
        std::vector<int64_t> keys = keysOf(c, offsets, b, h, n);
        std::vector<double> logits;
        for (int64_t key : keys) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += q[(base + n) * D + d] * k[(base + key) * D + d];
          logits.push_back(c.scale * s);
        }
        double m = *std::max_element(logits.begin(), logits.end()), sum = 0;
        for (double &s : logits)
          sum += (s = std::exp(s - m));
        for (size_t i = 0; i < keys.size(); ++i)
          for (int64_t d = 0; d < D; ++d)
            out[(base + n) * D + d] +=
                logits[i] / sum * v[(base + keys[i]) * D + d];
      }
    }
  return out;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

/// Analytic gradients of sum(out * dout) in double:
/// dS_ij = P_ij (dO_i . v_j - sum_l P_il dO_i . v_l).
Grads naiveBackward(const Dsa3dConfig &c, const std::vector<double> &q,
                    const std::vector<double> &k, const std::vector<double> &v,
                    const std::vector<int32_t> &offsets,
                    const std::vector<double> &dout) {
  int64_t N = c.tokens(), D = c.headDim;
  Grads g{std::vector<double>(q.size()), std::vector<double>(q.size()),
          std::vector<double>(q.size())};
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h) {
      int64_t base = (b * c.heads + h) * N;
      for (int64_t n = 0; n < N; ++n) {
        std::vector<int64_t> keys = naiveKeys(c, offsets, b, h, n);
        std::vector<double> p, dp;
        for (int64_t key : keys) {
          double s = 0, g2 = 0;
          for (int64_t d = 0; d < D; ++d) {
            s += q[(base + n) * D + d] * k[(base + key) * D + d];
            g2 += dout[(base + n) * D + d] * v[(base + key) * D + d];
          }
          p.push_back(c.scale * s);
          dp.push_back(g2);
        }
        double m = *std::max_element(p.begin(), p.end()), sum = 0;
        for (double &s : p)
          sum += (s = std::exp(s - m));
        double expected = 0;
        for (size_t i = 0; i < keys.size(); ++i)
          expected += (p[i] /= sum) * dp[i];
        for (size_t i = 0; i < keys.size(); ++i) {
          double ds = p[i] * (dp[i] - expected);
          for (int64_t d = 0; d < D; ++d) {
            g.dv[(base + keys[i]) * D + d] += p[i] * dout[(base + n) * D + d];
            g.dq[(base + n) * D + d] +=
                c.scale * ds * k[(base + keys[i]) * D + d];
            g.dk[(base + keys[i]) * D + d] +=
                c.scale * ds * q[(base + n) * D + d];
          }
        }
      }
    }
  return g;
}

/// Block matching by direct window means, the tie rule spelled out.
std::vector<int32_t> naiveOffsets(const Dsa3dConfig &c,
                                  const std::vector<double> &q,
                                  const std::vector<double> &k,
                                  int64_t radius) {
  int64_t N = c.tokens(), D = c.headDim;
  int64_t kt = c.window[0], ky = c.window[1], kx = c.window[2];
  int64_t tt = c.tile[0], ty = c.tile[1], tx = c.tile[2];
  int64_t nT = (c.T + tt - 1) / tt, nY = (c.Y + ty - 1) / ty,
          nX = (c.X + tx - 1) / tx;
  std::vector<int32_t> out(c.offsetsSize());
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h) {
      int64_t base = (b * c.heads + h) * N;
      for (int64_t it = 0; it < nT; ++it)
        for (int64_t iy = 0; iy < nY; ++iy)
          for (int64_t ix = 0; ix < nX; ++ix) {
            std::vector<double> qMean(D, 0.0);
            int64_t count = 0;
            for (int64_t t = it * tt; t < std::min((it + 1) * tt, c.T); ++t)
              for (int64_t y = iy * ty; y < std::min((iy + 1) * ty, c.Y); ++y)
                for (int64_t x = ix * tx; x < std::min((ix + 1) * tx, c.X);
                     ++x, ++count)
                  for (int64_t d = 0; d < D; ++d)
                    qMean[d] += q[(base + (t * c.Y + y) * c.X + x) * D + d];
            for (double &m : qMean)
              m /= count;
            int64_t st =
                clampTo(tileCentre(it * tt, tt, c.T) - kt / 2, 0, c.T - kt);
            int64_t cy = tileCentre(iy * ty, ty, c.Y);
            int64_t cx = tileCentre(ix * tx, tx, c.X);
            for (int64_t j = 0; j < kt; ++j) {
              double best = 0;
              int64_t bestDy = 0, bestDx = 0;
              bool have = false;
              for (int64_t dy = -radius; dy <= radius; ++dy)
                for (int64_t dx = -radius; dx <= radius; ++dx) {
                  int64_t sy = clampTo(cy + dy - ky / 2, 0, c.Y - ky);
                  int64_t sx = clampTo(cx + dx - kx / 2, 0, c.X - kx);
                  std::vector<double> kMean(D, 0.0);
                  for (int64_t y = sy; y < sy + ky; ++y)
                    for (int64_t x = sx; x < sx + kx; ++x)
                      for (int64_t d = 0; d < D; ++d)
                        kMean[d] +=
                            k[(base + ((st + j) * c.Y + y) * c.X + x) * D + d];
                  double score = 0;
                  for (int64_t d = 0; d < D; ++d)
                    score += qMean[d] * (kMean[d] / (ky * kx));
                  auto rank = [](int64_t a, int64_t b) {
                    return std::make_tuple(std::abs(a) + std::abs(b), a, b);
                  };
                  if (!have || score > best ||
                      (score == best && rank(dy, dx) < rank(bestDy, bestDx))) {
                    have = true;
                    best = score;
                    bestDy = dy;
                    bestDx = dx;
                  }
                }
              int64_t o =
                  ((((b * c.heads + h) * nT + it) * nY + iy) * nX + ix) * kt +
                  j;
              out[2 * o] = static_cast<int32_t>(bestDy);
              out[2 * o + 1] = static_cast<int32_t>(bestDx);
            }
          }
    }
  return out;
}

//===----------------------------------------------------------------------===//
// Running the kernels
//===----------------------------------------------------------------------===//

std::vector<double> toDouble(const std::vector<float> &x) {
  return std::vector<double>(x.begin(), x.end());
}

enum class Layout { Python, Graph };

template <typename Elem>
Dsa3dView<Elem> view(Layout layout, Elem *data, const Dsa3dConfig &cfg) {
  return layout == Layout::Python ? dsa3dPythonLayout(data, cfg)
                                  : dsa3dGraphLayout(data, cfg);
}

/// Forward in the given layout; returns out in [B, H, N, D] and lse.
std::vector<float> runForward(const Problem &p, Layout layout,
                              std::vector<float> *lseOut = nullptr) {
  const Dsa3dConfig &c = p.cfg;
  bool graph = layout == Layout::Graph;
  std::vector<float> q = graph ? toGraphLayout(c, p.q) : p.q;
  std::vector<float> k = graph ? toGraphLayout(c, p.k) : p.k;
  std::vector<float> v = graph ? toGraphLayout(c, p.v) : p.v;
  std::vector<float> out(q.size(), NAN), lse(c.batch * c.heads * c.tokens());
  dsa3dForward(c, view(layout, q.data(), c), view(layout, k.data(), c),
               view(layout, v.data(), c), p.offsets.data(),
               view(layout, out.data(), c), lse.data());
  if (lseOut)
    *lseOut = lse;
  return graph ? fromGraphLayout(c, out) : out;
}

struct FloatGrads {
  std::vector<float> dq, dk, dv;
};

FloatGrads runBackward(const Problem &p, const std::vector<float> &dout,
                       Layout layout) {
  const Dsa3dConfig &c = p.cfg;
  std::vector<float> lse;
  std::vector<float> out = runForward(p, layout, &lse);
  auto to = [&](const std::vector<float> &x) {
    return layout == Layout::Graph ? toGraphLayout(c, x) : x;
  };
  std::vector<float> q = to(p.q), k = to(p.k), v = to(p.v), o = to(out),
                     g = to(dout);
  // Garbage in the gradients checks that they are overwritten.
  std::vector<float> dq(q.size(), 7.0f), dk(q.size(), 7.0f), dv(q.size(), 7.0f);
  dsa3dBackward(c, view(layout, q.data(), c), view(layout, k.data(), c),
                view(layout, v.data(), c), p.offsets.data(),
                view(layout, o.data(), c), view(layout, g.data(), c),
                lse.data(), view(layout, dq.data(), c),
                view(layout, dk.data(), c), view(layout, dv.data(), c));
  auto from = [&](const std::vector<float> &x) {
    return layout == Layout::Graph ? fromGraphLayout(c, x) : x;
  };
  return {from(dq), from(dk), from(dv)};
}

std::vector<int32_t> runOffsets(const Problem &p, int64_t radius,
                                Layout layout = Layout::Python) {
  const Dsa3dConfig &c = p.cfg;
  bool graph = layout == Layout::Graph;
  std::vector<float> q = graph ? toGraphLayout(c, p.q) : p.q;
  std::vector<float> k = graph ? toGraphLayout(c, p.k) : p.k;
  std::vector<int32_t> offsets(c.offsetsSize(), -999);
  dsa3dOffsets(c, view(layout, q.data(), c), view(layout, k.data(), c), radius,
               offsets.data());
  return offsets;
}

/// Empty if |got - ref| <= atol + rtol |ref| everywhere, else the worst
/// element.
std::string compare(const std::vector<float> &got,
                    const std::vector<double> &ref, double atol, double rtol) {
  if (got.size() != ref.size())
    return "size mismatch";
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double excess =
        std::abs(got[i] - ref[i]) - (atol + rtol * std::abs(ref[i]));
    if (!(excess <= worst) || std::isnan(got[i])) {
      worst = std::isnan(got[i]) ? INFINITY : excess;
      at = i;
    }
  }
  if (worst <= 0)
    return {};
  std::ostringstream os;
  os << "element " << at << ": got " << got[at] << ", expected " << ref[at]
     << " (atol " << atol << ", rtol " << rtol << ")";
  return os.str();
}

double maxAbs(const std::vector<double> &x) {
  double m = 0;
  for (double v : x)
    m = std::max(m, std::abs(v));
  return m;
}

constexpr double kFwdAtol = 1e-5, kFwdRtol = 1e-4;
constexpr double kBwdTol = 1e-4;
constexpr double kFdRtol = 1e-3;

//===----------------------------------------------------------------------===//
// Tests
//===----------------------------------------------------------------------===//

TEST(Dsa3dCpuTest, ValidateRejectsBadConfigs) {
  Dsa3dConfig ok = makeConfig(1, 2, {3, 4, 5}, 8, {3, 2, 5}, {1, 3, 9});
  EXPECT_EQ(ok.validate(), "");
  Dsa3dConfig c = ok;
  c.heads = 0;
  EXPECT_EQ(c.validate(), "heads must be positive, got 0");
  c = ok;
  c.X = -1;
  EXPECT_EQ(c.validate(), "X must be positive, got -1");
  c = ok;
  c.tile[2] = 0;
  EXPECT_NE(c.validate().find("window and tile must be positive"),
            std::string::npos);
  c = ok;
  c.window[1] = 5;
  EXPECT_EQ(c.validate(), "window extent 5 along y exceeds the grid extent 4");
  c = ok;
  c.scale = 0;
  EXPECT_NE(c.validate().find("scale must be positive"), std::string::npos);
  EXPECT_EQ(ok.numTiles(), (std::array<int64_t, 3>{3, 2, 1}));
  EXPECT_EQ(ok.offsetsSize(), 1 * 2 * 3 * 2 * 1 * 3 * 2);
}

TEST(Dsa3dCpuTest, ForwardMatchesNaiveOnRandomShapes) {
  std::mt19937 rng(20240611);
  for (int trial = 0; trial < 40; ++trial) {
    Dsa3dConfig c = randomConfig(rng);
    Problem p = makeProblem(c, 1000 + trial, 3);
    std::vector<double> ref =
        naiveForward(c, toDouble(p.q), toDouble(p.k), toDouble(p.v), p.offsets);
    for (Layout layout : {Layout::Python, Layout::Graph}) {
      std::vector<float> lse;
      EXPECT_EQ(compare(runForward(p, layout, &lse), ref, kFwdAtol, kFwdRtol),
                "")
          << describe(c) << (layout == Layout::Graph ? " graph" : " python");
    }
  }
}

TEST(Dsa3dCpuTest, ForwardLogSumExpMatchesNaive) {
  Dsa3dConfig c = makeConfig(2, 2, {3, 5, 4}, 16, {2, 3, 2}, {2, 2, 3});
  Problem p = makeProblem(c, 7, 2);
  std::vector<float> lse;
  runForward(p, Layout::Python, &lse);
  std::vector<double> ref;
  int64_t N = c.tokens(), D = c.headDim;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t n = 0; n < N; ++n) {
        int64_t base = (b * c.heads + h) * N;
        double sum = 0;
        for (int64_t key : naiveKeys(c, p.offsets, b, h, n)) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += double(p.q[(base + n) * D + d]) * p.k[(base + key) * D + d];
          sum += std::exp(c.scale * s);
        }
        ref.push_back(std::log(sum));
      }
  EXPECT_EQ(compare(lse, ref, kFwdAtol, kFwdRtol), "");
}

TEST(Dsa3dCpuTest, WindowEqualToGridIsDenseAttention) {
  std::mt19937 rng(77);
  const int64_t dims[] = {8, 16, 32, 64};
  for (int trial = 0; trial < 8; ++trial) {
    auto uniform = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    std::array<int64_t, 3> grid{uniform(1, 4), uniform(1, 7), uniform(1, 7)};
    std::array<int64_t, 3> tile{uniform(1, grid[0]), uniform(1, grid[1]),
                                uniform(1, grid[2])};
    Dsa3dConfig c = makeConfig(uniform(1, 2), uniform(1, 2), grid,
                               dims[trial % 4], grid, tile);
    // Offsets are irrelevant once the window covers the grid: clamping
    // pins every window to the whole grid.
    Problem p = makeProblem(c, 500 + trial, 5);
    std::vector<double> dense = naiveForward(c, toDouble(p.q), toDouble(p.k),
                                             toDouble(p.v), p.offsets, allKeys);
    for (Layout layout : {Layout::Python, Layout::Graph})
      EXPECT_EQ(compare(runForward(p, layout), dense, kFwdAtol, kFwdRtol), "")
          << describe(c);
  }
}

TEST(Dsa3dCpuTest, OffsetsPastTheBorderAreClamped) {
  // 2 frames of 8x8, windows 2x3x3, tiles 1x4x4: tile centres are 1 and 5.
  Dsa3dConfig c = makeConfig(1, 2, {2, 8, 8}, 16, {2, 3, 3}, {1, 4, 4});
  Problem far = makeProblem(c, 11, 0);
  Problem edge = far;
  // Far offsets overshoot every border; edge offsets land each window
  // exactly on the border it was pushed against.
  for (size_t i = 0; i < far.offsets.size(); i += 2) {
    int64_t tileIndex = i / 2 / c.window[0];
    int64_t iy = tileIndex / 2 % 2, ix = tileIndex % 2;
    int64_t cy = iy == 0 ? 1 : 5, cx = ix == 0 ? 1 : 5;
    int32_t sign = (i / 2) % 2 == 0 ? 1 : -1;
    far.offsets[i] = 100 * sign;
    far.offsets[i + 1] = -1000 * sign;
    // s = c + d - 1 clamped to [0, 5]: d = 6 - c reaches 5, d = 1 - c
    // reaches 0.
    edge.offsets[i] = sign > 0 ? 6 - cy : 1 - cy;
    edge.offsets[i + 1] = sign > 0 ? 1 - cx : 6 - cx;
  }
  std::vector<double> ref = naiveForward(c, toDouble(far.q), toDouble(far.k),
                                         toDouble(far.v), far.offsets);
  std::vector<float> gotFar = runForward(far, Layout::Python);
  EXPECT_EQ(compare(gotFar, ref, kFwdAtol, kFwdRtol), "");
  EXPECT_EQ(gotFar, runForward(edge, Layout::Python));
  // And the clamp changes the result relative to zero offsets.
  Problem zero = far;
  std::fill(zero.offsets.begin(), zero.offsets.end(), 0);
  EXPECT_NE(gotFar, runForward(zero, Layout::Python));
}

TEST(Dsa3dCpuTest, BackwardMatchesNaiveGradients) {
  std::mt19937 rng(4242);
  for (int trial = 0; trial < 25; ++trial) {
    Dsa3dConfig c = trial == 0 ? makeConfig(2, 2, {3, 4, 5}, 16, {3, 4, 5},
                                            {2, 3, 2}) // dense
                               : randomConfig(rng);
    Problem p = makeProblem(c, 3000 + trial, 4);
    std::vector<float> dout = makeProblem(c, 9000 + trial, 0).q;
    Grads ref = naiveBackward(c, toDouble(p.q), toDouble(p.k), toDouble(p.v),
                              p.offsets, toDouble(dout));
    for (Layout layout : {Layout::Python, Layout::Graph}) {
      FloatGrads got = runBackward(p, dout, layout);
      const char *name = layout == Layout::Graph ? " graph" : " python";
      EXPECT_EQ(compare(got.dq, ref.dq, kBwdTol * std::max(1.0, maxAbs(ref.dq)),
                        kBwdTol),
                "")
          << "dq " << describe(c) << name;
      EXPECT_EQ(compare(got.dk, ref.dk, kBwdTol * std::max(1.0, maxAbs(ref.dk)),
                        kBwdTol),
                "")
          << "dk " << describe(c) << name;
      EXPECT_EQ(compare(got.dv, ref.dv, kBwdTol * std::max(1.0, maxAbs(ref.dv)),
                        kBwdTol),
                "")
          << "dv " << describe(c) << name;
    }
  }
}

TEST(Dsa3dCpuTest, BackwardMatchesFiniteDifferences) {
  // loss = sum(out * W) through the double-precision naive forward, central
  // differences with eps 1e-3 on every element of q, k and v.
  const Dsa3dConfig configs[] = {
      makeConfig(1, 2, {3, 3, 4}, 8, {2, 2, 3}, {2, 2, 3}),
      makeConfig(2, 1, {2, 5, 3}, 12, {2, 3, 2}, {1, 2, 2}),
      makeConfig(1, 1, {2, 3, 3}, 8, {2, 3, 3}, {1, 2, 2}), // dense
  };
  unsigned seed = 60;
  for (const Dsa3dConfig &c : configs) {
    Problem p = makeProblem(c, seed++, 3);
    std::vector<float> w = makeProblem(c, seed++, 0).v;
    std::vector<double> q = toDouble(p.q), k = toDouble(p.k), v = toDouble(p.v),
                        wd = toDouble(w);
    auto loss = [&] {
      std::vector<double> out = naiveForward(c, q, k, v, p.offsets);
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i)
        l += out[i] * wd[i];
      return l;
    };
    const double eps = 1e-3;
    auto numeric = [&](std::vector<double> &x) {
      std::vector<double> g(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        double saved = x[i];
        x[i] = saved + eps;
        double up = loss();
        x[i] = saved - eps;
        double down = loss();
        x[i] = saved;
        g[i] = (up - down) / (2 * eps);
      }
      return g;
    };
    std::vector<double> nq = numeric(q), nk = numeric(k), nv = numeric(v);
    for (Layout layout : {Layout::Python, Layout::Graph}) {
      FloatGrads got = runBackward(p, w, layout);
      EXPECT_EQ(
          compare(got.dq, nq, kBwdTol * std::max(1.0, maxAbs(nq)), kFdRtol), "")
          << "dq " << describe(c);
      EXPECT_EQ(
          compare(got.dk, nk, kBwdTol * std::max(1.0, maxAbs(nk)), kFdRtol), "")
          << "dk " << describe(c);
      EXPECT_EQ(
          compare(got.dv, nv, kBwdTol * std::max(1.0, maxAbs(nv)), kFdRtol), "")
          << "dv " << describe(c);
    }
  }
}

TEST(Dsa3dCpuTest, LargeTilesAndWindowsMatchNaive) {
  // Tiles of 144 queries and windows of over 1,024 keys: more than one
  // query chunk (128) and key chunk (1,024, with an online softmax) of the
  // kernels, keys and queries both gathered and read in place (consecutive
  // tokens).
  const Dsa3dConfig configs[] = {
      makeConfig(1, 1, {2, 24, 48}, 8, {1, 24, 48}, {1, 12, 12}),
      makeConfig(1, 2, {2, 24, 48}, 8, {2, 20, 30}, {1, 3, 48}),
  };
  unsigned seed = 80;
  for (const Dsa3dConfig &c : configs) {
    Problem p = makeProblem(c, seed++, 4);
    std::vector<float> dout = makeProblem(c, seed++, 0).q;
    std::vector<double> q = toDouble(p.q), k = toDouble(p.k), v = toDouble(p.v);
    std::vector<double> ref = naiveForward(c, q, k, v, p.offsets);
    Grads grads = naiveBackward(c, q, k, v, p.offsets, toDouble(dout));
    for (Layout layout : {Layout::Python, Layout::Graph}) {
      const char *name = layout == Layout::Graph ? " graph" : " python";
      EXPECT_EQ(compare(runForward(p, layout), ref, kFwdAtol, kFwdRtol), "")
          << describe(c) << name;
      FloatGrads got = runBackward(p, dout, layout);
      const std::tuple<const char *, const std::vector<float> *,
                       const std::vector<double> *>
          checks[] = {{"dq ", &got.dq, &grads.dq},
                      {"dk ", &got.dk, &grads.dk},
                      {"dv ", &got.dv, &grads.dv}};
      for (auto [what, g, r] : checks)
        EXPECT_EQ(compare(*g, *r, kBwdTol * std::max(1.0, maxAbs(*r)), kBwdTol),
                  "")
            << what << describe(c) << name;
    }
  }
}

TEST(Dsa3dCpuTest, OffsetsMatchNaiveBlockMatching) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 40; ++trial) {
    Dsa3dConfig c = randomConfig(rng);
    Problem p = makeProblem(c, 7000 + trial, 0);
    int64_t radius = trial % 4;
    std::vector<int32_t> ref =
        naiveOffsets(c, toDouble(p.q), toDouble(p.k), radius);
    EXPECT_EQ(runOffsets(p, radius), ref) << describe(c) << " R=" << radius;
    EXPECT_EQ(runOffsets(p, radius, Layout::Graph), ref)
        << describe(c) << " R=" << radius << " graph";
  }
}

TEST(Dsa3dCpuTest, OffsetsFollowPlantedMotion) {
  // Keys of frame 1 are the keys of frame 0 shifted by (+2, -1) with a
  // smooth background elsewhere; the query tile equals the frame-0 patch,
  // so the best match at frame 1 moves with the content.
  Dsa3dConfig c = makeConfig(1, 1, {2, 12, 12}, 8, {2, 3, 3}, {2, 3, 3});
  Problem p = makeProblem(c, 5, 0);
  auto at = [&](int64_t t, int64_t y, int64_t x, int64_t d) {
    return ((t * c.Y + y) * c.X + x) * c.headDim + d;
  };
  std::fill(p.k.begin(), p.k.end(), 0.0f);
  std::fill(p.q.begin(), p.q.end(), 0.0f);
  for (int64_t d = 0; d < c.headDim; ++d) {
    // A bright 3x3 patch around (4, 4) in frame 0 and around (6, 3) in
    // frame 1; every query of the tile at (3..5, 3..5) looks like it.
    for (int64_t y = 3; y <= 5; ++y)
      for (int64_t x = 3; x <= 5; ++x) {
        p.k[at(0, y, x, d)] = 1.0f + d;
        p.k[at(1, y + 2, x - 1, d)] = 1.0f + d;
        p.q[at(0, y, x, d)] = p.q[at(1, y, x, d)] = 1.0f + d;
      }
  }
  std::vector<int32_t> offsets = runOffsets(p, 3);
  EXPECT_EQ(offsets, naiveOffsets(c, toDouble(p.q), toDouble(p.k), 3));
  // Tile (0, 1, 1) covers y, x in [3, 6): centre (4, 4).
  int64_t tileIndex = (0 * 4 + 1) * 4 + 1;
  EXPECT_EQ(offsets[(tileIndex * 2 + 0) * 2 + 0], 0);
  EXPECT_EQ(offsets[(tileIndex * 2 + 0) * 2 + 1], 0);
  EXPECT_EQ(offsets[(tileIndex * 2 + 1) * 2 + 0], 2);
  EXPECT_EQ(offsets[(tileIndex * 2 + 1) * 2 + 1], -1);
}

TEST(Dsa3dCpuTest, OffsetsTieWithConstantKeysIsZero) {
  Dsa3dConfig c = makeConfig(2, 2, {3, 7, 9}, 16, {2, 3, 3}, {2, 2, 4});
  Problem p = makeProblem(c, 3, 0);
  std::fill(p.k.begin(), p.k.end(), 0.3f);
  for (int64_t radius : {0, 1, 3, 6}) {
    std::vector<int32_t> offsets = runOffsets(p, radius);
    EXPECT_TRUE(std::all_of(offsets.begin(), offsets.end(),
                            [](int32_t o) { return o == 0; }))
        << "R=" << radius;
  }
}

TEST(Dsa3dCpuTest, OffsetsTieBreakOrder) {
  // 1x1 windows and 1x1 tiles: the score of (dy, dx) is q . k at
  // (centre + dy, centre + dx). Bright keys at equally good displacements
  // pick the smallest |dy| + |dx|, then the smallest dy, then dx.
  Dsa3dConfig c = makeConfig(1, 1, {1, 5, 5}, 8, {1, 1, 1}, {1, 1, 1});
  auto estimate = [&](std::vector<std::pair<int, int>> bright) {
    Problem p = makeProblem(c, 1, 0);
    std::fill(p.q.begin(), p.q.end(), 1.0f);
    std::fill(p.k.begin(), p.k.end(), 0.0f);
    for (auto [dy, dx] : bright)
      for (int64_t d = 0; d < c.headDim; ++d)
        p.k[((2 + dy) * c.X + (2 + dx)) * c.headDim + d] = 1.0f;
    std::vector<int32_t> all = runOffsets(p, 2);
    int64_t centre = 2 * 5 + 2; // the query tile at (2, 2)
    return std::make_pair(all[centre * 2], all[centre * 2 + 1]);
  };
  using P = std::pair<int32_t, int32_t>;
  EXPECT_EQ(estimate({{-1, 0}, {0, 1}, {1, 0}, {0, -1}}), P(-1, 0));
  EXPECT_EQ(estimate({{0, 1}, {1, 0}, {0, -1}}), P(0, -1));
  EXPECT_EQ(estimate({{0, 1}, {1, 0}}), P(0, 1));
  EXPECT_EQ(estimate({{2, 2}, {1, -1}}), P(1, -1));
  EXPECT_EQ(estimate({{-2, 1}, {2, -1}, {1, 2}}), P(-2, 1));
  EXPECT_EQ(estimate({{2, 2}}), P(2, 2));
  EXPECT_EQ(estimate({}), P(0, 0));
}

TEST(Dsa3dCpuTest, ResultsDoNotDependOnThreadCount) {
  // The second has several query and key chunks per tile (see
  // LargeTilesAndWindowsMatchNaive).
  const Dsa3dConfig configs[] = {
      makeConfig(2, 3, {4, 6, 5}, 32, {3, 3, 3}, {2, 2, 2}),
      makeConfig(1, 3, {2, 24, 48}, 8, {2, 20, 30}, {1, 12, 12}),
  };
  for (const Dsa3dConfig &c : configs) {
    Problem p = makeProblem(c, 21, 2);
    std::vector<float> dout = makeProblem(c, 22, 0).q;
    std::vector<std::vector<float>> outs;
    std::vector<FloatGrads> grads;
    std::vector<std::vector<int32_t>> offsets;
    for (int threads : {1, 3, 8}) {
      megaslide::cpu::test::ScopedThreads scoped(threads);
      EXPECT_EQ(cpuThreads(), threads);
      outs.push_back(runForward(p, Layout::Python));
      grads.push_back(runBackward(p, dout, Layout::Python));
      offsets.push_back(runOffsets(p, 2));
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_EQ(outs[i], outs[0]) << describe(c);
      EXPECT_EQ(grads[i].dq, grads[0].dq) << describe(c);
      EXPECT_EQ(grads[i].dk, grads[0].dk) << describe(c);
      EXPECT_EQ(grads[i].dv, grads[0].dv) << describe(c);
      EXPECT_EQ(offsets[i], offsets[0]) << describe(c);
    }
  }
}

} // namespace
