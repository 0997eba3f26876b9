//===- Dsa3d.cpp - 3D Deformable Slide Attention on the CPU ---------------===//
//
// Window geometry follows docs/Dsa3d.md exactly; the test
// (test/unit/runtime/cpu/Dsa3dTest.cpp) rebuilds it from the definition and
// compares against naive double-precision attention.
//
// Work is split into independent items run on the persistent workers of
// cpu/WorkerPool.h (through parallelFor in cpu/ParallelFor.h): query
// tiles for the forward (each writes only its own queries), (batch, head)
// pairs for the backward (dK and dV of a head are accumulated by one thread,
// so no atomics are needed) and for the offsets (one summed-area table per
// worker).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/ParallelFor.h"
#include "megaslide/runtime/cpu/VecMath.h"

#include "llvm/Support/MathExtras.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <tuple>
#include <vector>

using namespace megaslide::cpu;

//===----------------------------------------------------------------------===//
// Configuration
//===----------------------------------------------------------------------===//

std::array<int64_t, 3> Dsa3dConfig::numTiles() const {
  return {llvm::divideCeilSigned(T, tile[0]),
          llvm::divideCeilSigned(Y, tile[1]),
          llvm::divideCeilSigned(X, tile[2])};
}

int64_t Dsa3dConfig::offsetsSize() const {
  std::array<int64_t, 3> n = numTiles();
  return batch * heads * n[0] * n[1] * n[2] * window[0] * 2;
}

std::string Dsa3dConfig::validate() const {
  std::ostringstream os;
  const std::pair<const char *, int64_t> sizes[] = {
      {"batch", batch}, {"heads", heads}, {"T", T},
      {"Y", Y},         {"X", X},         {"headDim", headDim}};
  for (auto [name, value] : sizes)
    if (value <= 0) {
      os << name << " must be positive, got " << value;
      return os.str();
    }
  static const char *axes[] = {"t", "y", "x"};
  const int64_t grid[] = {T, Y, X};
  for (int i = 0; i < 3; ++i) {
    if (window[i] <= 0 || tile[i] <= 0) {
      os << "window and tile must be positive, got window (" << window[0]
         << ", " << window[1] << ", " << window[2] << "), tile (" << tile[0]
         << ", " << tile[1] << ", " << tile[2] << ")";
      return os.str();
    }
    if (window[i] > grid[i]) {
      os << "window extent " << window[i] << " along " << axes[i]
         << " exceeds the grid extent " << grid[i];
      return os.str();
    }
  }
  if (!(scale > 0) || !std::isfinite(scale)) {
    os << "scale must be positive and finite, got " << scale;
    return os.str();
  }
  return {};
}

namespace {

//===----------------------------------------------------------------------===//
// Window geometry (docs/Dsa3d.md, "Definition")
//===----------------------------------------------------------------------===//

inline int64_t clampStart(int64_t start, int64_t extent, int64_t window) {
  return std::clamp<int64_t>(start, 0, extent - window);
}

/// A query tile: its token ranges, centre and the temporal window start.
struct QueryTile {
  int64_t begin[3], end[3]; ///< [begin, end) per axis (t, y, x)
  int64_t centre[3];        ///< floor((first + last) / 2) per axis
  int64_t keyFrameStart;    ///< s_t

  QueryTile(const Dsa3dConfig &cfg, int64_t it, int64_t iy, int64_t ix) {
    const int64_t index[3] = {it, iy, ix};
    const int64_t grid[3] = {cfg.T, cfg.Y, cfg.X};
    for (int a = 0; a < 3; ++a) {
      begin[a] = index[a] * cfg.tile[a];
      end[a] = std::min(begin[a] + cfg.tile[a], grid[a]);
      // Border tiles are partial, so the centre is that of the frames the
      // tile actually has, not of a padded tile.
      centre[a] = (begin[a] + end[a] - 1) / 2;
    }
    keyFrameStart =
        clampStart(centre[0] - cfg.window[0] / 2, cfg.T, cfg.window[0]);
  }

  int64_t size() const {
    return (end[0] - begin[0]) * (end[1] - begin[1]) * (end[2] - begin[2]);
  }

