//===- Video.cpp - cpu kernels of the video DiT graph ops -----------------===//
//
// fp32 reference kernels of the ops specific to video diffusion transformers:
// patch embedding and (un)patchify, timestep and label embeddings, 3D RoPE,
// global attention, 3D-DSA (wrapping cpu/Dsa3d.h) and rectified-flow
// interpolation and loss, forward and backward. Semantics are those of the
// op descriptions in dialects/Graph/GraphOps.td; each backward op computes
// what dialects/Graph/GraphGradients.cpp emits it for.
//
// Every kernel checks its instruction before touching memory
// (kernels/Checks.h). Parameter gradients summed over all tokens accumulate
// in double.
// Hot loops vectorise without -ffast-math: they run along a contiguous axis
// or keep a fixed number of partial sums combined in a fixed order. Results
// do not depend on the thread count: the attention forward gives each query
// block, its backward each (batch, head), to exactly one thread, like the
// 3D-DSA kernels it sits next to. Attention's products are oneDNN's sgemm,
// so its bits are the same at any thread count on one machine but not
// across instruction sets (cpu/Gemm.h).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/ParallelFor.h"
#include "megaslide/runtime/cpu/VecMath.h"
#include "megaslide/runtime/cpu/kernels/Checks.h"
#include "megaslide/runtime/cpu/kernels/Registry.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Twine.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using namespace megaslide;
using namespace megaslide::cpu;

using exec::OpCode;
using llvm::ArrayRef;
using llvm::Error;
using llvm::Expected;
using llvm::StringRef;

namespace {

using Triple = std::array<int64_t, 3>;

//===----------------------------------------------------------------------===//
// Checking instructions
//===----------------------------------------------------------------------===//

/// Whether `t` arrived as int32 (3D-DSA offsets).
bool isInt32(const OpTensor &t) {
  return t.i32 ||
         (t.type.numElements() == 0 && t.type.dtype == exec::DType::I32);
}

/// An integer attribute triple (grid, patch, window, ...), each entry at
/// least `minValue`.
Expected<Triple> tripleAttr(const exec::Instruction &inst, StringRef name,
                            int64_t minValue) {
  std::optional<std::vector<int64_t>> v = inst.intsAttr(name);
  if (!v)
    return opError(inst, "missing integer array attribute '" + name + "'");
  if (v->size() != 3)
    return opError(inst, "attribute '" + name + "' must have 3 entries, got " +
                             shapeString(*v));
  for (int64_t x : *v)
    if (x < minValue)
      return opError(inst, "attribute '" + name + "' " + shapeString(*v) +
                               " must have entries of at least " +
                               llvm::Twine(minValue));
  return Triple{(*v)[0], (*v)[1], (*v)[2]};
}

/// t[0] * t[1] * t[2] for the extents of a grid attribute, or -1 when that
/// overflows: the attribute is untrusted input, compared against a real
/// token count.
int64_t volume(const Triple &t) {
  int64_t v = 1;
  for (int64_t x : t)
    if (__builtin_mul_overflow(v, x, &v))
      return -1;
  return v;
}

/// The grid attribute (T, Y, X) of an op over `tokens` tokens per sample.
Expected<Triple> gridAttr(const exec::Instruction &inst, int64_t tokens) {
  Expected<Triple> grid = tripleAttr(inst, "grid", 1);
  if (!grid)
    return grid.takeError();
  if (volume(*grid) != tokens)
    return opError(inst, "token count " + llvm::Twine(tokens) +
                             " does not match grid " + shapeString(*grid));
  return grid;
}

/// The optional softmax scale of the attention ops: 1/sqrt(head dim) when
/// absent, else a positive finite number (as the verifiers require).
Expected<double> scaleAttr(const exec::Instruction &inst, int64_t headDim) {
  if (!inst.attr("scale")) {
    if (headDim <= 0)
      return opError(inst,
                     "head dim must be positive, got " + llvm::Twine(headDim));
    return 1.0 / std::sqrt(static_cast<double>(headDim));
  }
  std::optional<double> s = inst.floatAttr("scale");
  if (!s || !(*s > 0) || !std::isfinite(*s))
    return opError(inst, "attribute 'scale' must be positive and finite");
  return *s;
}

/// A UnitAttr: the plan writer emits the key (as integer 1) when the unit
/// attribute is set and leaves it out otherwise. An explicit 0 is read as
/// unset so that a writer spelling booleans out is understood too; any
/// other spelling of a present key counts as set.
bool unitAttr(const exec::Instruction &inst, StringRef name) {
  const exec::Attr *a = inst.attr(name);
  if (!a)
    return false;
  if (const int64_t *i = std::get_if<int64_t>(a))
    return *i != 0;
  if (const double *d = std::get_if<double>(a))
    return *d != 0;
  return true;
}

//===----------------------------------------------------------------------===//
// Patches
//===----------------------------------------------------------------------===//

/// Latents [B, C, T*pt, Y*ph, X*pw] seen as a (T, Y, X) grid of patches.
struct PatchGrid {
  int64_t batch = 0, channels = 0;
  Triple patch{}, grid{}, extent{};

  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
  int64_t patchVolume() const { return patch[0] * patch[1] * patch[2]; }
  /// Values per token: pt * ph * pw * C.
  int64_t tokenWidth() const { return patchVolume() * channels; }

