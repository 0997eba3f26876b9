//===- CpuVideoKernelsTest.cpp - cpu video graph kernels vs references ----===//
//
// The kernels of runtime/cpu/kernels/Video.cpp, called through the graph
// kernel table like the interpreter does, against references written here
// from the op descriptions of dialects/Graph/GraphOps.td (and docs/Dsa3d.md for
// 3D-DSA) in double precision: direct index formulas, explicit softmaxes,
// explicit key windows and block matching. Backward ops are checked against
// central finite differences of the double reference forward for a loss
// sum(G * forward) with random G. Shapes and data are random with fixed
// seeds; thread counts are forced through MEGASLIDE_NUM_THREADS.
//
// Tolerances (kernels accumulate in fp32 or better, references in double):
//   data movement (patchify, unpatchify, embedding):   exact
//   forward: |got - ref| <= 1e-5 + 1e-4 |ref|
//   finite differences (eps 1e-3, truncation ~1e-6):
//            |got - ref| <= 1e-4 max(1, max|ref|) + 1e-3 |ref|
//   rope3d inverse after forward:  |got - x| <= 1e-5 (1 + |x|)
//   attention vs dsa3d with a covering window: forward tolerance
//   offsets: exact equality
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/ScopedThreads.h"
#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/GraphKernels.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <complex>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

using namespace megaslide;
using namespace megaslide::cpu;

namespace {

using Shape = std::vector<int64_t>;
using Triple = std::array<int64_t, 3>;
using Attrs = std::map<std::string, exec::Attr, std::less<>>;

//===----------------------------------------------------------------------===//
// Buffers and running kernels
//===----------------------------------------------------------------------===//

int64_t numel(const Shape &shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

/// A tensor owned by the test. Float results start as NaN so an element a
/// kernel forgets to write is caught.
struct Buf {
  exec::TensorType type;
  std::vector<float> f;
  std::vector<int32_t> i32;
  std::vector<int64_t> i64;

  static Buf floats(Shape shape, std::vector<float> data = {}) {
    Buf b;
    b.type = {exec::DType::F32, shape};
    b.f = data.empty()
              ? std::vector<float>(numel(shape),
                                   std::numeric_limits<float>::quiet_NaN())
              : std::move(data);
    return b;
  }
  static Buf ints32(Shape shape, std::vector<int32_t> data = {}) {
    Buf b;
    b.type = {exec::DType::I32, shape};
    b.i32 =
        data.empty() ? std::vector<int32_t>(numel(shape), -7) : std::move(data);
    return b;
  }
  static Buf ints64(Shape shape, std::vector<int64_t> data) {
    Buf b;
    b.type = {exec::DType::I64, shape};
    b.i64 = std::move(data);
    return b;
  }

  OpTensor view() {
    OpTensor t;
    t.type = type;
    t.f32 = f.empty() ? nullptr : f.data();
    t.i32 = i32.empty() ? nullptr : i32.data();
    t.i64 = i64.empty() ? nullptr : i64.data();
    return t;
  }
};

exec::Instruction inst(std::string op, Attrs attrs = {}) {
  exec::Instruction i;
  i.op = exec::parseOpCode(op).value();
  i.attrs = std::move(attrs);
  return i;
}

/// Runs `in` through the kernel table, as the interpreter does.
llvm::Error run(const exec::Instruction &in, std::vector<Buf *> operands,
                std::vector<Buf *> results) {
  GraphKernel kernel = findGraphKernel(in.op);
  if (!kernel)
    return llvm::createStringError(llvm::Twine("no cpu kernel for ") +
                                   exec::opName(in.op));
  std::vector<OpTensor> ops, res;
  for (Buf *b : operands)
    ops.push_back(b->view());
  for (Buf *b : results)
    res.push_back(b->view());
  return kernel(in, ops, res);
}

/// Runs and fails the test on an error.
#define RUN_OK(...)                                                            \
  do {                                                                         \
    if (llvm::Error err = run(__VA_ARGS__))                                    \
      FAIL() << llvm::toString(std::move(err));                                \
  } while (false)

/// The message of the error `in` produces, or "" when it succeeds.
std::string errorOf(const exec::Instruction &in, std::vector<Buf *> operands,
                    std::vector<Buf *> results) {
  if (llvm::Error err = run(in, std::move(operands), std::move(results)))
    return llvm::toString(std::move(err));
  return "";
}

std::vector<float> randomFloats(int64_t n, std::mt19937 &rng, float lo = -1,
                                float hi = 1) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float &x : v)
    x = dist(rng);
  return v;
}

std::vector<double> toDouble(const std::vector<float> &v) {
  return std::vector<double>(v.begin(), v.end());
}

//===----------------------------------------------------------------------===//
// Comparisons
//===----------------------------------------------------------------------===//

/// |got - ref| <= abs + rel |ref| element-wise; reports the first misses.
void expectClose(const std::vector<float> &got, const std::vector<double> &ref,
                 double abs, double rel, const std::string &what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int misses = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::fabs(double(got[i]) - ref[i]);
    if (!(err <= abs + rel * std::fabs(ref[i])) && misses++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", expected "
                    << ref[i] << " (error " << err << ")";
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << got.size()
                       << " elements out of tolerance";
}

void expectForward(const std::vector<float> &got,
                   const std::vector<double> &ref, const std::string &what) {
  expectClose(got, ref, 1e-5, 1e-4, what);
}

void expectGradient(const std::vector<float> &got,
                    const std::vector<double> &ref, const std::string &what) {
  double scale = 1;
  for (double r : ref)
    scale = std::max(scale, std::fabs(r));
  expectClose(got, ref, 1e-4 * scale, 1e-3, what);
}

/// Central differences of `loss` with respect to every element of `x`.
std::vector<double> numericGradient(std::vector<double> &x,
                                    const std::function<double()> &loss) {
  const double eps = 1e-3;
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
}

double weighted(const std::vector<double> &y, const std::vector<float> &g) {
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i)
    s += y[i] * g[i];
  return s;
}

//===----------------------------------------------------------------------===//
// References (double precision, from the op descriptions)
//===----------------------------------------------------------------------===//

/// patch_embed: a stride-(pt, ph, pw) 3D convolution of x [B, C, T, H, W]
/// with w [D, C, pt, ph, pw], tokens row-major over the patch grid.
std::vector<double> patchEmbedRef(const std::vector<double> &x, Shape xs,
                                  const std::vector<double> &w, Shape ws,
                                  const std::vector<double> &bias) {
  int64_t B = xs[0], C = xs[1], T = xs[2], H = xs[3], W = xs[4];
  int64_t D = ws[0], pt = ws[2], ph = ws[3], pw = ws[4];
  int64_t gt = T / pt, gy = H / ph, gx = W / pw, N = gt * gy * gx;
  std::vector<double> out(B * N * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      int64_t at = n / (gy * gx), ay = n / gx % gy, ax = n % gx;
      for (int64_t d = 0; d < D; ++d) {
        double s = bias[d];
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < pt; ++i)
            for (int64_t j = 0; j < ph; ++j)
              for (int64_t k = 0; k < pw; ++k)
                s += w[(((d * C + c) * pt + i) * ph + j) * pw + k] *
                     x[(((b * C + c) * T + at * pt + i) * H + ay * ph + j) * W +
                       ax * pw + k];
        out[(b * N + n) * D + d] = s;
      }
    }
  return out;
}