  /// Spatial window start (s_y, s_x) of a key frame displaced by (dy, dx).
  std::pair<int64_t, int64_t> spatialStart(const Dsa3dConfig &cfg, int64_t dy,
                                           int64_t dx) const {
    return {
        clampStart(centre[1] + dy - cfg.window[1] / 2, cfg.Y, cfg.window[1]),
        clampStart(centre[2] + dx - cfg.window[2] / 2, cfg.X, cfg.window[2])};
  }

  /// Calls fn(n) for every query token of the tile, in row-major order.
  template <typename Fn>
  void forEachQuery(const Dsa3dConfig &cfg, Fn fn) const {
    for (int64_t t = begin[0]; t < end[0]; ++t)
      for (int64_t y = begin[1]; y < end[1]; ++y)
        for (int64_t x = begin[2]; x < end[2]; ++x)
          fn((t * cfg.Y + y) * cfg.X + x);
  }
};

/// Splits a flat tile index of one (b, h) into (it, iy, ix).
QueryTile tileAt(const Dsa3dConfig &cfg, int64_t tileIndex) {
  std::array<int64_t, 3> n = cfg.numTiles();
  return QueryTile(cfg, tileIndex / (n[1] * n[2]), tileIndex / n[2] % n[1],
                   tileIndex % n[2]);
}

/// The kt * ky * kx key tokens shared by the queries of `tile`, whose
/// per-key-frame displacements are tileOffsets[2 * j], [2 * j + 1].
void windowKeys(const Dsa3dConfig &cfg, const QueryTile &tile,
                const int32_t *tileOffsets, std::vector<int64_t> &keys) {
  keys.clear();
  for (int64_t j = 0; j < cfg.window[0]; ++j) {
    int64_t t = tile.keyFrameStart + j;
    auto [sy, sx] =
        tile.spatialStart(cfg, tileOffsets[2 * j], tileOffsets[2 * j + 1]);
    for (int64_t y = sy; y < sy + cfg.window[1]; ++y)
      for (int64_t x = sx; x < sx + cfg.window[2]; ++x)
        keys.push_back((t * cfg.Y + y) * cfg.X + x);
  }
}

/// Offsets of tile `tileIndex` of head (b, h): kt pairs (dy, dx).
template <typename Int>
Int *tileOffsets(const Dsa3dConfig &cfg, Int *offsets, int64_t b, int64_t h,
                 int64_t tileIndex) {
  std::array<int64_t, 3> n = cfg.numTiles();
  int64_t tiles = n[0] * n[1] * n[2];
  return offsets +
         ((b * cfg.heads + h) * tiles + tileIndex) * cfg.window[0] * 2;
}

// Both kernels work per query tile on oneDNN's sgemm (cpu/Gemm.h): the
// tile's queries, in chunks of at most kQueryChunk, against its window's
// keys, in chunks of at most kKeyChunk, so S = scale Q K^T is at most
// kQueryChunk x kKeyChunk. Rows of a chunk are gathered into per-thread
// buffers unless their tokens are consecutive (a window or tile spanning
// whole grid rows, such as a window equal to the grid), when the GEMM reads
// them in place. Per-thread scratch is thus bounded whatever the grid and
// window: under 2 MB forward and 4 MB backward at D = 128. Chunks depend
// only on the geometry, so every product has the same shape at any thread
// count (bitwise the same on one machine, not across instruction sets).

/// Queries per GEMM row block.
constexpr int64_t kQueryChunk = 128;
/// Keys per online-softmax step: windows up to 1,024 keys (a 1,024-token
/// grid) are one step.
constexpr int64_t kKeyChunk = 1024;

/// Whether tokens[0, n) are consecutive indices: rows a GEMM reads in place.
bool consecutive(const int64_t *tokens, int64_t n) {
  for (int64_t c = 1; c < n; ++c)
    if (tokens[c] != tokens[0] + c)
      return false;
  return true;
}

/// Rows tokens[0, n) of head (b, h) of `x` as a GEMM operand: in place when
/// the tokens are consecutive, else copied into `buf` (n x D).
GemmOperand gatherRows(Dsa3dInput x, int64_t b, int64_t h,
                       const int64_t *tokens, int64_t n, int64_t D,
                       std::vector<float> &buf) {
  if (consecutive(tokens, n))
    return {x.row(b, h, tokens[0]), x.strideN};
  for (int64_t c = 0; c < n; ++c)
    std::copy_n(x.row(b, h, tokens[c]), D, &buf[c * D]);
  return {buf.data(), D};
}

GemmOperand transposed(GemmOperand x) { return {x.data, x.ld, true}; }

/// The query tokens of `tile` in row-major order.
void tileQueries(const Dsa3dConfig &cfg, const QueryTile &tile,
                 std::vector<int64_t> &queries) {
  queries.clear();
  tile.forEachQuery(cfg, [&](int64_t token) { queries.push_back(token); });
}

} // namespace