  /// Calls fn(offset in the token row, latent index) for every value of
  /// token n of sample b; the token row is laid out (pt, ph, pw, C),
  /// channels fastest, as unpatchify's description states.
  template <typename Fn> void forEachValue(int64_t b, int64_t n, Fn fn) const {
    int64_t gt = n / (grid[1] * grid[2]), gy = n / grid[2] % grid[1],
            gx = n % grid[2];
    int64_t plane = extent[0] * extent[1] * extent[2];
    for (int64_t i = 0; i < patch[0]; ++i)
      for (int64_t j = 0; j < patch[1]; ++j)
        for (int64_t k = 0; k < patch[2]; ++k) {
          int64_t t = gt * patch[0] + i, y = gy * patch[1] + j,
                  x = gx * patch[2] + k;
          int64_t pixel = (t * extent[1] + y) * extent[2] + x;
          int64_t within = ((i * patch[1] + j) * patch[2] + k) * channels;
          for (int64_t c = 0; c < channels; ++c)
            fn(within + c, (b * channels + c) * plane + pixel);
        }
  }

  /// Calls fn(token index, latent index) for every value of every token,
  /// the token index into tokens [B, N, pt*ph*pw*C]: (un)patchify's copy.
  template <typename Fn> void forEachTokenValue(Fn fn) const {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t n = 0; n < tokens(); ++n) {
        int64_t row = (b * tokens() + n) * tokenWidth();
        forEachValue(b, n, [&](int64_t within, int64_t index) {
          fn(row + within, index);
        });
      }
  }

  /// Copies token n of sample b into `p` in the order of a patch_embed
  /// weight row [C, pt, ph, pw], so the weight applies to it as a matrix.
  void gatherForWeight(const float *latents, int64_t b, int64_t n,
                       float *p) const {
    int64_t size = patchVolume();
    forEachValue(b, n, [&](int64_t within, int64_t index) {
      int64_t c = within % channels, ijk = within / channels;
      p[c * size + ijk] = latents[index];
    });
  }
};

/// The patch grid of latents [B, C, T, H, W] cut into `patch`.
Expected<PatchGrid> patchGrid(const exec::Instruction &inst,
                              const OpTensor &latents, StringRef name,
                              Triple patch) {
  if (Error e = checkFloatRank(inst, latents, name, 5, "[B, C, T, H, W]"))
    return std::move(e);
  const std::vector<int64_t> &s = latents.type.shape;
  PatchGrid g;
  g.batch = s[0];
  g.channels = s[1];
  g.patch = patch;
  for (int a = 0; a < 3; ++a) {
    if (patch[a] <= 0 || s[2 + a] % patch[a] != 0)
      return opError(inst, name + " extents " +
                               shapeString(ArrayRef<int64_t>(s).drop_front(2)) +
                               " are not divisible by the patch " +
                               shapeString(patch));
    g.extent[a] = s[2 + a];
    g.grid[a] = s[2 + a] / patch[a];
  }
  return g;
}

/// The patch grid of patch_embed's latents `x` cut by the patch of its
/// weight (or weight gradient) `w` [D, C, pt, ph, pw].
Expected<PatchGrid> patchEmbedGrid(const exec::Instruction &inst,
                                   const OpTensor &x, const OpTensor &w,
                                   StringRef wName) {
  if (Error e = checkFloatRank(inst, w, wName, 5, "[D, C, pt, ph, pw]"))
    return std::move(e);
  const std::vector<int64_t> &ws = w.type.shape;
  Expected<PatchGrid> g = patchGrid(inst, x, "input", {ws[2], ws[3], ws[4]});
  if (!g)
    return g.takeError();
  if (ws[1] != g->channels)
    return opError(inst, wName + " has " + llvm::Twine(ws[1]) +
                             " input channels but the latents have " +
                             llvm::Twine(g->channels));
  return g;
}

Error patchEmbed(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                 ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 1))
    return e;
  const OpTensor &x = operands[0], &w = operands[1], &bias = operands[2];
  Expected<PatchGrid> g = patchEmbedGrid(inst, x, w, "weight");
  if (!g)
    return g.takeError();
  int64_t dim = w.type.shape[0], width = g->tokenWidth(), N = g->tokens();
  if (Error e = checkFloatShape(inst, bias, "bias", {dim}))
    return e;
  if (Error e = checkFloatShape(inst, results[0], "result", {g->batch, N, dim}))
    return e;

  // The transposed weight [K, D] turns each token's projection into K
  // contiguous axpys over D, which vectorise without reassociation.
  std::vector<float> wT(width * dim), patch(width);
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t k = 0; k < width; ++k)
      wT[k * dim + d] = w.f32[d * width + k];
  for (int64_t b = 0; b < g->batch; ++b)
    for (int64_t n = 0; n < N; ++n) {
      g->gatherForWeight(x.f32, b, n, patch.data());
      float *out = results[0].f32 + (b * N + n) * dim;
      std::copy_n(bias.f32, dim, out);
      for (int64_t k = 0; k < width; ++k)
        axpy(out, patch[k], &wT[k * dim], dim);
    }
  return Error::success();
}

Error patchEmbedGrad(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                     ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, 2))
    return e;
  const OpTensor &x = operands[0], &dy = operands[1];
  const OpTensor &dw = results[0], &db = results[1];
  Expected<PatchGrid> g = patchEmbedGrid(inst, x, dw, "weight_grad");
  if (!g)
    return g.takeError();
  int64_t dim = dw.type.shape[0], width = g->tokenWidth(), N = g->tokens();
  if (Error e = checkFloatShape(inst, dy, "result_grad", {g->batch, N, dim}))
    return e;
  if (Error e = checkFloatShape(inst, db, "bias_grad", {dim}))
    return e;

  // Sums over all tokens of the batch: double accumulators keep the
  // gradient of a long video accurate.
  std::vector<double> accW(dim * width, 0.0), accB(dim, 0.0);
  std::vector<float> patch(width);
  for (int64_t b = 0; b < g->batch; ++b)
    for (int64_t n = 0; n < N; ++n) {
      g->gatherForWeight(x.f32, b, n, patch.data());
      const float *gy = dy.f32 + (b * N + n) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        double a = gy[d];
        accB[d] += a;
        double *row = &accW[d * width];
        for (int64_t k = 0; k < width; ++k)
          row[k] += a * patch[k];
      }
    }
  for (int64_t i = 0; i < dim * width; ++i)
    dw.f32[i] = static_cast<float>(accW[i]);
  for (int64_t d = 0; d < dim; ++d)
    db.f32[d] = static_cast<float>(accB[d]);
  return Error::success();
}