/// unpatchify, walking the latents: the token of latent (t, y, x) and its
/// place (i, j, k, c) in the token row.
std::vector<float> unpatchifyRef(const std::vector<float> &tokens, int64_t B,
                                 int64_t C, Triple grid, Triple patch) {
  int64_t T = grid[0] * patch[0], H = grid[1] * patch[1],
          W = grid[2] * patch[2];
  int64_t N = grid[0] * grid[1] * grid[2];
  int64_t width = C * patch[0] * patch[1] * patch[2];
  std::vector<float> out(B * C * T * H * W);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t y = 0; y < H; ++y)
          for (int64_t x = 0; x < W; ++x) {
            int64_t n = ((t / patch[0]) * grid[1] + y / patch[1]) * grid[2] +
                        x / patch[2];
            int64_t i = t % patch[0], j = y % patch[1], k = x % patch[2];
            int64_t within = ((i * patch[1] + j) * patch[2] + k) * C + c;
            out[(((b * C + c) * T + t) * H + y) * W + x] =
                tokens[(b * N + n) * width + within];
          }
  return out;
}

/// rope3d as a complex multiplication of channel pairs.
std::vector<double> ropeRef(const std::vector<double> &x, Shape s, Triple grid,
                            Triple dims, double theta, bool inverse) {
  std::vector<double> out(x.size());
  int64_t B = s[0], N = s[1], H = s[2], Dh = s[3];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      int64_t pos[3] = {n / (grid[1] * grid[2]), n / grid[2] % grid[1],
                        n % grid[2]};
      for (int64_t h = 0; h < H; ++h) {
        int64_t base = ((b * N + n) * H + h) * Dh, ch = 0;
        for (int a = 0; a < 3; ++a) {
          for (int64_t i = 0; i < dims[a] / 2; ++i) {
            double angle =
                pos[a] / std::pow(theta, double(2 * i) / double(dims[a]));
            std::complex<double> z(x[base + ch + 2 * i],
                                   x[base + ch + 2 * i + 1]);
            z *= std::polar(1.0, inverse ? -angle : angle);
            out[base + ch + 2 * i] = z.real();
            out[base + ch + 2 * i + 1] = z.imag();
          }
          ch += dims[a];
        }
      }
    }
  return out;
}

/// Softmax attention of query rows over an explicit key list.
struct AttentionRef {
  std::vector<double> out, lse;
};