//===----------------------------------------------------------------------===//
// Forward
//===----------------------------------------------------------------------===//

void megaslide::cpu::dsa3dForward(const Dsa3dConfig &cfg, Dsa3dInput q,
                                  Dsa3dInput k, Dsa3dInput v,
                                  const int32_t *offsets, Dsa3dOutput out,
                                  float *lse) {
  assert(cfg.validate().empty() && "invalid 3D-DSA configuration");
  std::array<int64_t, 3> n = cfg.numTiles();
  const int64_t tiles = n[0] * n[1] * n[2];
  const int64_t D = cfg.headDim, N = cfg.tokens(), W = cfg.windowSize();
  const int64_t QC = kQueryChunk, KC = std::min(kKeyChunk, W);
  const float scale = static_cast<float>(cfg.scale);

  parallelFor(cfg.batch * cfg.heads * tiles, [&] {
    return [&, keys = std::vector<int64_t>(), queries = std::vector<int64_t>(),
            qBuf = std::vector<float>(QC * D), kBuf = std::vector<float>(KC * D),
            vBuf = std::vector<float>(KC * D),
            scores = std::vector<float>(QC * KC),
            acc = std::vector<float>(QC * D), m = std::vector<float>(QC),
            l = std::vector<float>(QC)](int64_t item) mutable {
      int64_t b = item / (cfg.heads * tiles), h = item / tiles % cfg.heads;
      int64_t tileIndex = item % tiles;
      QueryTile tile = tileAt(cfg, tileIndex);
      windowKeys(cfg, tile, tileOffsets(cfg, offsets, b, h, tileIndex), keys);
      tileQueries(cfg, tile, queries);
      const int64_t nq = static_cast<int64_t>(queries.size());
      for (int64_t i0 = 0; i0 < nq; i0 += QC) {
        const int64_t rows = std::min(QC, nq - i0);
        GemmOperand qOp = gatherRows(q, b, h, &queries[i0], rows, D, qBuf);
        // Online softmax: m is the running maximum logit of each query, l
        // the running sum of exp(logit - m), acc that of exp(logit - m) v.
        std::fill_n(m.begin(), rows, -std::numeric_limits<float>::infinity());
        std::fill_n(l.begin(), rows, 0.0f);
        for (int64_t c0 = 0; c0 < W; c0 += KC) {
          const int64_t cn = std::min(KC, W - c0);
          GemmOperand kOp = gatherRows(k, b, h, &keys[c0], cn, D, kBuf);
          GemmOperand vOp = gatherRows(v, b, h, &keys[c0], cn, D, vBuf);
          gemmSerial(rows, cn, D, scale, qOp, transposed(kOp), 0.0f,
                     scores.data(), cn);
          for (int64_t r = 0; r < rows; ++r) {
            float *s = &scores[r * cn];
            float mNew = std::max(m[r], maxOf(s, cn));
            // alpha = exp(m - mNew), 0 on the first chunk.
            float alpha = m[r];
            expSubAndSum(&alpha, 1, mNew);
            l[r] = l[r] * alpha + expSubAndSum(s, cn, mNew);
            m[r] = mNew;
            if (c0 > 0)
              for (int64_t d = 0; d < D; ++d)
                acc[r * D + d] *= alpha;
          }
          gemmSerial(rows, D, cn, 1.0f, {scores.data(), cn}, vOp,
                     c0 == 0 ? 0.0f : 1.0f, acc.data(), D);
        }
        for (int64_t r = 0; r < rows; ++r) {
          int64_t token = queries[i0 + r];
          float *o = out.row(b, h, token);
          float inv = 1.0f / l[r];
          for (int64_t d = 0; d < D; ++d)
            o[d] = acc[r * D + d] * inv;
          lse[(b * cfg.heads + h) * N + token] = m[r] + std::log(l[r]);
        }
      }
    };
  });
}