/// Checks tokens [B, N, pt*ph*pw*C] against the patch grid of the latents.
Error checkTokens(const exec::Instruction &inst, const OpTensor &tokens,
                  StringRef name, const PatchGrid &g) {
  return checkFloatShape(inst, tokens, name,
                         {g.batch, g.tokens(), g.tokenWidth()});
}

Error unpatchify(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                 ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  Expected<Triple> grid = tripleAttr(inst, "grid", 1);
  if (!grid)
    return grid.takeError();
  Expected<Triple> patch = tripleAttr(inst, "patch", 1);
  if (!patch)
    return patch.takeError();
  Expected<PatchGrid> g = patchGrid(inst, results[0], "result", *patch);
  if (!g)
    return g.takeError();
  if (g->grid != *grid)
    return opError(inst, "grid " + shapeString(*grid) + " times patch " +
                             shapeString(*patch) + " does not give latents " +
                             shapeString(g->extent));
  if (Error e = checkTokens(inst, operands[0], "input", *g))
    return e;
  const float *in = operands[0].f32;
  float *out = results[0].f32;
  g->forEachTokenValue(
      [&](int64_t token, int64_t latent) { out[latent] = in[token]; });
  return Error::success();
}

Error patchify(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
               ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  Expected<Triple> patch = tripleAttr(inst, "patch", 1);
  if (!patch)
    return patch.takeError();
  Expected<PatchGrid> g = patchGrid(inst, operands[0], "input", *patch);
  if (!g)
    return g.takeError();
  if (Error e = checkTokens(inst, results[0], "result", *g))
    return e;
  const float *in = operands[0].f32;
  float *out = results[0].f32;
  g->forEachTokenValue(
      [&](int64_t token, int64_t latent) { out[token] = in[latent]; });
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Timestep and label embeddings
//===----------------------------------------------------------------------===//

Error timestepEmbedding(const exec::Instruction &inst,
                        ArrayRef<OpTensor> operands,
                        ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  if (Error e = checkFloatRank(inst, operands[0], "timesteps", 1, "[B]"))
    return e;
  if (Error e = checkFloatRank(inst, results[0], "result", 2, "[B, dim]"))
    return e;
  int64_t batch = operands[0].type.shape[0];
  int64_t width = results[0].type.shape[1];
  if (results[0].type.shape[0] != batch)
    return opError(inst,
                   "result batch " + llvm::Twine(results[0].type.shape[0]) +
                       " does not match " + llvm::Twine(batch) + " timesteps");
  if (width <= 0 || width % 2 != 0)
    return opError(inst, "embedding width must be positive and even, got " +
                             llvm::Twine(width));
  Expected<double> maxPeriod = finiteFloatAttr(inst, "max_period", 10000.0);
  if (!maxPeriod)
    return maxPeriod.takeError();
  if (!(*maxPeriod > 1))
    return opError(inst, "max_period must exceed 1");
  Expected<double> timeScale = finiteFloatAttr(inst, "time_scale", 1.0);
  if (!timeScale)
    return timeScale.takeError();

  // Angles in double: time_scale * t reaches ~1000, where fp32 would lose
  // the low frequencies' phase to rounding.
  int64_t half = width / 2;
  std::vector<double> freqs(half);
  for (int64_t i = 0; i < half; ++i)
    freqs[i] = std::exp(-std::log(*maxPeriod) * static_cast<double>(i) /
                        static_cast<double>(half));
  for (int64_t b = 0; b < batch; ++b) {
    double s = *timeScale * static_cast<double>(operands[0].f32[b]);
    float *out = results[0].f32 + b * width;
    for (int64_t i = 0; i < half; ++i) {
      out[i] = static_cast<float>(std::cos(s * freqs[i]));
      out[half + i] = static_cast<float>(std::sin(s * freqs[i]));
    }
  }
  return Error::success();
}

/// Checks embedding (ids [B], table [V, D]) -> rows [B, D] or its gradient
/// (ids, result_grad [B, D]) -> table_grad [V, D]; returns the ids (i32 or
/// i64 in the plan), each in [0, V).
Expected<std::vector<int64_t>> checkEmbedding(const exec::Instruction &inst,
                                              ArrayRef<OpTensor> operands,
                                              ArrayRef<OpTensor> results,
                                              bool grad) {
  if (Error e = checkArity(inst, operands, results, 2, 1))
    return std::move(e);
  const OpTensor &table = grad ? results[0] : operands[1];
  const OpTensor &rows = grad ? operands[1] : results[0];
  StringRef tableName = grad ? "table_grad" : "table";
  StringRef rowsName = grad ? "result_grad" : "result";
  if (Error e = checkFloatRank(inst, table, tableName, 2, "[V, D]"))
    return std::move(e);
  int64_t numRows = table.type.shape[0], dim = table.type.shape[1];
  const OpTensor &ids = operands[0];
  if (!ids.i32 && !ids.i64 &&
      !(ids.type.numElements() == 0 && (ids.type.dtype == exec::DType::I32 ||
                                        ids.type.dtype == exec::DType::I64)))
    return opError(inst, "'ids' must be an i32 or i64 tensor");
  if (ids.type.shape.size() != 1)
    return opError(inst, "'ids' must have rank 1 [B], got " +
                             shapeString(ids.type.shape));
  if (Error e = checkExtents(inst, ids, "ids"))
    return std::move(e);
  std::vector<int64_t> out(ids.type.shape[0]);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = ids.i64 ? ids.i64[i] : ids.i32[i];
    if (out[i] < 0 || out[i] >= numRows)
      return opError(inst, "id " + llvm::Twine(out[i]) + " at position " +
                               llvm::Twine(i) + " is outside the table of " +
                               llvm::Twine(numRows) + " rows");
  }
  int64_t batch = static_cast<int64_t>(out.size());
  if (Error e = checkFloatShape(inst, rows, rowsName, {batch, dim}))
    return std::move(e);
  return out;
}