/// Global attention: q [B, Nq, H, D], k and v [B, Nk, H, D].
AttentionRef attentionRef(const std::vector<double> &q,
                          const std::vector<double> &k,
                          const std::vector<double> &v, int64_t B, int64_t Nq,
                          int64_t Nk, int64_t H, int64_t D, double scale) {
  AttentionRef r{std::vector<double>(B * Nq * H * D),
                 std::vector<double>(B * H * Nq)};
  std::vector<double> logits(Nk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Nq; ++i) {
        const double *qi = &q[((b * Nq + i) * H + h) * D];
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Nk; ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += qi[d] * k[((b * Nk + j) * H + h) * D + d];
          logits[j] = scale * s;
          m = std::max(m, logits[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < Nk; ++j)
          l += std::exp(logits[j] - m);
        double *o = &r.out[((b * Nq + i) * H + h) * D];
        for (int64_t j = 0; j < Nk; ++j) {
          double p = std::exp(logits[j] - m) / l;
          for (int64_t d = 0; d < D; ++d)
            o[d] += p * v[((b * Nk + j) * H + h) * D + d];
        }
        r.lse[(b * H + h) * Nq + i] = m + std::log(l);
      }
  return r;
}

/// The geometry of a 3D-DSA op, from docs/Dsa3d.md.
struct DsaGeometry {
  int64_t B, H, D;
  Triple grid, window, tile;

  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
  Triple numTiles() const {
    return {(grid[0] + tile[0] - 1) / tile[0],
            (grid[1] + tile[1] - 1) / tile[1],
            (grid[2] + tile[2] - 1) / tile[2]};
  }
  Shape offsetsShape() const {
    Triple n = numTiles();
    return {B, H, n[0], n[1], n[2], window[0], 2};
  }
  Shape qShape() const { return {B, tokens(), H, D}; }
  Attrs attrs() const {
    return {{"grid", std::vector<int64_t>(grid.begin(), grid.end())},
            {"window", std::vector<int64_t>(window.begin(), window.end())},
            {"tile", std::vector<int64_t>(tile.begin(), tile.end())}};
  }

  static int64_t clampStart(int64_t s, int64_t extent, int64_t w) {
    return std::min(std::max<int64_t>(s, 0), extent - w);
  }

  /// Calls fn(queries, keys) per tile of head (b, h).
  void forEachTile(
      const std::vector<int32_t> &offsets, int64_t b, int64_t h,
      const std::function<void(const std::vector<int64_t> &,
                               const std::vector<int64_t> &)> &fn) const {
    Triple n = numTiles();
    for (int64_t it = 0; it < n[0]; ++it)
      for (int64_t iy = 0; iy < n[1]; ++iy)
        for (int64_t ix = 0; ix < n[2]; ++ix) {
          Triple first = {it * tile[0], iy * tile[1], ix * tile[2]}, last,
                 centre;
          for (int a = 0; a < 3; ++a) {
            last[a] = std::min(first[a] + tile[a], grid[a]) - 1;
            centre[a] = (first[a] + last[a]) / 2;
          }
          std::vector<int64_t> queries, keys;
          for (int64_t t = first[0]; t <= last[0]; ++t)
            for (int64_t y = first[1]; y <= last[1]; ++y)
              for (int64_t x = first[2]; x <= last[2]; ++x)
                queries.push_back((t * grid[1] + y) * grid[2] + x);
          int64_t st =
              clampStart(centre[0] - window[0] / 2, grid[0], window[0]);
          int64_t tileIndex = (it * n[1] + iy) * n[2] + ix;
          for (int64_t j = 0; j < window[0]; ++j) {
            const int32_t *o =
                &offsets[(((b * H + h) * n[0] * n[1] * n[2] + tileIndex) *
                              window[0] +
                          j) *
                         2];
            int64_t sy = clampStart(centre[1] + o[0] - window[1] / 2, grid[1],
                                    window[1]);
            int64_t sx = clampStart(centre[2] + o[1] - window[2] / 2, grid[2],
                                    window[2]);
            for (int64_t y = sy; y < sy + window[1]; ++y)
              for (int64_t x = sx; x < sx + window[2]; ++x)
                keys.push_back(((st + j) * grid[1] + y) * grid[2] + x);
          }
          fn(queries, keys);
        }
  }
};

/// 3D-DSA in the graph layout [B, N, H, D]; lse [B, H, N].
AttentionRef dsaRef(const DsaGeometry &g, const std::vector<double> &q,
                    const std::vector<double> &k, const std::vector<double> &v,
                    const std::vector<int32_t> &offsets, double scale) {
  int64_t N = g.tokens(), H = g.H, D = g.D;
  AttentionRef r{std::vector<double>(g.B * N * H * D),
                 std::vector<double>(g.B * H * N)};
  auto row = [&](int64_t b, int64_t n, int64_t h) {
    return ((b * N + n) * H + h) * D;
  };
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      g.forEachTile(offsets, b, h,
                    [&](const std::vector<int64_t> &queries,
                        const std::vector<int64_t> &keys) {
                      for (int64_t i : queries) {
                        std::vector<double> logits;
                        double m = -std::numeric_limits<double>::infinity();
                        for (int64_t j : keys) {
                          double s = 0;
                          for (int64_t d = 0; d < D; ++d)
                            s += q[row(b, i, h) + d] * k[row(b, j, h) + d];
                          logits.push_back(scale * s);
                          m = std::max(m, logits.back());
                        }
                        double l = 0;
                        for (double s : logits)
                          l += std::exp(s - m);
                        for (size_t c = 0; c < keys.size(); ++c)
                          for (int64_t d = 0; d < D; ++d)
                            r.out[row(b, i, h) + d] +=
                                std::exp(logits[c] - m) / l *
                                v[row(b, keys[c], h) + d];
                        r.lse[(b * H + h) * N + i] = m + std::log(l);
                      }
                    });
  return r;
}

/// Block matching by direct window means, from docs/Dsa3d.md.
std::vector<int32_t> blockMatchRef(const DsaGeometry &g,
                                   const std::vector<float> &q,
                                   const std::vector<float> &k,
                                   int64_t radius) {
  Triple n = g.numTiles();
  int64_t N = g.tokens(), H = g.H, D = g.D;
  int64_t tiles = n[0] * n[1] * n[2];
  std::vector<int32_t> out(numel(g.offsetsShape()));
  // The D values of token (t, y, x) of head (b, h) in [B, N, H, D].
  auto row = [&](const std::vector<float> &x, int64_t b, int64_t h, int64_t t,
                 int64_t y, int64_t xx) {
    return &x[((b * N + (t * g.grid[1] + y) * g.grid[2] + xx) * H + h) * D];
  };
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t tileIndex = 0; tileIndex < tiles; ++tileIndex) {
        Triple idx = {tileIndex / (n[1] * n[2]), tileIndex / n[2] % n[1],
                      tileIndex % n[2]};
        Triple first, last, centre;
        for (int a = 0; a < 3; ++a) {
          first[a] = idx[a] * g.tile[a];
          last[a] = std::min(first[a] + g.tile[a], g.grid[a]) - 1;
          centre[a] = (first[a] + last[a]) / 2;
        }
        std::vector<double> mean(D, 0.0);
        int64_t count = 0;
        for (int64_t t = first[0]; t <= last[0]; ++t)
          for (int64_t y = first[1]; y <= last[1]; ++y)
            for (int64_t x = first[2]; x <= last[2]; ++x, ++count)
              for (int64_t d = 0; d < D; ++d)
                mean[d] += row(q, b, h, t, y, x)[d];
        for (double &m : mean)
          m /= count;
        int64_t st = DsaGeometry::clampStart(centre[0] - g.window[0] / 2,
                                             g.grid[0], g.window[0]);
        for (int64_t j = 0; j < g.window[0]; ++j) {
          double best = -std::numeric_limits<double>::infinity();
          int64_t bestDy = 0, bestDx = 0;
          for (int64_t dy = -radius; dy <= radius; ++dy)
            for (int64_t dx = -radius; dx <= radius; ++dx) {
              int64_t sy = DsaGeometry::clampStart(
                  centre[1] + dy - g.window[1] / 2, g.grid[1], g.window[1]);
              int64_t sx = DsaGeometry::clampStart(
                  centre[2] + dx - g.window[2] / 2, g.grid[2], g.window[2]);
              std::vector<double> win(D, 0.0);
              for (int64_t y = sy; y < sy + g.window[1]; ++y)
                for (int64_t x = sx; x < sx + g.window[2]; ++x)
                  for (int64_t d = 0; d < D; ++d)
                    win[d] += row(k, b, h, st + j, y, x)[d];
              double score = 0;
              for (int64_t d = 0; d < D; ++d)
                score += mean[d] * win[d] / (g.window[1] * g.window[2]);
              auto key = [](int64_t a, int64_t c) {
                return std::make_tuple(std::abs(a) + std::abs(c), a, c);
              };
              // Scores of the same window are bitwise equal here, so ties
              // are exact.
              if (score > best ||
                  (score == best && key(dy, dx) < key(bestDy, bestDx))) {
                best = score;
                bestDy = dy;
                bestDx = dx;
              }
            }
          int32_t *o =
              &out[((b * H + h) * tiles + tileIndex) * g.window[0] * 2 + 2 * j];
          o[0] = static_cast<int32_t>(bestDy);
          o[1] = static_cast<int32_t>(bestDx);
        }
      }
  return out;
}

/// mean((pred[:, :C] - (noise - x0))^2) for pred [B, Cp, S...].
/// The mean over samples of w[b] times the sample's mean squared residual
/// (diffusers' weighted loss); w empty: 1 each.
double flowLossRef(const std::vector<double> &pred, int64_t predChannels,
                   const std::vector<double> &x0,
                   const std::vector<double> &noise, int64_t B, int64_t C,
                   int64_t inner, const std::vector<double> &w = {}) {
  double mean = 0;
  for (int64_t b = 0; b < B; ++b) {
    double s = 0;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t i = 0; i < inner; ++i) {
        int64_t x = (b * C + c) * inner + i;
        double r =
            pred[(b * predChannels + c) * inner + i] - (noise[x] - x0[x]);
        s += r * r;
      }
    mean += (w.empty() ? 1.0 : w[b]) * s / double(C * inner) / double(B);
  }
  return mean;
}

std::vector<int64_t> vec(Triple t) { return {t[0], t[1], t[2]}; }

//===----------------------------------------------------------------------===//
// Registration
//===----------------------------------------------------------------------===//

TEST(CpuVideoKernels, RegistersEveryVideoOp) {
  for (const char *name :
       {"patch_embed", "patch_embed_grad", "patchify", "unpatchify",
        "timestep_embedding", "embedding", "embedding_grad", "rope3d",
        "attention", "attention_grad", "dsa3d", "dsa3d_grad", "dsa3d_offsets",
        "flow_interpolate", "flow_matching_loss", "flow_matching_loss_grad"})
    EXPECT_NE(findGraphKernel(exec::parseOpCode(name).value()), nullptr)
        << name;
}

//===----------------------------------------------------------------------===//
// Patches
//===----------------------------------------------------------------------===//