//===----------------------------------------------------------------------===//
// Backward
//===----------------------------------------------------------------------===//

/// dsa3dBackward, with Delta from `out` (delta null) or given.
static void backward(const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k,
                     Dsa3dInput v, const int32_t *offsets,
                     const Dsa3dInput *out, Dsa3dInput dout, const float *lse,
                     const float *delta, Dsa3dOutput dq, Dsa3dOutput dk,
                     Dsa3dOutput dv) {
  assert(cfg.validate().empty() && "invalid 3D-DSA configuration");
  std::array<int64_t, 3> n = cfg.numTiles();
  const int64_t tiles = n[0] * n[1] * n[2];
  const int64_t D = cfg.headDim, N = cfg.tokens(), W = cfg.windowSize();
  const int64_t QC = kQueryChunk, KC = std::min(kKeyChunk, W);
  const float scale = static_cast<float>(cfg.scale);

  // One (batch, head) per item, tiles and chunks in order: dK and dV of a
  // head are summed by one thread in an order fixed by the geometry.
  parallelFor(cfg.batch * cfg.heads, [&] {
    return [&, keys = std::vector<int64_t>(), queries = std::vector<int64_t>(),
            rowDot = std::vector<float>(N), qBuf = std::vector<float>(QC * D),
            doBuf = std::vector<float>(QC * D),
            kBuf = std::vector<float>(KC * D), vBuf = std::vector<float>(KC * D),
            probs = std::vector<float>(QC * KC),
            dprobs = std::vector<float>(QC * KC),
            dqAcc = std::vector<float>(QC * D),
            dkBuf = std::vector<float>(KC * D),
            dvBuf = std::vector<float>(KC * D)](int64_t item) mutable {
      int64_t b = item / cfg.heads, h = item % cfg.heads;
      const float *lseBH = lse + item * N;
      for (int64_t token = 0; token < N; ++token) {
        std::fill_n(dk.row(b, h, token), D, 0.0f);
        std::fill_n(dv.row(b, h, token), D, 0.0f);
        // D_i = rowsum(dO * O) = sum_j P_ij dP_ij, the softmax Jacobian's
        // correction term, computed once per query instead of per key.
        rowDot[token] =
            delta ? delta[item * N + token]
                  : dot(dout.row(b, h, token), out->row(b, h, token), D);
      }
      for (int64_t tileIndex = 0; tileIndex < tiles; ++tileIndex) {
        QueryTile tile = tileAt(cfg, tileIndex);
        windowKeys(cfg, tile, tileOffsets(cfg, offsets, b, h, tileIndex), keys);
        tileQueries(cfg, tile, queries);
        const int64_t nq = static_cast<int64_t>(queries.size());
        for (int64_t i0 = 0; i0 < nq; i0 += QC) {
          const int64_t rows = std::min(QC, nq - i0);
          const int64_t *qTokens = &queries[i0];
          GemmOperand qOp = gatherRows(q, b, h, qTokens, rows, D, qBuf);
          GemmOperand doOp = gatherRows(dout, b, h, qTokens, rows, D, doBuf);
          for (int64_t c0 = 0; c0 < W; c0 += KC) {
            const int64_t cn = std::min(KC, W - c0);
            const int64_t *kTokens = &keys[c0];
            GemmOperand kOp = gatherRows(k, b, h, kTokens, cn, D, kBuf);
            GemmOperand vOp = gatherRows(v, b, h, kTokens, cn, D, vBuf);
            // P = exp(scale q k^T - lse), recomputed from the forward's lse.
            gemmSerial(rows, cn, D, scale, qOp, transposed(kOp), 0.0f,
                       probs.data(), cn);
            gemmSerial(rows, cn, D, 1.0f, doOp, transposed(vOp), 0.0f,
                       dprobs.data(), cn);
            for (int64_t r = 0; r < rows; ++r) {
              float *p = &probs[r * cn], *ds = &dprobs[r * cn];
              expSubAndSum(p, cn, lseBH[qTokens[r]]);
              float rowDotR = rowDot[qTokens[r]];
              for (int64_t c = 0; c < cn; ++c)
                ds[c] = p[c] * (ds[c] - rowDotR);
            }
            // dQ = scale dS K over the chunks; dK += scale dS^T Q and
            // dV += P^T dO, in place for consecutive keys (zeroed above),
            // else added row by row in the window's key order.
            gemmSerial(rows, D, cn, scale, {dprobs.data(), cn}, kOp,
                       c0 == 0 ? 0.0f : 1.0f, dqAcc.data(), D);
            GemmOperand dsT{dprobs.data(), cn, true}, pT{probs.data(), cn, true};
            if (consecutive(kTokens, cn)) {
              gemmSerial(cn, D, rows, scale, dsT, qOp, 1.0f,
                         dk.row(b, h, kTokens[0]), dk.strideN);
              gemmSerial(cn, D, rows, 1.0f, pT, doOp, 1.0f,
                         dv.row(b, h, kTokens[0]), dv.strideN);
              continue;
            }
            gemmSerial(cn, D, rows, scale, dsT, qOp, 0.0f, dkBuf.data(), D);
            gemmSerial(cn, D, rows, 1.0f, pT, doOp, 0.0f, dvBuf.data(), D);
            for (int64_t c = 0; c < cn; ++c) {
              float *dkc = dk.row(b, h, kTokens[c]),
                    *dvc = dv.row(b, h, kTokens[c]);
              for (int64_t d = 0; d < D; ++d) {
                dkc[d] += dkBuf[c * D + d];
                dvc[d] += dvBuf[c * D + d];
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r)
            std::copy_n(&dqAcc[r * D], D, dq.row(b, h, qTokens[r]));
        }
      }
    };
  });
}

void megaslide::cpu::dsa3dBackward(const Dsa3dConfig &cfg, Dsa3dInput q,
                                   Dsa3dInput k, Dsa3dInput v,
                                   const int32_t *offsets, Dsa3dInput out,
                                   Dsa3dInput dout, const float *lse,
                                   Dsa3dOutput dq, Dsa3dOutput dk,
                                   Dsa3dOutput dv) {
  backward(cfg, q, k, v, offsets, &out, dout, lse, nullptr, dq, dk, dv);
}

void megaslide::cpu::dsa3dBackwardFromDelta(
    const Dsa3dConfig &cfg, Dsa3dInput q, Dsa3dInput k, Dsa3dInput v,
    const int32_t *offsets, Dsa3dInput dout, const float *lse,
    const float *delta, Dsa3dOutput dq, Dsa3dOutput dk, Dsa3dOutput dv) {
  backward(cfg, q, k, v, offsets, nullptr, dout, lse, delta, dq, dk, dv);
}

void megaslide::cpu::dsa3dRowDot(const Dsa3dConfig &cfg, Dsa3dInput out,
                                 Dsa3dInput dout, float *delta) {
  assert(cfg.validate().empty() && "invalid 3D-DSA configuration");
  const int64_t N = cfg.tokens();
  for (int64_t b = 0; b < cfg.batch; ++b)
    for (int64_t h = 0; h < cfg.heads; ++h)
      for (int64_t token = 0; token < N; ++token)
        delta[(b * cfg.heads + h) * N + token] =
            dot(dout.row(b, h, token), out.row(b, h, token), cfg.headDim);
}

//===----------------------------------------------------------------------===//
// Offset estimation
//===----------------------------------------------------------------------===//

void megaslide::cpu::dsa3dOffsets(const Dsa3dConfig &cfg, Dsa3dInput q,
                                  Dsa3dInput k, int64_t radius,
                                  int32_t *offsets) {
  assert(cfg.validate().empty() && "invalid 3D-DSA configuration");
  assert(radius >= 0 && "negative block-matching radius");
  std::array<int64_t, 3> n = cfg.numTiles();
  const int64_t tiles = n[0] * n[1] * n[2];
  const int64_t D = cfg.headDim, Y = cfg.Y, X = cfg.X;
  const int64_t kt = cfg.window[0], ky = cfg.window[1], kx = cfg.window[2];
  // A displacement beyond the grid extent clamps to the same window as one
  // of at most the extent, which also wins the tie-break (smaller |dy| +
  // |dx|): capping changes no result and bounds the (2R + 1)^2 candidates
  // (a radius of 2^40 from Python would otherwise exhaust memory).
  radius = std::min(radius, std::max(Y, X));

  // Candidates in tie-break order (|dy| + |dx|, dy, dx): scanning in this
  // order and keeping only strictly better scores implements the rule.
  std::vector<std::pair<int32_t, int32_t>> candidates;
  for (int64_t dy = -radius; dy <= radius; ++dy)
    for (int64_t dx = -radius; dx <= radius; ++dx)
      candidates.emplace_back(static_cast<int32_t>(dy),
                              static_cast<int32_t>(dx));
  std::sort(candidates.begin(), candidates.end(), [](auto a, auto b) {
    int64_t la = std::abs(a.first) + std::abs(a.second);
    int64_t lb = std::abs(b.first) + std::abs(b.second);
    return std::make_tuple(la, a.first, a.second) <
           std::make_tuple(lb, b.first, b.second);
  });

  parallelFor(cfg.batch * cfg.heads, [&] {
    // One frame's summed-area table: sat[(y * (X + 1) + x) * D + d] is the
    // sum of keys [0, y) x [0, x) of that frame, so any window sum costs
    // four rows. Double keeps the differences of large prefix sums exact
    // enough that equal windows always score equal.
    return [&, sat = std::vector<double>((Y + 1) * (X + 1) * D),
            queryMean = std::vector<double>(tiles * D),
            windowSum = std::vector<double>(D),
            tileList = std::vector<QueryTile>()](int64_t item) mutable {
      int64_t b = item / cfg.heads, h = item % cfg.heads;
      tileList.clear();
      for (int64_t tileIndex = 0; tileIndex < tiles; ++tileIndex) {
        tileList.push_back(tileAt(cfg, tileIndex));
        double *mean = &queryMean[tileIndex * D];
        std::fill_n(mean, D, 0.0);
        tileList.back().forEachQuery(cfg, [&](int64_t token) {
          const float *qi = q.row(b, h, token);
          for (int64_t d = 0; d < D; ++d)
            mean[d] += qi[d];
        });
        double inv = 1.0 / tileList.back().size();
        for (int64_t d = 0; d < D; ++d)
          mean[d] *= inv;
      }
      const double invArea = 1.0 / static_cast<double>(ky * kx);
      auto satRow = [&](int64_t y, int64_t x) {
        return &sat[(y * (X + 1) + x) * D];
      };
      // Frame-major so that only one table is alive: every tile whose
      // temporal window contains frame t is matched against it.
      for (int64_t t = 0; t < cfg.T; ++t) {
        std::fill_n(satRow(0, 0), (X + 1) * D, 0.0);
        for (int64_t y = 0; y < Y; ++y) {
          std::fill_n(satRow(y + 1, 0), D, 0.0);
          for (int64_t x = 0; x < X; ++x) {
            const float *kr = k.row(b, h, (t * Y + y) * X + x);
            const double *up = satRow(y, x + 1), *left = satRow(y + 1, x),
                         *diag = satRow(y, x);
            double *cur = satRow(y + 1, x + 1);
            for (int64_t d = 0; d < D; ++d)
              cur[d] = kr[d] + up[d] + left[d] - diag[d];
          }
        }
        for (int64_t tileIndex = 0; tileIndex < tiles; ++tileIndex) {
          const QueryTile &tile = tileList[tileIndex];
          int64_t j = t - tile.keyFrameStart;
          if (j < 0 || j >= kt)
            continue;
          const double *mean = &queryMean[tileIndex * D];
          double best = -std::numeric_limits<double>::infinity();
          std::pair<int32_t, int32_t> bestOffset{0, 0};
          for (auto [dy, dx] : candidates) {
            auto [sy, sx] = tile.spatialStart(cfg, dy, dx);
            const double *a = satRow(sy + ky, sx + kx),
                         *bl = satRow(sy + ky, sx), *tr = satRow(sy, sx + kx),
                         *tl = satRow(sy, sx);
            for (int64_t d = 0; d < D; ++d)
              windowSum[d] = (a[d] - bl[d]) - (tr[d] - tl[d]);
            double score = 0;
            for (int64_t d = 0; d < D; ++d)
              score += mean[d] * windowSum[d];
            score *= invArea;
            if (score > best) {
              best = score;
              bestOffset = {dy, dx};
            }
          }
          int32_t *o = tileOffsets(cfg, offsets, b, h, tileIndex) + 2 * j;
          o[0] = bestOffset.first;
          o[1] = bestOffset.second;
        }
      }
    };
  });
}