Error embedding(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                ArrayRef<OpTensor> results) {
  Expected<std::vector<int64_t>> ids =
      checkEmbedding(inst, operands, results, /*grad=*/false);
  if (!ids)
    return ids.takeError();
  const OpTensor &table = operands[1];
  int64_t batch = static_cast<int64_t>(ids->size()), dim = table.type.shape[1];
  for (int64_t b = 0; b < batch; ++b)
    std::copy_n(table.f32 + (*ids)[b] * dim, dim, results[0].f32 + b * dim);
  return Error::success();
}

Error embeddingGrad(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                    ArrayRef<OpTensor> results) {
  Expected<std::vector<int64_t>> ids =
      checkEmbedding(inst, operands, results, /*grad=*/true);
  if (!ids)
    return ids.takeError();
  const OpTensor &dt = results[0];
  int64_t batch = static_cast<int64_t>(ids->size());
  int64_t rows = dt.type.shape[0], dim = dt.type.shape[1];
  // Repeated ids add up, in batch order (deterministic).
  std::fill_n(dt.f32, rows * dim, 0.0f);
  for (int64_t b = 0; b < batch; ++b)
    axpy(dt.f32 + (*ids)[b] * dim, 1.0f, operands[1].f32 + b * dim, dim);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// 3D RoPE
//===----------------------------------------------------------------------===//

Error rope3d(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
             ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  const OpTensor &x = operands[0];
  if (Error e = checkFloatRank(inst, x, "input", 4, "[B, N, H, Dh]"))
    return e;
  if (Error e = checkFloatShape(inst, results[0], "result", x.type.shape))
    return e;
  const std::vector<int64_t> &s = x.type.shape;
  int64_t batch = s[0], N = s[1], heads = s[2], headDim = s[3];
  Expected<Triple> grid = gridAttr(inst, N);
  if (!grid)
    return grid.takeError();
  Expected<Triple> dims = tripleAttr(inst, "dims", 0);
  if (!dims)
    return dims.takeError();
  Expected<double> theta = finiteFloatAttr(inst, "theta", 10000.0);
  if (!theta)
    return theta.takeError();
  // Bounding each part first keeps the sum of untrusted values in range.
  if (llvm::any_of(*dims,
                   [&](int64_t d) { return d % 2 != 0 || d > headDim; }) ||
      (*dims)[0] + (*dims)[1] + (*dims)[2] != headDim)
    return opError(inst, "dims " + shapeString(*dims) +
                             " must be even and sum to the head dim " +
                             llvm::Twine(headDim));
  if (!(*theta > 1))
    return opError(inst, "theta must exceed 1");
  // The adjoint of a rotation is the rotation by the negated angle.
  double sign = unitAttr(inst, "inverse") ? -1.0 : 1.0;

  // cos/sin per axis, position and channel pair, computed once in double:
  // positions times low frequencies would lose phase in fp32. Laid out as
  // cpu/VecMath.h's rotatePairs reads them: each pair's cosine twice and its
  // sine as (-sin, sin), so x0 c - x1 s and x0 s + x1 c are what the
  // baseline computes.
  std::array<std::vector<float>, 3> cosTab, sinTab;
  for (int a = 0; a < 3; ++a) {
    int64_t pairs = (*dims)[a] / 2;
    cosTab[a].resize((*grid)[a] * (*dims)[a]);
    sinTab[a].resize((*grid)[a] * (*dims)[a]);
    for (int64_t pos = 0; pos < (*grid)[a]; ++pos)
      for (int64_t i = 0; i < pairs; ++i) {
        double freq = std::pow(*theta, -2.0 * static_cast<double>(i) /
                                           static_cast<double>((*dims)[a]));
        double angle = sign * static_cast<double>(pos) * freq;
        float c = static_cast<float>(std::cos(angle));
        float sn = static_cast<float>(std::sin(angle));
        int64_t at = pos * (*dims)[a] + 2 * i;
        cosTab[a][at] = cosTab[a][at + 1] = c;
        sinTab[a][at] = -sn;
        sinTab[a][at + 1] = sn;
      }
  }

  // Pairs are read before they are written, so the result may alias the
  // input. Each token is rotated by one thread.
  const float *in = x.f32;
  float *out = results[0].f32;
  const VecKernels &vec = vecKernels();
  parallelRanges(
      batch * N, std::max<int64_t>(1, (1 << 14) / (heads * headDim)),
      [&](int64_t t0, int64_t t1) {
        // The token's tables for the whole head dim, shared by its heads.
        std::vector<float> c(headDim), sn(headDim);
        for (int64_t t = t0; t < t1; ++t) {
          int64_t n = t % N;
          const int64_t pos[3] = {n / ((*grid)[1] * (*grid)[2]),
                                  n / (*grid)[2] % (*grid)[1], n % (*grid)[2]};
          int64_t channel = 0;
          for (int a = 0; a < 3; ++a) {
            // data(), not operator[]: an axis may have no channels at all.
            std::copy_n(cosTab[a].data() + pos[a] * (*dims)[a], (*dims)[a],
                        c.data() + channel);
            std::copy_n(sinTab[a].data() + pos[a] * (*dims)[a], (*dims)[a],
                        sn.data() + channel);
            channel += (*dims)[a];
          }
          for (int64_t h = 0; h < heads; ++h) {
            int64_t row = (t * heads + h) * headDim;
            vec.rotatePairs(in + row, c.data(), sn.data(), out + row, headDim);
          }
        }
      });
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Global attention
//===----------------------------------------------------------------------===//

/// Shapes of q [B, Nq, H, Dh] and k, v [B, Nk, H, Dh].
struct AttentionShape {
  int64_t batch = 0, nq = 0, nk = 0, heads = 0, headDim = 0;
  float scale = 0;

  /// Offset of row (b, n, h) of a [B, tokens, H, Dh] tensor.
  int64_t row(int64_t b, int64_t n, int64_t tokens, int64_t h) const {
    return ((b * tokens + n) * heads + h) * headDim;
  }
  /// Distance between the rows of consecutive tokens of one head.
  int64_t tokenStride() const { return heads * headDim; }
};

Expected<AttentionShape> attentionShape(const exec::Instruction &inst,
                                        ArrayRef<OpTensor> operands) {
  const OpTensor &q = operands[0], &k = operands[1], &v = operands[2];
  if (Error e = checkFloatRank(inst, q, "query", 4, "[B, N, H, Dh]"))
    return std::move(e);
  if (Error e = checkFloatRank(inst, k, "key", 4, "[B, N, H, Dh]"))
    return std::move(e);
  const std::vector<int64_t> &qs = q.type.shape, &ks = k.type.shape;
  if (qs[0] != ks[0] || qs[2] != ks[2] || qs[3] != ks[3])
    return opError(inst, "query " + shapeString(qs) + " and key " +
                             shapeString(ks) +
                             " differ in batch, heads or head dim");
  if (Error e = checkFloatShape(inst, v, "value", ks))
    return std::move(e);
  AttentionShape a{qs[0], qs[1], ks[1], qs[2], qs[3]};
  if (a.headDim <= 0)
    return opError(inst,
                   "head dim must be positive, got " + llvm::Twine(a.headDim));
  // A softmax over no keys is undefined.
  if (a.nk <= 0 && a.nq > 0)
    return opError(inst,
                   "attends " + llvm::Twine(a.nq) + " queries to no keys");
  Expected<double> scale = scaleAttr(inst, a.headDim);
  if (!scale)
    return scale.takeError();
  a.scale = static_cast<float>(*scale);
  return a;
}

// Both kernels work on blocks of up to kQueryBlock queries of one (batch,
// head) against all its keys, on oneDNN's sgemm (cpu/Gemm.h) straight from
// the strided [B, N, H, Dh] layout: S = scale Q K^T is kQueryBlock x Nk,
// the only scratch, and blocks depend on Nq alone, so every product has
// the same shape at any thread count.

/// Queries per block: 64 rows keep the GEMMs near oneDNN's large-matrix
/// speed while S and dP stay 2 * 64 * Nk floats per thread (the old
/// transposed K and V copies were 2 * Dh * Nk).
constexpr int64_t kQueryBlock = 64;

int64_t queryBlocks(const AttentionShape &a) {
  return (a.nq + kQueryBlock - 1) / kQueryBlock;
}

/// Leaves softmax(scale q k^T) of queries [i0, i0 + rows) of head (b, h)
/// in p (rows x Nk). Forward and backward both call this on the same
/// blocks, so the backward recomputes bit for bit the forward's
/// probabilities.
void softmaxBlock(const AttentionShape &a, const float *q, const float *k,
                  int64_t b, int64_t h, int64_t i0, int64_t rows, float *p) {
  const int64_t stride = a.tokenStride(), nk = a.nk;
  gemmSerial(rows, nk, a.headDim, a.scale, {q + a.row(b, i0, a.nq, h), stride},
             {k + a.row(b, 0, nk, h), stride, true}, 0.0f, p, nk);
  for (int64_t r = 0; r < rows; ++r) {
    float *s = p + r * nk;
    float inv = 1.0f / expSubAndSum(s, nk, maxOf(s, nk));
    for (int64_t j = 0; j < nk; ++j)
      s[j] *= inv;
  }
}

Error attention(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 1))
    return e;
  Expected<AttentionShape> shape = attentionShape(inst, operands);
  if (!shape)
    return shape.takeError();
  const AttentionShape a = *shape;
  if (Error e =
          checkFloatShape(inst, results[0], "result", operands[0].type.shape))
    return e;
  const float *q = operands[0].f32, *k = operands[1].f32, *v = operands[2].f32;
  float *out = results[0].f32;
  const int64_t D = a.headDim, stride = a.tokenStride(),
                blocks = queryBlocks(a);

  // Items are query blocks, each writing only its own rows of `out`: more
  // items than (batch, head) pairs when there are few heads.
  parallelFor(a.batch * a.heads * blocks, [&] {
    return [&, probs = std::vector<float>(kQueryBlock * a.nk)](
               int64_t item) mutable {
      int64_t b = item / (a.heads * blocks), h = item / blocks % a.heads;
      int64_t i0 = item % blocks * kQueryBlock;
      int64_t rows = std::min(kQueryBlock, a.nq - i0);
      softmaxBlock(a, q, k, b, h, i0, rows, probs.data());
      gemmSerial(rows, D, a.nk, 1.0f, {probs.data(), a.nk},
                 {v + a.row(b, 0, a.nk, h), stride}, 0.0f,
                 out + a.row(b, i0, a.nq, h), stride);
    };
  });
  return Error::success();
}