TEST(CpuVideoKernels, PatchEmbedMatchesNaive) {
  std::mt19937 rng(11);
  struct Case {
    Shape x, w;
  };
  for (const Case &c : {Case{{2, 3, 4, 6, 4}, {5, 3, 2, 3, 2}},
                        Case{{1, 16, 2, 8, 8}, {64, 16, 1, 2, 2}},
                        Case{{1, 1, 3, 2, 5}, {2, 1, 1, 1, 1}}}) {
    Buf x = Buf::floats(c.x, randomFloats(numel(c.x), rng));
    Buf w = Buf::floats(c.w, randomFloats(numel(c.w), rng));
    Buf bias = Buf::floats({c.w[0]}, randomFloats(c.w[0], rng));
    int64_t N = c.x[2] / c.w[2] * (c.x[3] / c.w[3]) * (c.x[4] / c.w[4]);
    Buf out = Buf::floats({c.x[0], N, c.w[0]});
    RUN_OK(inst("patch_embed"), {&x, &w, &bias}, {&out});
    expectForward(
        out.f,
        patchEmbedRef(toDouble(x.f), c.x, toDouble(w.f), c.w, toDouble(bias.f)),
        "patch_embed");
  }
}

TEST(CpuVideoKernels, PatchEmbedGradMatchesFiniteDifferences) {
  std::mt19937 rng(12);
  Shape xs = {2, 2, 2, 4, 6}, ws = {3, 2, 1, 2, 3};
  int64_t N = 2 * 2 * 2;
  Buf x = Buf::floats(xs, randomFloats(numel(xs), rng));
  Buf dy = Buf::floats({2, N, 3}, randomFloats(2 * N * 3, rng));
  Buf dw = Buf::floats(ws), db = Buf::floats({3});
  RUN_OK(inst("patch_embed_grad"), {&x, &dy}, {&dw, &db});

  std::vector<double> xd = toDouble(x.f);
  std::vector<double> w = toDouble(randomFloats(numel(ws), rng));
  std::vector<double> bias = toDouble(randomFloats(3, rng));
  auto loss = [&] {
    return weighted(patchEmbedRef(xd, xs, w, ws, bias), dy.f);
  };
  expectGradient(dw.f, numericGradient(w, loss), "weight_grad");
  expectGradient(db.f, numericGradient(bias, loss), "bias_grad");
}

TEST(CpuVideoKernels, UnpatchifyMatchesNaiveAndPatchifyInvertsIt) {
  std::mt19937 rng(13);
  for (auto [B, C, grid, patch] : {std::tuple<int64_t, int64_t, Triple, Triple>{
                                       2, 3, {2, 3, 2}, {1, 2, 2}},
                                   {1, 16, {2, 4, 4}, {1, 2, 2}},
                                   {1, 2, {1, 2, 3}, {2, 3, 1}}}) {
    int64_t N = grid[0] * grid[1] * grid[2];
    int64_t width = C * patch[0] * patch[1] * patch[2];
    Shape latents = {B, C, grid[0] * patch[0], grid[1] * patch[1],
                     grid[2] * patch[2]};
    Buf tokens = Buf::floats({B, N, width}, randomFloats(B * N * width, rng));
    Buf y = Buf::floats(latents);
    RUN_OK(inst("unpatchify", {{"grid", vec(grid)}, {"patch", vec(patch)}}),
           {&tokens}, {&y});
    EXPECT_EQ(y.f, unpatchifyRef(tokens.f, B, C, grid, patch));

    Buf back = Buf::floats({B, N, width});
    RUN_OK(inst("patchify", {{"patch", vec(patch)}}), {&y}, {&back});
    EXPECT_EQ(back.f, tokens.f) << "patchify(unpatchify(t)) != t";

    Buf x = Buf::floats(latents, randomFloats(numel(latents), rng));
    Buf t = Buf::floats({B, N, width}), x2 = Buf::floats(latents);
    RUN_OK(inst("patchify", {{"patch", vec(patch)}}), {&x}, {&t});
    RUN_OK(inst("unpatchify", {{"grid", vec(grid)}, {"patch", vec(patch)}}),
           {&t}, {&x2});
    EXPECT_EQ(x2.f, x.f) << "unpatchify(patchify(x)) != x";
  }
}

//===----------------------------------------------------------------------===//
// Embeddings
//===----------------------------------------------------------------------===//

TEST(CpuVideoKernels, TimestepEmbeddingMatchesNaive) {
  std::mt19937 rng(14);
  for (auto [width, maxPeriod, timeScale] :
       {std::tuple<int64_t, double, double>{256, 10000.0, 1000.0},
        {8, 10000.0, 1.0},
        {6, 50.0, 3.5}}) {
    Buf t = Buf::floats({3}, randomFloats(3, rng, 0, 1));
    Buf out = Buf::floats({3, width});
    Attrs attrs = {{"max_period", maxPeriod}, {"time_scale", timeScale}};
    RUN_OK(inst("timestep_embedding", attrs), {&t}, {&out});
    int64_t half = width / 2;
    std::vector<double> ref(3 * width);
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t i = 0; i < half; ++i) {
        double arg =
            timeScale * t.f[b] * std::pow(maxPeriod, -double(i) / half);
        ref[b * width + i] = std::cos(arg);
        ref[b * width + half + i] = std::sin(arg);
      }
    expectClose(out.f, ref, 1e-6, 0, "timestep_embedding");
  }
  // Defaults of the .td when the plan writer leaves them out.
  Buf t = Buf::floats({1}, {0.25f});
  Buf out = Buf::floats({1, 4});
  RUN_OK(inst("timestep_embedding"), {&t}, {&out});
  expectClose(
      out.f,
      {std::cos(0.25), std::cos(0.0025), std::sin(0.25), std::sin(0.0025)},
      1e-7, 0, "timestep_embedding defaults");
}

TEST(CpuVideoKernels, EmbeddingAndGradMatchNaive) {
  std::mt19937 rng(15);
  const int64_t V = 7, D = 5, B = 6;
  std::vector<int64_t> ids = {3, 0, 6, 3, 3, 1};
  Buf table = Buf::floats({V, D}, randomFloats(V * D, rng));
  Buf dy = Buf::floats({B, D}, randomFloats(B * D, rng));
  for (bool wide : {false, true}) {
    Buf idBuf =
        wide ? Buf::ints64({B}, ids)
             : Buf::ints32({B}, std::vector<int32_t>(ids.begin(), ids.end()));
    Buf out = Buf::floats({B, D});
    RUN_OK(inst("embedding"), {&idBuf, &table}, {&out});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t d = 0; d < D; ++d)
        EXPECT_EQ(out.f[b * D + d], table.f[ids[b] * D + d]);

    Buf dt = Buf::floats({V, D});
    RUN_OK(inst("embedding_grad"), {&idBuf, &dy}, {&dt});
    std::vector<double> t = toDouble(table.f);
    auto loss = [&] {
      std::vector<double> y(B * D);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t d = 0; d < D; ++d)
          y[b * D + d] = t[ids[b] * D + d];
      return weighted(y, dy.f);
    };
    expectGradient(dt.f, numericGradient(t, loss), "table_grad");
  }
}

//===----------------------------------------------------------------------===//
// rope3d
//===----------------------------------------------------------------------===//

struct RopeCase {
  Shape shape;
  Triple grid, dims;
  double theta;
};

const RopeCase ropeCases[] = {
    // Wan 2.1's split of a 16-channel head: dt = 16 - 4 * 2, dy = dx = 4.
    {{2, 24, 3, 16}, {2, 3, 4}, {8, 4, 4}, 10000.0},
    // An axis with no channels, a non-default theta.
    {{1, 12, 2, 6}, {3, 2, 2}, {0, 2, 4}, 500.0},
    {{1, 30, 1, 12}, {5, 3, 2}, {4, 4, 4}, 10000.0},
};

Attrs ropeAttrs(const RopeCase &c, bool inverse) {
  Attrs a = {{"grid", vec(c.grid)}, {"dims", vec(c.dims)}, {"theta", c.theta}};
  if (inverse)
    a["inverse"] = int64_t(1);
  return a;
}

TEST(CpuVideoKernels, Rope3dMatchesNaive) {
  std::mt19937 rng(16);
  for (const RopeCase &c : ropeCases)
    for (bool inverse : {false, true}) {
      Buf x = Buf::floats(c.shape, randomFloats(numel(c.shape), rng, -2, 2));
      Buf y = Buf::floats(c.shape);
      RUN_OK(inst("rope3d", ropeAttrs(c, inverse)), {&x}, {&y});
      expectForward(
          y.f,
          ropeRef(toDouble(x.f), c.shape, c.grid, c.dims, c.theta, inverse),
          inverse ? "rope3d inverse" : "rope3d");
    }
}

TEST(CpuVideoKernels, Rope3dInverseUndoesForward) {
  std::mt19937 rng(17);
  for (const RopeCase &c : ropeCases) {
    Buf x = Buf::floats(c.shape, randomFloats(numel(c.shape), rng, -2, 2));
    Buf y = Buf::floats(c.shape), back = Buf::floats(c.shape);
    RUN_OK(inst("rope3d", ropeAttrs(c, false)), {&x}, {&y});
    RUN_OK(inst("rope3d", ropeAttrs(c, true)), {&y}, {&back});
    std::vector<double> expected = toDouble(x.f);
    expectClose(back.f, expected, 1e-5, 1e-5, "rope3d inverse(forward(x))");
    // The UnitAttr written out as 0 means unset.
    Attrs unset = ropeAttrs(c, false);
    unset["inverse"] = int64_t(0);
    Buf y0 = Buf::floats(c.shape);
    RUN_OK(inst("rope3d", unset), {&x}, {&y0});
    EXPECT_EQ(y0.f, y.f);
  }
}

TEST(CpuVideoKernels, Rope3dInverseIsTheGradient) {
  std::mt19937 rng(18);
  for (RopeCase c : ropeCases) {
    // One sample and head keep the finite differences cheap; positions and
    // channel splits are what matter.
    c.shape[0] = c.shape[2] = 1;
    // GraphGradients.cpp differentiates rope3d by rope3d with `inverse`
    // toggled, in both directions.
    for (bool inverse : {false, true}) {
      Buf g = Buf::floats(c.shape, randomFloats(numel(c.shape), rng));
      Buf dx = Buf::floats(c.shape);
      RUN_OK(inst("rope3d", ropeAttrs(c, !inverse)), {&g}, {&dx});
      std::vector<double> x = toDouble(randomFloats(numel(c.shape), rng));
      auto loss = [&] {
        return weighted(ropeRef(x, c.shape, c.grid, c.dims, c.theta, inverse),
                        g.f);
      };
      expectGradient(dx.f, numericGradient(x, loss), "rope3d gradient");
    }
  }
}

//===----------------------------------------------------------------------===//
// Global attention
//===----------------------------------------------------------------------===//

struct AttentionCase {
  int64_t B, Nq, Nk, H, D;
  std::optional<double> scale;
};

Attrs scaleAttrs(std::optional<double> scale) {
  Attrs a;
  if (scale)
    a["scale"] = *scale;
  return a;
}

TEST(CpuVideoKernels, AttentionMatchesNaive) {
  std::mt19937 rng(19);
  for (const AttentionCase &c :
       {AttentionCase{2, 9, 9, 3, 8, std::nullopt},
        AttentionCase{1, 13, 5, 2, 16, 0.7}, // cross-attention
        AttentionCase{2, 4, 37, 1, 5, std::nullopt},
        AttentionCase{1, 64, 64, 4, 16, std::nullopt},
        // Several query blocks and a partial one (the kernel's blocks are
        // 64 queries).
        AttentionCase{1, 150, 70, 2, 16, std::nullopt}}) {
    Shape qs = {c.B, c.Nq, c.H, c.D}, ks = {c.B, c.Nk, c.H, c.D};
    Buf q = Buf::floats(qs, randomFloats(numel(qs), rng, -2, 2));
    Buf k = Buf::floats(ks, randomFloats(numel(ks), rng, -2, 2));
    Buf v = Buf::floats(ks, randomFloats(numel(ks), rng));
    Buf o = Buf::floats(qs);
    RUN_OK(inst("attention", scaleAttrs(c.scale)), {&q, &k, &v}, {&o});
    double scale = c.scale ? *c.scale : 1 / std::sqrt(double(c.D));
    expectForward(o.f,
                  attentionRef(toDouble(q.f), toDouble(k.f), toDouble(v.f), c.B,
                               c.Nq, c.Nk, c.H, c.D, scale)
                      .out,
                  "attention");
  }
}

TEST(CpuVideoKernels, AttentionGradMatchesFiniteDifferences) {
  std::mt19937 rng(20);
  // The last case has several query blocks summed into dK and dV.
  for (const AttentionCase &c : {AttentionCase{2, 5, 7, 2, 4, std::nullopt},
                                 AttentionCase{1, 6, 6, 3, 9, 0.4},
                                 AttentionCase{1, 130, 3, 1, 2, 0.9}}) {
    Shape qs = {c.B, c.Nq, c.H, c.D}, ks = {c.B, c.Nk, c.H, c.D};
    Buf q = Buf::floats(qs, randomFloats(numel(qs), rng, -2, 2));
    Buf k = Buf::floats(ks, randomFloats(numel(ks), rng, -2, 2));
    Buf v = Buf::floats(ks, randomFloats(numel(ks), rng));
    Buf g = Buf::floats(qs, randomFloats(numel(qs), rng));
    Buf o = Buf::floats(qs);
    Attrs attrs = scaleAttrs(c.scale);
    RUN_OK(inst("attention", attrs), {&q, &k, &v}, {&o});
    Buf dq = Buf::floats(qs), dk = Buf::floats(ks), dv = Buf::floats(ks);
    RUN_OK(inst("attention_grad", attrs), {&q, &k, &v, &o, &g},
           {&dq, &dk, &dv});

    double scale = c.scale ? *c.scale : 1 / std::sqrt(double(c.D));
    std::vector<double> qd = toDouble(q.f), kd = toDouble(k.f),
                        vd = toDouble(v.f);
    auto loss = [&] {
      return weighted(
          attentionRef(qd, kd, vd, c.B, c.Nq, c.Nk, c.H, c.D, scale).out, g.f);
    };
    expectGradient(dq.f, numericGradient(qd, loss), "query_grad");
    expectGradient(dk.f, numericGradient(kd, loss), "key_grad");
    expectGradient(dv.f, numericGradient(vd, loss), "value_grad");
  }
}