Error attentionGrad(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                    ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 5, 3))
    return e;
  Expected<AttentionShape> shape = attentionShape(inst, operands);
  if (!shape)
    return shape.takeError();
  const AttentionShape a = *shape;
  const std::vector<int64_t> &qs = operands[0].type.shape,
                             &ks = operands[1].type.shape;
  const std::pair<const OpTensor *, const char *> checks[] = {
      {&operands[3], "output"},
      {&operands[4], "output_grad"},
      {&results[0], "query_grad"},
      {&results[1], "key_grad"},
      {&results[2], "value_grad"}};
  for (auto [t, name] : checks)
    if (Error e = checkFloatShape(
            inst, *t, name, t == &results[1] || t == &results[2] ? ks : qs))
      return e;
  const float *q = operands[0].f32, *k = operands[1].f32, *v = operands[2].f32;
  const float *o = operands[3].f32, *dout = operands[4].f32;
  float *dq = results[0].f32, *dk = results[1].f32, *dv = results[2].f32;
  const int64_t D = a.headDim, nk = a.nk, stride = a.tokenStride();

  // One (batch, head) per item: its dK and dV are summed by one thread over
  // the query blocks in order, so no atomics and no thread-count dependence.
  parallelFor(a.batch * a.heads, [&] {
    return [&, probs = std::vector<float>(kQueryBlock * nk),
            dprobs = std::vector<float>(kQueryBlock * nk)](
               int64_t item) mutable {
      int64_t b = item / a.heads, h = item % a.heads;
      const float *kh = k + a.row(b, 0, nk, h), *vh = v + a.row(b, 0, nk, h);
      float *dkh = dk + a.row(b, 0, nk, h), *dvh = dv + a.row(b, 0, nk, h);
      if (a.nq == 0)
        for (int64_t j = 0; j < nk; ++j) {
          std::fill_n(dkh + j * stride, D, 0.0f);
          std::fill_n(dvh + j * stride, D, 0.0f);
        }
      for (int64_t i0 = 0; i0 < a.nq; i0 += kQueryBlock) {
        int64_t rows = std::min(kQueryBlock, a.nq - i0);
        const float *qb = q + a.row(b, i0, a.nq, h);
        const float *dob = dout + a.row(b, i0, a.nq, h);
        const float *ob = o + a.row(b, i0, a.nq, h);
        // P is recomputed rather than stored: O(Nk) memory per query.
        softmaxBlock(a, q, k, b, h, i0, rows, probs.data());
        gemmSerial(rows, nk, D, 1.0f, {dob, stride}, {vh, stride, true}, 0.0f,
                   dprobs.data(), nk);
        for (int64_t r = 0; r < rows; ++r) {
          // rowsum(dO * O) = sum_j P_ij dP_ij: the softmax Jacobian's
          // correction, from the forward's output as FlashAttention does.
          float delta = dot(dob + r * stride, ob + r * stride, D);
          const float *p = &probs[r * nk];
          float *ds = &dprobs[r * nk];
          for (int64_t j = 0; j < nk; ++j)
            ds[j] = p[j] * (ds[j] - delta);
        }
        // dQ = scale dS K; dK += scale dS^T Q; dV += P^T dO (the first
        // block overwrites).
        float beta = i0 == 0 ? 0.0f : 1.0f;
        gemmSerial(rows, D, nk, a.scale, {dprobs.data(), nk}, {kh, stride},
                   0.0f, dq + a.row(b, i0, a.nq, h), stride);
        gemmSerial(nk, D, rows, a.scale, {dprobs.data(), nk, true},
                   {qb, stride}, beta, dkh, stride);
        gemmSerial(nk, D, rows, 1.0f, {probs.data(), nk, true}, {dob, stride},
                   beta, dvh, stride);
      }
    };
  });
  return Error::success();
}

//===----------------------------------------------------------------------===//
// 3D-DSA
//===----------------------------------------------------------------------===//

/// The configuration of a 3D-DSA op from q [B, N, H, Dh] and the grid,
/// window and tile attributes; `withScale` reads the softmax scale too.
Expected<Dsa3dConfig> dsaConfig(const exec::Instruction &inst,
                                const OpTensor &q, bool withScale) {
  if (Error e = checkFloatRank(inst, q, "query", 4, "[B, N, H, Dh]"))
    return std::move(e);
  const std::vector<int64_t> &s = q.type.shape;
  Expected<Triple> grid = gridAttr(inst, s[1]);
  if (!grid)
    return grid.takeError();
  Expected<Triple> window = tripleAttr(inst, "window", 1);
  if (!window)
    return window.takeError();
  Expected<Triple> tile = tripleAttr(inst, "tile", 1);
  if (!tile)
    return tile.takeError();
  Dsa3dConfig cfg;
  cfg.batch = s[0];
  cfg.heads = s[2];
  cfg.headDim = s[3];
  cfg.T = (*grid)[0];
  cfg.Y = (*grid)[1];
  cfg.X = (*grid)[2];
  cfg.window = *window;
  cfg.tile = *tile;
  cfg.scale = 1.0;
  if (withScale) {
    Expected<double> scale = scaleAttr(inst, cfg.headDim);
    if (!scale)
      return scale.takeError();
    cfg.scale = *scale;
  }
  std::string problem = cfg.validate();
  if (!problem.empty())
    return opError(inst, problem);
  return cfg;
}

/// The i32 offsets [B, H, nT, nY, nX, wt, 2] of `cfg`.
Error checkOffsets(const exec::Instruction &inst, const OpTensor &t,
                   const Dsa3dConfig &cfg) {
  if (!isInt32(t))
    return opError(inst, "'offsets' must be an i32 tensor");
  Triple n = cfg.numTiles();
  return checkShape(inst, t, "offsets",
                    {cfg.batch, cfg.heads, n[0], n[1], n[2], cfg.window[0], 2});
}