TEST(CpuVideoKernels, AttentionIsThreadCountIndependent) {
  std::mt19937 rng(21);
  // Three query blocks, the last partial.
  Shape s = {2, 150, 3, 16};
  Buf q = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf k = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf v = Buf::floats(s, randomFloats(numel(s), rng));
  Buf g = Buf::floats(s, randomFloats(numel(s), rng));
  std::vector<std::vector<float>> runs[2];
  for (int threads : {1, 3}) {
    megaslide::cpu::test::ScopedThreads scoped(threads);
    Buf o = Buf::floats(s), dq = Buf::floats(s), dk = Buf::floats(s),
        dv = Buf::floats(s);
    RUN_OK(inst("attention"), {&q, &k, &v}, {&o});
    RUN_OK(inst("attention_grad"), {&q, &k, &v, &o, &g}, {&dq, &dk, &dv});
    runs[threads == 3] = {o.f, dq.f, dk.f, dv.f};
  }
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(runs[0][i], runs[1][i]) << "result " << i;
}

//===----------------------------------------------------------------------===//
// 3D-DSA
//===----------------------------------------------------------------------===//

std::vector<int32_t> randomOffsets(const DsaGeometry &g, std::mt19937 &rng,
                                   int radius) {
  std::uniform_int_distribution<int> dist(-radius, radius);
  std::vector<int32_t> o(numel(g.offsetsShape()));
  for (int32_t &x : o)
    x = dist(rng);
  return o;
}

TEST(CpuVideoKernels, GlobalAttentionEqualsDsa3dWhenWindowCoversGrid) {
  std::mt19937 rng(22);
  DsaGeometry g{2, 3, 8, {2, 3, 4}, {2, 3, 4}, {1, 2, 3}};
  Shape s = g.qShape();
  Buf q = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf k = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf v = Buf::floats(s, randomFloats(numel(s), rng));
  Buf dout = Buf::floats(s, randomFloats(numel(s), rng));
  // Offsets cannot move a window that already covers the grid.
  Buf off = Buf::ints32(g.offsetsShape(), randomOffsets(g, rng, 3));

  Buf o1 = Buf::floats(s);
  RUN_OK(inst("attention"), {&q, &k, &v}, {&o1});
  Buf o2 = Buf::floats(s), lse = Buf::floats({g.B, g.H, g.tokens()});
  RUN_OK(inst("dsa3d", g.attrs()), {&q, &k, &v, &off}, {&o2, &lse});
  expectForward(o2.f, toDouble(o1.f), "dsa3d vs attention");
  AttentionRef ref =
      attentionRef(toDouble(q.f), toDouble(k.f), toDouble(v.f), g.B, g.tokens(),
                   g.tokens(), g.H, g.D, 1 / std::sqrt(8.0));
  expectForward(lse.f, ref.lse, "dsa3d lse vs global log-sum-exp");

  Buf dq1 = Buf::floats(s), dk1 = Buf::floats(s), dv1 = Buf::floats(s);
  RUN_OK(inst("attention_grad"), {&q, &k, &v, &o1, &dout}, {&dq1, &dk1, &dv1});
  Buf dq2 = Buf::floats(s), dk2 = Buf::floats(s), dv2 = Buf::floats(s);
  RUN_OK(inst("dsa3d_grad", g.attrs()), {&q, &k, &v, &off, &o2, &lse, &dout},
         {&dq2, &dk2, &dv2});
  expectForward(dq2.f, toDouble(dq1.f), "dsa3d_grad vs attention_grad (q)");
  expectForward(dk2.f, toDouble(dk1.f), "dsa3d_grad vs attention_grad (k)");
  expectForward(dv2.f, toDouble(dv1.f), "dsa3d_grad vs attention_grad (v)");
}

TEST(CpuVideoKernels, Dsa3dMatchesNaive) {
  std::mt19937 rng(23);
  struct Case {
    DsaGeometry g;
    std::optional<double> scale;
  };
  // Partial border tiles, displaced and clamped windows, an explicit scale.
  for (const Case &c :
       {Case{{2, 3, 8, {3, 5, 6}, {2, 3, 2}, {2, 2, 4}}, std::nullopt},
        Case{{1, 2, 16, {4, 4, 4}, {3, 2, 3}, {1, 3, 3}}, 0.3},
        Case{{1, 1, 5, {1, 6, 7}, {1, 4, 4}, {1, 4, 4}}, std::nullopt}}) {
    const DsaGeometry &g = c.g;
    Shape s = g.qShape();
    Buf q = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
    Buf k = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
    Buf v = Buf::floats(s, randomFloats(numel(s), rng));
    Buf off = Buf::ints32(g.offsetsShape(), randomOffsets(g, rng, 4));
    Buf o = Buf::floats(s), lse = Buf::floats({g.B, g.H, g.tokens()});
    Attrs attrs = g.attrs();
    if (c.scale)
      attrs["scale"] = *c.scale;
    RUN_OK(inst("dsa3d", attrs), {&q, &k, &v, &off}, {&o, &lse});
    double scale = c.scale ? *c.scale : 1 / std::sqrt(double(g.D));
    AttentionRef ref =
        dsaRef(g, toDouble(q.f), toDouble(k.f), toDouble(v.f), off.i32, scale);
    expectForward(o.f, ref.out, "dsa3d");
    expectForward(lse.f, ref.lse, "dsa3d lse");
  }
}

TEST(CpuVideoKernels, Dsa3dGradMatchesFiniteDifferences) {
  std::mt19937 rng(24);
  DsaGeometry g{1, 2, 4, {3, 3, 4}, {2, 2, 3}, {2, 2, 2}};
  Shape s = g.qShape();
  Buf q = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf k = Buf::floats(s, randomFloats(numel(s), rng, -2, 2));
  Buf v = Buf::floats(s, randomFloats(numel(s), rng));
  Buf dout = Buf::floats(s, randomFloats(numel(s), rng));
  Buf off = Buf::ints32(g.offsetsShape(), randomOffsets(g, rng, 2));
  Attrs attrs = g.attrs();
  attrs["scale"] = 0.8;
  Buf o = Buf::floats(s), lse = Buf::floats({g.B, g.H, g.tokens()});
  RUN_OK(inst("dsa3d", attrs), {&q, &k, &v, &off}, {&o, &lse});
  Buf dq = Buf::floats(s), dk = Buf::floats(s), dv = Buf::floats(s);
  RUN_OK(inst("dsa3d_grad", attrs), {&q, &k, &v, &off, &o, &lse, &dout},
         {&dq, &dk, &dv});

  std::vector<double> qd = toDouble(q.f), kd = toDouble(k.f),
                      vd = toDouble(v.f);
  auto loss = [&] {
    return weighted(dsaRef(g, qd, kd, vd, off.i32, 0.8).out, dout.f);
  };
  expectGradient(dq.f, numericGradient(qd, loss), "dsa3d query_grad");
  expectGradient(dk.f, numericGradient(kd, loss), "dsa3d key_grad");
  expectGradient(dv.f, numericGradient(vd, loss), "dsa3d value_grad");
}

TEST(CpuVideoKernels, Dsa3dOffsetsMatchBlockMatching) {
  std::mt19937 rng(25);
  for (auto [g, radius] : {std::pair<DsaGeometry, int64_t>{
                               {2, 2, 8, {3, 6, 7}, {2, 3, 3}, {1, 2, 3}}, 1},
                           {{1, 3, 4, {2, 5, 5}, {1, 2, 2}, {2, 2, 2}}, 2},
                           // A radius beyond the grid: the kernel caps the
                           // search, which must not change the answer.
                           {{1, 1, 4, {2, 3, 4}, {2, 2, 2}, {1, 1, 2}}, 9}}) {
    Shape s = g.qShape();
    Buf q = Buf::floats(s, randomFloats(numel(s), rng));
    Buf k = Buf::floats(s, randomFloats(numel(s), rng));
    Buf off = Buf::ints32(g.offsetsShape());
    Attrs attrs = g.attrs();
    attrs["radius"] = radius;
    RUN_OK(inst("dsa3d_offsets", attrs), {&q, &k}, {&off});
    EXPECT_EQ(off.i32, blockMatchRef(g, q.f, k.f, radius))
        << "radius " << radius;
  }
}

//===----------------------------------------------------------------------===//
// Flow matching
//===----------------------------------------------------------------------===//

TEST(CpuVideoKernels, FlowInterpolateMatchesNaive) {
  std::mt19937 rng(26);
  Shape s = {3, 2, 2, 3, 4};
  int64_t per = numel(s) / 3;
  Buf x0 = Buf::floats(s, randomFloats(numel(s), rng));
  Buf noise = Buf::floats(s, randomFloats(numel(s), rng));
  Buf t = Buf::floats({3}, {0.0f, 0.3f, 1.0f});
  Buf out = Buf::floats(s);
  RUN_OK(inst("flow_interpolate"), {&x0, &noise, &t}, {&out});
  std::vector<double> ref(numel(s));
  for (int64_t i = 0; i < numel(s); ++i) {
    double tb = t.f[i / per];
    ref[i] = (1 - tb) * x0.f[i] + tb * noise.f[i];
  }
  expectForward(out.f, ref, "flow_interpolate");
}

TEST(CpuVideoKernels, FlowMatchingLossAndGradMatchNaive) {
  std::mt19937 rng(27);
  // Equal channels, and a prediction with learned-sigma extra channels.
  for (int64_t predChannels : {int64_t(3), int64_t(5)}) {
    const int64_t B = 2, C = 3, inner = 2 * 3 * 4;
    Shape xs = {B, C, 2, 3, 4}, ps = {B, predChannels, 2, 3, 4};
    Buf pred = Buf::floats(ps, randomFloats(numel(ps), rng));
    Buf x0 = Buf::floats(xs, randomFloats(numel(xs), rng));
    Buf noise = Buf::floats(xs, randomFloats(numel(xs), rng));
    Buf loss = Buf::floats({});
    RUN_OK(inst("flow_matching_loss"), {&pred, &x0, &noise}, {&loss});
    std::vector<double> pd = toDouble(pred.f), xd = toDouble(x0.f),
                        nd = toDouble(noise.f);
    expectForward(loss.f, {flowLossRef(pd, predChannels, xd, nd, B, C, inner)},
                  "flow_matching_loss");

    Buf grad = Buf::floats(ps);
    RUN_OK(inst("flow_matching_loss_grad"), {&pred, &x0, &noise}, {&grad});
    expectGradient(grad.f,
                   numericGradient(pd,
                                   [&] {
                                     return flowLossRef(pd, predChannels, xd,
                                                        nd, B, C, inner);
                                   }),
                   "flow_matching_loss_grad");
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = C; c < predChannels; ++c)
        for (int64_t i = 0; i < inner; ++i)
          EXPECT_EQ(grad.f[(b * predChannels + c) * inner + i], 0.0f);
  }
}

// Tests that per-sample weights scale each sample's term of the loss and
// its gradient (against the naive weighted mean and a numeric gradient),
// that the second result is the unweighted loss, and that weights of 1
// give the unweighted op's loss and gradient bit for bit.
TEST(CpuVideoKernels, WeightedFlowMatchingLossMatchesNaive) {
  std::mt19937 rng(28);
  const int64_t B = 3, C = 3, Cp = 5, inner = 2 * 3 * 4;
  Shape xs = {B, C, 2, 3, 4}, ps = {B, Cp, 2, 3, 4};
  Buf pred = Buf::floats(ps, randomFloats(numel(ps), rng));
  Buf x0 = Buf::floats(xs, randomFloats(numel(xs), rng));
  Buf noise = Buf::floats(xs, randomFloats(numel(xs), rng));
  Buf w = Buf::floats({B}, {0.25f, 3.0f, 1.5f});
  Buf loss = Buf::floats({}), unweighted = Buf::floats({});
  RUN_OK(inst("flow_matching_loss"), {&pred, &x0, &noise, &w},
         {&loss, &unweighted});
  std::vector<double> pd = toDouble(pred.f), xd = toDouble(x0.f),
                      nd = toDouble(noise.f), wd = toDouble(w.f);
  expectForward(loss.f, {flowLossRef(pd, Cp, xd, nd, B, C, inner, wd)},
                "weighted flow_matching_loss");
  expectForward(unweighted.f, {flowLossRef(pd, Cp, xd, nd, B, C, inner)},
                "unweighted_loss");

  Buf grad = Buf::floats(ps);
  RUN_OK(inst("flow_matching_loss_grad"), {&pred, &x0, &noise, &w}, {&grad});
  expectGradient(
      grad.f,
      numericGradient(
          pd, [&] { return flowLossRef(pd, Cp, xd, nd, B, C, inner, wd); }),
      "weighted flow_matching_loss_grad");

  Buf ones = Buf::floats({B}, std::vector<float>(B, 1.0f));
  Buf plain = Buf::floats({}), again = Buf::floats({});
  Buf plainGrad = Buf::floats(ps), onesGrad = Buf::floats(ps);
  RUN_OK(inst("flow_matching_loss"), {&pred, &x0, &noise}, {&plain});
  RUN_OK(inst("flow_matching_loss"), {&pred, &x0, &noise, &ones},
         {&loss, &again});
  EXPECT_EQ(loss.f, plain.f);
  EXPECT_EQ(again.f, plain.f);
  RUN_OK(inst("flow_matching_loss_grad"), {&pred, &x0, &noise}, {&plainGrad});
  RUN_OK(inst("flow_matching_loss_grad"), {&pred, &x0, &noise, &ones},
         {&onesGrad});
  EXPECT_EQ(onesGrad.f, plainGrad.f);
}

//===----------------------------------------------------------------------===//
// Errors and edge cases
//===----------------------------------------------------------------------===//