std::vector<int64_t> lseShape(const Dsa3dConfig &cfg) {
  return {cfg.batch, cfg.heads, cfg.tokens()};
}

Error dsa3d(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
            ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 4, 2))
    return e;
  Expected<Dsa3dConfig> cfg = dsaConfig(inst, operands[0], true);
  if (!cfg)
    return cfg.takeError();
  const std::vector<int64_t> &qs = operands[0].type.shape;
  if (Error e = checkFloatShape(inst, operands[1], "key", qs))
    return e;
  if (Error e = checkFloatShape(inst, operands[2], "value", qs))
    return e;
  if (Error e = checkOffsets(inst, operands[3], *cfg))
    return e;
  if (Error e = checkFloatShape(inst, results[0], "result", qs))
    return e;
  if (Error e = checkFloatShape(inst, results[1], "lse", lseShape(*cfg)))
    return e;
  dsa3dForward(*cfg, dsa3dGraphLayout(operands[0].f32, *cfg),
               dsa3dGraphLayout(operands[1].f32, *cfg),
               dsa3dGraphLayout(operands[2].f32, *cfg), operands[3].i32,
               dsa3dGraphLayout(results[0].f32, *cfg), results[1].f32);
  return Error::success();
}

Error dsa3dGrad(const exec::Instruction &inst, ArrayRef<OpTensor> operands,
                ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 7, 3))
    return e;
  Expected<Dsa3dConfig> cfg = dsaConfig(inst, operands[0], true);
  if (!cfg)
    return cfg.takeError();
  const std::vector<int64_t> &qs = operands[0].type.shape;
  const std::pair<const OpTensor *, const char *> same[] = {
      {&operands[1], "key"},       {&operands[2], "value"},
      {&operands[4], "output"},    {&operands[6], "output_grad"},
      {&results[0], "query_grad"}, {&results[1], "key_grad"},
      {&results[2], "value_grad"}};
  for (auto [t, name] : same)
    if (Error e = checkFloatShape(inst, *t, name, qs))
      return e;
  if (Error e = checkOffsets(inst, operands[3], *cfg))
    return e;
  if (Error e = checkFloatShape(inst, operands[5], "lse", lseShape(*cfg)))
    return e;
  auto view = [&](const OpTensor &t) { return dsa3dGraphLayout(t.f32, *cfg); };
  dsa3dBackward(*cfg, view(operands[0]), view(operands[1]), view(operands[2]),
                operands[3].i32, view(operands[4]), view(operands[6]),
                operands[5].f32, view(results[0]), view(results[1]),
                view(results[2]));
  return Error::success();
}

Error dsa3dOffsetsKernel(const exec::Instruction &inst,
                         ArrayRef<OpTensor> operands,
                         ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, 1))
    return e;
  Expected<Dsa3dConfig> cfg = dsaConfig(inst, operands[0], false);
  if (!cfg)
    return cfg.takeError();
  if (Error e =
          checkFloatShape(inst, operands[1], "key", operands[0].type.shape))
    return e;
  if (Error e = checkOffsets(inst, results[0], *cfg))
    return e;
  std::optional<int64_t> radius = inst.intAttr("radius");
  if (!radius || *radius < 0)
    return opError(inst, "needs a non-negative integer attribute 'radius'");
  // A displacement beyond the grid extent clamps to the same window as one
  // of at most the extent, which also wins the tie-break (smaller |dy| +
  // |dx|); capping changes no result and bounds the (2R + 1)^2 search.
  int64_t cap = std::max(cfg->Y, cfg->X);
  dsa3dOffsets(*cfg, dsa3dGraphLayout(operands[0].f32, *cfg),
               dsa3dGraphLayout(operands[1].f32, *cfg), std::min(*radius, cap),
               results[0].i32);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Flow matching
//===----------------------------------------------------------------------===//

Error flowInterpolate(const exec::Instruction &inst,
                      ArrayRef<OpTensor> operands, ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 1))
    return e;
  const OpTensor &x0 = operands[0];
  if (Error e =
          checkFloatRank(inst, x0, "latents", Count::atLeast(1), "[B, ...]"))
    return e;
  const std::vector<int64_t> &s = x0.type.shape;
  if (Error e = checkFloatShape(inst, operands[1], "noise", s))
    return e;
  if (Error e = checkFloatShape(inst, operands[2], "timesteps", {s[0]}))
    return e;
  if (Error e = checkFloatShape(inst, results[0], "result", s))
    return e;
  int64_t batch = s[0], per = batch ? x0.type.numElements() / batch : 0;
  for (int64_t b = 0; b < batch; ++b) {
    float t = operands[2].f32[b], keep = 1.0f - t;
    const float *x = x0.f32 + b * per, *n = operands[1].f32 + b * per;
    float *out = results[0].f32 + b * per;
    for (int64_t i = 0; i < per; ++i)
      out[i] = keep * x[i] + t * n[i];
  }
  return Error::success();
}

/// Prediction [B, Cp, ...] against latents and noise [B, C, ...], Cp >= C,
/// and the optional per-sample weights [B] (1 without).
struct LossShape {
  int64_t batch = 0, predChannels = 0, channels = 0, inner = 0;
  const float *weights = nullptr;
  int64_t count() const { return batch * channels * inner; }
  double weight(int64_t b) const { return weights ? weights[b] : 1.0; }
};