TEST(CpuVideoKernels, AcceptsEmptyTensorsWithoutBuffers) {
  // Zero-element tensors may arrive without a buffer; they are not errors.
  Buf ids = Buf::ints64({0}, {});
  Buf table = Buf::floats({4, 3}, std::vector<float>(12, 1.0f));
  Buf rows = Buf::floats({0, 3});
  RUN_OK(inst("embedding"), {&ids, &table}, {&rows});
  Buf q = Buf::floats({1, 0, 2, 4});
  Buf k = Buf::floats({1, 3, 2, 4}, std::vector<float>(24, 0.5f));
  Buf o = Buf::floats({1, 0, 2, 4});
  RUN_OK(inst("attention"), {&q, &k, &k}, {&o});
  Buf dq = Buf::floats({1, 0, 2, 4}), dk = Buf::floats({1, 3, 2, 4}),
      dv = Buf::floats({1, 3, 2, 4});
  RUN_OK(inst("attention_grad"), {&q, &k, &k, &o, &o}, {&dq, &dk, &dv});
  // No queries: no gradient reaches the keys and values.
  EXPECT_EQ(dk.f, std::vector<float>(24, 0.0f));
  EXPECT_EQ(dv.f, std::vector<float>(24, 0.0f));
}

TEST(CpuVideoKernels, RejectsUnusableInstructionsWithoutCrashing) {
  DsaGeometry g{1, 2, 4, {2, 3, 4}, {2, 2, 2}, {1, 2, 2}};
  Shape s = g.qShape();
  Buf q = Buf::floats(s, std::vector<float>(numel(s), 0.5f));
  Buf off = Buf::ints32(g.offsetsShape(),
                        std::vector<int32_t>(numel(g.offsetsShape()), 0));
  Buf o = Buf::floats(s), lse = Buf::floats({g.B, g.H, g.tokens()});
  Buf small = Buf::floats({1, 3, 2, 4}, std::vector<float>(24, 1.0f));
  Buf fourHeads = Buf::floats({1, 3, 4, 4}, std::vector<float>(48, 1.0f));
  Buf table = Buf::floats({4, 3}, std::vector<float>(12, 1.0f));
  Buf ids = Buf::ints64({2}, {1, 4});
  Buf row = Buf::floats({2, 3});
  Buf latents = Buf::floats({1, 2, 3, 4, 4}, std::vector<float>(96, 1.0f));
  Buf tokens = Buf::floats({1, 6, 16});
  Buf t = Buf::floats({2}, {0.5f, 0.5f});
  Buf odd = Buf::floats({2, 5}), emb = Buf::floats({2, 4});
  Buf x0 = Buf::floats({1, 2, 2}, std::vector<float>(4, 1.0f));
  Buf pred = Buf::floats({1, 1, 2}, std::vector<float>(2, 1.0f));
  Buf scalar = Buf::floats({});
  Buf one = Buf::floats({1}, {2.0f});

  Attrs noWindow = g.attrs();
  noWindow.erase("window");
  Attrs bigWindow = g.attrs();
  bigWindow["window"] = std::vector<int64_t>{3, 2, 2};
  Attrs badScale = g.attrs();
  badScale["scale"] = -1.0;
  Attrs negRadius = g.attrs();
  negRadius["radius"] = int64_t(-1);
  Attrs shortGrid = g.attrs();
  shortGrid["grid"] = std::vector<int64_t>{2, 3};

  struct Case {
    exec::Instruction in;
    std::vector<Buf *> operands, results;
    const char *expect; ///< a substring of the message
  };
  std::vector<Case> cases = {
      {inst("dsa3d", g.attrs()), {&q, &q, &q}, {&o, &lse}, "expects 4"},
      {inst("dsa3d", noWindow), {&q, &q, &q, &off}, {&o, &lse}, "'window'"},
      {inst("dsa3d", bigWindow), {&q, &q, &q, &off}, {&o, &lse}, "exceeds"},
      {inst("dsa3d", shortGrid), {&q, &q, &q, &off}, {&o, &lse}, "3 entries"},
      {inst("dsa3d", badScale), {&q, &q, &q, &off}, {&o, &lse}, "scale"},
      {inst("dsa3d", g.attrs()), {&q, &q, &q, &q}, {&o, &lse}, "i32"},
      {inst("dsa3d", g.attrs()), {&q, &q, &q, &off}, {&o, &o}, "lse"},
      {inst("dsa3d_grad", g.attrs()),
       {&q, &q, &q, &off, &o, &o, &q},
       {&o, &o, &o},
       "lse"},
      {inst("dsa3d_offsets", g.attrs()), {&q, &q}, {&off}, "radius"},
      {inst("dsa3d_offsets", negRadius), {&q, &q}, {&off}, "radius"},
      {inst("attention"), {&q, &fourHeads, &fourHeads}, {&o}, "differ"},
      {inst("attention", {{"scale", 0.0}}), {&q, &q, &q}, {&o}, "scale"},
      {inst("attention_grad"), {&q, &q, &q, &o}, {&o, &o, &o}, "expects 5"},
      {inst("embedding"), {&ids, &table}, {&row}, "outside the table"},
      {inst("embedding_grad"), {&ids, &row}, {&table}, "outside the table"},
      {inst("embedding"), {&table, &table}, {&row}, "i32 or i64"},
      {inst("rope3d", {{"grid", std::vector<int64_t>{1, 1, 3}},
                       {"dims", std::vector<int64_t>{2, 2, 2}}}),
       {&small},
       {&small},
       "sum to the head dim"},
      {inst("rope3d", {{"grid", std::vector<int64_t>{1, 2, 3}},
                       {"dims", std::vector<int64_t>{0, 2, 2}}}),
       {&small},
       {&small},
       "does not match grid"},
      {inst("patchify", {{"patch", std::vector<int64_t>{2, 2, 2}}}),
       {&latents},
       {&tokens},
       "not divisible"},
      {inst("unpatchify", {{"grid", std::vector<int64_t>{3, 2, 1}},
                           {"patch", std::vector<int64_t>{1, 2, 2}}}),
       {&tokens},
       {&latents},
       "does not give latents"},
      {inst("patch_embed"), {&latents, &table, &t}, {&tokens}, "rank 5"},
      {inst("timestep_embedding"), {&t}, {&odd}, "even"},
      {inst("timestep_embedding", {{"max_period", 1.0}}),
       {&t},
       {&emb},
       "max_period"},
      {inst("flow_interpolate"), {&x0, &x0, &t}, {&x0}, "timesteps"},
      {inst("flow_matching_loss"), {&pred, &x0, &x0}, {&scalar}, "extra"},
      {inst("flow_matching_loss"), {&x0, &x0, &x0}, {&x0}, "scalar"},
      {inst("flow_matching_loss"),
       {&x0, &x0, &x0, &t},
       {&scalar, &scalar},
       "'weights' has shape [2]"},
      {inst("flow_matching_loss"),
       {&x0, &x0, &x0, &one},
       {&scalar},
       "with weights returns the loss and the unweighted loss"},
      {inst("flow_matching_loss"),
       {&x0, &x0, &x0},
       {&scalar, &scalar},
       "without weights returns the loss only"},
      {inst("flow_matching_loss_grad"), {&x0, &x0, &x0, &t}, {&x0}, "weights"},
  };
  for (Case &c : cases) {
    std::string message = errorOf(c.in, c.operands, c.results);
    std::string op = exec::opName(c.in.op);
    EXPECT_EQ(message.rfind("megaslide." + op + ": ", 0), 0u)
        << "'" << message << "' does not start with the op";
    EXPECT_NE(message.find(c.expect), std::string::npos)
        << op << ": '" << message << "' lacks '" << c.expect << "'";
  }
}

} // namespace