/// Checks the arity and operands (prediction, latents, noise and optional
/// weights) of the loss (with `results` results: 2 when weighted) and its
/// gradient (1).
Expected<LossShape> checkLoss(const exec::Instruction &inst,
                              ArrayRef<OpTensor> operands,
                              ArrayRef<OpTensor> results, bool grad) {
  if (Error e = checkArity(inst, operands, results, Count(3, 4),
                           grad ? Count(1) : Count(1, 2)))
    return std::move(e);
  bool weighted = operands.size() == 4;
  if (!grad && results.size() != (weighted ? 2u : 1u))
    return opError(inst, weighted ? "with weights returns the loss and the "
                                    "unweighted loss"
                                  : "without weights returns the loss only");
  const OpTensor &pred = operands[0], &x0 = operands[1];
  if (Error e = checkFloat(inst, pred, "prediction"))
    return std::move(e);
  if (Error e = checkFloat(inst, x0, "latents"))
    return std::move(e);
  const std::vector<int64_t> &p = pred.type.shape, &x = x0.type.shape;
  if (Error e = checkFloatShape(inst, operands[2], "noise", x))
    return std::move(e);
  bool ok =
      x.size() >= 2 && p.size() == x.size() && p[0] == x[0] && p[1] >= x[1] &&
      ArrayRef<int64_t>(p).drop_front(2) == ArrayRef<int64_t>(x).drop_front(2);
  if (!ok)
    return opError(inst, "prediction " + shapeString(p) +
                             " must match the latents " + shapeString(x) +
                             " except for extra channels");
  if (weighted)
    if (Error e = checkFloatShape(inst, operands[3], "weights", {x[0]}))
      return std::move(e);
  LossShape l{x[0], p[1], x[1], 1, weighted ? operands[3].f32 : nullptr};
  for (size_t i = 2; i < x.size(); ++i)
    l.inner *= x[i];
  // The mean over no elements is undefined.
  if (l.count() == 0)
    return opError(inst, "latents " + shapeString(x) + " are empty");
  return l;
}

/// Calls fn(sample, prediction index, residual) for the compared elements:
/// the residual pred - (noise - x0), in double, of the loss and its
/// gradient.
template <typename Fn>
void forEachResidual(const LossShape &l, ArrayRef<OpTensor> operands, Fn fn) {
  const float *pred = operands[0].f32, *x0 = operands[1].f32,
              *noise = operands[2].f32;
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t c = 0; c < l.channels; ++c) {
      int64_t p = (b * l.predChannels + c) * l.inner;
      int64_t x = (b * l.channels + c) * l.inner;
      for (int64_t i = 0; i < l.inner; ++i)
        fn(b, p + i,
           double(pred[p + i]) - (double(noise[x + i]) - double(x0[x + i])));
    }
}

Error flowMatchingLoss(const exec::Instruction &inst,
                       ArrayRef<OpTensor> operands,
                       ArrayRef<OpTensor> results) {
  Expected<LossShape> l = checkLoss(inst, operands, results, /*grad=*/false);
  if (!l)
    return l.takeError();
  for (auto [i, result] : llvm::enumerate(results)) {
    llvm::StringRef name = i == 0 ? "loss" : "unweighted_loss";
    if (Error e = checkFloat(inst, result, name))
      return e;
    if (result.type.numElements() != 1)
      return opError(inst, "'" + name + "' must be a scalar, got " +
                               shapeString(result.type.shape));
  }
  // The mean over samples of w_b times the sample's mean: the elements'
  // sum of w_b r^2 over the count, as every sample has as many.
  double sum = 0, unweighted = 0;
  forEachResidual(*l, operands, [&](int64_t b, int64_t, double r) {
    sum += l->weight(b) * r * r;
    unweighted += r * r;
  });
  double count = static_cast<double>(l->count());
  results[0].f32[0] = static_cast<float>(sum / count);
  if (results.size() == 2)
    results[1].f32[0] = static_cast<float>(unweighted / count);
  return Error::success();
}

Error flowMatchingLossGrad(const exec::Instruction &inst,
                           ArrayRef<OpTensor> operands,
                           ArrayRef<OpTensor> results) {
  Expected<LossShape> l = checkLoss(inst, operands, results, /*grad=*/true);
  if (!l)
    return l.takeError();
  if (Error e = checkFloatShape(inst, results[0], "prediction_grad",
                                operands[0].type.shape))
    return e;
  float *grad = results[0].f32;
  // Extra (learned-sigma) channels are not in the loss.
  std::fill_n(grad, results[0].type.numElements(), 0.0f);
  double factor = 2.0 / static_cast<double>(l->count());
  forEachResidual(*l, operands, [&](int64_t b, int64_t p, double r) {
    grad[p] = static_cast<float>(factor * l->weight(b) * r);
  });
  return Error::success();
}

} // namespace

void cpu::registerVideoKernels(GraphKernelTable &table) {
  table[OpCode::PatchEmbed] = patchEmbed;
  table[OpCode::PatchEmbedGrad] = patchEmbedGrad;
  table[OpCode::Patchify] = patchify;
  table[OpCode::Unpatchify] = unpatchify;
  table[OpCode::TimestepEmbedding] = timestepEmbedding;
  table[OpCode::Embedding] = embedding;
  table[OpCode::EmbeddingGrad] = embeddingGrad;
  table[OpCode::Rope3d] = rope3d;
  table[OpCode::Attention] = attention;
  table[OpCode::AttentionGrad] = attentionGrad;
  table[OpCode::Dsa3d] = dsa3d;
  table[OpCode::Dsa3dGrad] = dsa3dGrad;
  table[OpCode::Dsa3dOffsets] = dsa3dOffsetsKernel;
  table[OpCode::FlowInterpolate] = flowInterpolate;
  table[OpCode::FlowMatchingLoss] = flowMatchingLoss;
  table[OpCode::FlowMatchingLossGrad] = flowMatchingLossGrad;
}
