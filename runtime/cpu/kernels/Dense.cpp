//===- Dense.cpp - cpu kernels of the dense graph ops ---------------------===//
//
// fp32 reference kernels of the token-wise graph ops: linear and its two
// backward ops, layer/RMS norm, adaLN modulate/gate, GELU/SiLU, residual and
// bias adds, and the structural ops (cast, reshape, split, concat, zeros).
// Semantics are those of dialects/Graph/GraphOps.td; the backward ops compute
// what dialects/Graph/GraphGradients.cpp emits them for.
//
// Determinism: every output element is computed by exactly one thread with
// a reduction order that depends only on the shapes, never on the thread
// count (MEGASLIDE_NUM_THREADS), so results are bitwise reproducible.
//
// The three linear ops are one GEMM each (cpu/Gemm.h, deterministic in the
// same sense). The activations and the norms' rows run the vector math of
// cpu/VecMath.h, compiled per instruction set (bit-identical across thread
// counts on one machine, not across instruction sets; cpu/Isa.h); the
// rest is memory bound and written as plain loops over contiguous rows.
// Reductions over tokens into small parameter gradients (bias, gamma,
// beta, shift, scale, gate) accumulate in double: they are cheap and sum
// the most terms.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/ParallelFor.h"
#include "megaslide/runtime/cpu/VecMath.h"
#include "megaslide/runtime/cpu/kernels/Checks.h"
#include "megaslide/runtime/cpu/kernels/Registry.h"

#include "llvm/ADT/Twine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

using namespace megaslide;
using namespace megaslide::cpu;

using exec::Instruction;
using exec::OpCode;
using llvm::ArrayRef;
using llvm::Error;
using llvm::Expected;
using llvm::StringRef;
using llvm::Twine;

namespace {

//===----------------------------------------------------------------------===//
// Shapes
//===----------------------------------------------------------------------===//

/// `shape` with its last dimension replaced by `last`.
std::vector<int64_t> withLast(ArrayRef<int64_t> shape, int64_t last) {
  std::vector<int64_t> s(shape.begin(), shape.end());
  s.back() = last;
  return s;
}

int64_t product(ArrayRef<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

//===----------------------------------------------------------------------===//
// Threading
//===----------------------------------------------------------------------===//

/// Elementwise and row-wise loops go parallel above this many elements;
/// below it handing work to the pool's threads costs more than the loop.
constexpr int64_t kElementGrain = 1 << 16;

/// Runs fn(r) for rows [0, rows) of `width` elements each, in parallel
/// chunks of about kElementGrain elements.
template <typename Fn> void parallelRows(int64_t rows, int64_t width, Fn fn) {
  int64_t grain =
      std::max<int64_t>(1, kElementGrain / std::max<int64_t>(width, 1));
  parallelRanges(rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      fn(r);
  });
}

/// Runs fn(c0, c1) over column blocks [c0, c1) of [0, width): a sum over
/// rows per column then runs on one thread, in row order, whatever the
/// thread count.
template <typename Fn> void parallelColumns(int64_t width, Fn fn) {
  constexpr int64_t kBlock = 64;
  parallelFor((width + kBlock - 1) / kBlock, [&] {
    return [&](int64_t block) {
      fn(block * kBlock, std::min(width, (block + 1) * kBlock));
    };
  });
}

//===----------------------------------------------------------------------===//
// linear, linear_grad_data, linear_grad_params
//===----------------------------------------------------------------------===//

/// Checks weight [out, in] and a tensor `t` [..., features] whose last
/// dimension is the weight's dimension `axis`: 0 (out) or 1 (in).
Error checkAgainstWeight(const Instruction &inst, const OpTensor &w,
                         const OpTensor &t, StringRef name, int axis) {
  if (Error e = checkFloatRank(inst, w, "weight", 2, "[out, in]"))
    return e;
  std::string features = axis == 0 ? "out" : "in";
  if (Error e = checkFloatRank(inst, t, name, Count::atLeast(1),
                               "[..., " + features + "]"))
    return e;
  if (t.type.shape.back() != w.type.shape[axis])
    return opError(inst, name + " " + shapeString(t.type.shape) +
                             " does not end in the weight's " + features +
                             "-features " + Twine(w.type.shape[axis]));
  return Error::success();
}

/// y = x W^T (+ b): x [..., in], weight [out, in], bias [out].
Error linear(const Instruction &inst, ArrayRef<OpTensor> operands,
             ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, {2, 3}, 1))
    return e;
  const OpTensor &x = operands[0], &w = operands[1];
  if (Error e = checkAgainstWeight(inst, w, x, "input", 1))
    return e;
  int64_t out = w.type.shape[0], in = w.type.shape[1];
  if (operands.size() == 3)
    if (Error e = checkFloatShape(inst, operands[2], "bias", {out}))
      return e;
  if (Error e = checkFloatShape(inst, results[0], "result",
                                withLast(x.type.shape, out)))
    return e;

  int64_t rows = product(ArrayRef<int64_t>(x.type.shape).drop_back());
  float *y = results[0].f32;
  bool bias = operands.size() == 3;
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      std::copy(operands[2].f32, operands[2].f32 + out, y + r * out);
  gemm(rows, out, in, 1.0f, {x.f32, in}, {w.f32, in, /*transposed=*/true},
       bias ? 1.0f : 0.0f, y, out);
  return Error::success();
}

/// dx = dy W: dy [..., out], weight [out, in] -> dx [..., in].
Error linearGradData(const Instruction &inst, ArrayRef<OpTensor> operands,
                     ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, 1))
    return e;
  const OpTensor &dy = operands[0], &w = operands[1];
  if (Error e = checkAgainstWeight(inst, w, dy, "result_grad", 0))
    return e;
  int64_t out = w.type.shape[0], in = w.type.shape[1];
  if (Error e = checkFloatShape(inst, results[0], "input_grad",
                                withLast(dy.type.shape, in)))
    return e;

  int64_t rows = product(ArrayRef<int64_t>(dy.type.shape).drop_back());
  gemm(rows, in, out, 1.0f, {dy.f32, out}, {w.f32, in}, 0.0f,
       results[0].f32, in);
  return Error::success();
}

/// dW = dy^T x summed over the leading dimensions; db = sum dy when asked.
Error linearGradParams(const Instruction &inst, ArrayRef<OpTensor> operands,
                       ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, {1, 2}))
    return e;
  const OpTensor &x = operands[0], &dy = operands[1];
  if (Error e =
          checkFloatRank(inst, x, "input", Count::atLeast(1), "[..., in]"))
    return e;
  if (Error e = checkFloat(inst, dy, "result_grad"))
    return e;
  ArrayRef<int64_t> xs = x.type.shape, dys = dy.type.shape;
  if (xs.size() != dys.size() || xs.drop_back() != dys.drop_back())
    return opError(inst, "input " + shapeString(xs) + " and result_grad " +
                             shapeString(dys) +
                             " differ in leading dimensions");
  int64_t in = xs.back(), out = dys.back();
  if (Error e = checkFloatShape(inst, results[0], "weight_grad", {out, in}))
    return e;
  if (results.size() == 2)
    if (Error e = checkFloatShape(inst, results[1], "bias_grad", {out}))
      return e;

  int64_t rows = product(xs.drop_back());
  // The reduction runs over tokens: dW = dy^T x.
  gemm(out, in, rows, 1.0f, {dy.f32, out, /*transposed=*/true}, {x.f32, in},
       0.0f, results[0].f32, in);

  if (results.size() == 2) {
    std::vector<double> db(out, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float *row = dy.f32 + r * out;
      for (int64_t o = 0; o < out; ++o)
        db[o] += row[o];
    }
    std::copy(db.begin(), db.end(), results[1].f32);
  }
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Norms
//===----------------------------------------------------------------------===//

/// The norms' `eps`: present (the plan fills in defaults), finite and > 0,
/// since rsqrt(var + eps) must stay finite for a constant row.
Expected<float> readEps(const Instruction &inst) {
  Expected<double> value = finiteFloatAttr(inst, "eps");
  if (!value)
    return value.takeError();
  // Checked after rounding: a tiny double eps may become 0 in fp32.
  float eps = static_cast<float>(*value);
  if (!(eps > 0) || !std::isfinite(eps)) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", *value);
    return opError(inst, Twine("attribute 'eps' must be positive and finite "
                               "in fp32, got ") +
                             text);
  }
  return eps;
}

/// A norm's eps and rows of `d` elements.
struct NormRows {
  float eps;
  int64_t d, rows;
};

/// Checks what the norms share, as their verifiers do: eps, input x
/// [..., D], each group of per-channel tensors [D] (named as the group) and
/// the tensors in `like` shaped as x.
Expected<NormRows>
checkNorm(const Instruction &inst, const OpTensor &x,
          ArrayRef<std::pair<StringRef, ArrayRef<OpTensor>>> channels,
          ArrayRef<std::pair<StringRef, const OpTensor *>> like) {
  Expected<float> eps = readEps(inst);
  if (!eps)
    return eps.takeError();
  if (Error e = checkFloatRank(inst, x, "input", Count::atLeast(1), "[..., D]"))
    return std::move(e);
  int64_t d = x.type.shape.back();
  for (auto [name, tensors] : channels)
    for (const OpTensor &t : tensors)
      if (Error e = checkFloatShape(inst, t, name, {d}))
        return std::move(e);
  for (auto [name, t] : like)
    if (Error e = checkFloatShape(inst, *t, name, x.type.shape))
      return std::move(e);
  return NormRows{*eps, d, d == 0 ? 0 : x.type.numElements() / d};
}

/// (x - mean) / sqrt(var + eps), then * gamma + beta when both are given.
Error layerNorm(const Instruction &inst, ArrayRef<OpTensor> operands,
                ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, {1, 3}, 1))
    return e;
  if (operands.size() == 2)
    return opError(inst, "takes either no affine operands or both gamma and "
                         "beta, got 1");
  const OpTensor &x = operands[0];
  Expected<NormRows> norm = checkNorm(
      inst, x, {{"affine", operands.drop_front()}}, {{"result", &results[0]}});
  if (!norm)
    return norm.takeError();
  float eps = norm->eps;
  int64_t d = norm->d, rows = norm->rows;
  const float *gamma = operands.size() == 3 ? operands[1].f32 : nullptr;
  const float *beta = operands.size() == 3 ? operands[2].f32 : nullptr;
  float *y = results[0].f32;
  const VecKernels &vec = vecKernels();
  parallelRows(rows, d, [&](int64_t r) {
    // The forward and the backward use the same rounded statistics.
    float mean, rstd;
    vec.meanRstd(x.f32 + r * d, d, eps, &mean, &rstd);
    vec.normApply(x.f32 + r * d, d, mean, rstd, gamma, beta, y + r * d);
  });
  return Error::success();
}

/// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy * gamma;
/// dgamma = sum dy xhat, dbeta = sum dy over the leading dimensions.
Error layerNormGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
                    ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, {2, 4}, {1, 3}))
    return e;
  if (operands.size() == 3)
    return opError(inst, "takes either no affine operands or both gamma and "
                         "beta, got 1");
  size_t numAffine = operands.size() - 2;
  if (results.size() != 1 + numAffine)
    return opError(inst, "returns one gradient per affine operand: expected " +
                             Twine(numAffine) + ", got " +
                             Twine(results.size() - 1));
  const OpTensor &x = operands[0], &dy = operands[1];
  Expected<NormRows> norm = checkNorm(
      inst, x,
      {{"affine", operands.drop_front(2)}, {"affine", results.drop_front()}},
      {{"result_grad", &dy}, {"input_grad", &results[0]}});
  if (!norm)
    return norm.takeError();
  float eps = norm->eps;
  int64_t d = norm->d, rows = norm->rows;
  const float *gamma = numAffine ? operands[2].f32 : nullptr;
  float *dx = results[0].f32;
  // Row statistics are kept for the parameter gradients below.
  std::vector<float> means(rows), rstds(rows);
  const VecKernels &vec = vecKernels();
  parallelRows(rows, d, [&](int64_t r) {
    vec.meanRstd(x.f32 + r * d, d, eps, &means[r], &rstds[r]);
    vec.normGrad(x.f32 + r * d, dy.f32 + r * d, gamma, d, means[r], rstds[r],
                 /*centered=*/true, dx + r * d);
  });
  if (!numAffine)
    return Error::success();
  std::vector<double> dgamma(d, 0.0), dbeta(d, 0.0);
  parallelColumns(d, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r)
      vec.normParamGrad(x.f32 + r * d + c0, dy.f32 + r * d + c0, c1 - c0,
                        means[r], rstds[r], dgamma.data() + c0,
                        dbeta.data() + c0);
  });
  std::copy(dgamma.begin(), dgamma.end(), results[1].f32);
  std::copy(dbeta.begin(), dbeta.end(), results[2].f32);
  return Error::success();
}

/// x / sqrt(mean(x^2) + eps), times gamma when given.
Error rmsNorm(const Instruction &inst, ArrayRef<OpTensor> operands,
              ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, {1, 2}, 1))
    return e;
  const OpTensor &x = operands[0];
  Expected<NormRows> norm = checkNorm(
      inst, x, {{"gamma", operands.drop_front()}}, {{"result", &results[0]}});
  if (!norm)
    return norm.takeError();
  float eps = norm->eps;
  int64_t d = norm->d, rows = norm->rows;
  const float *gamma = operands.size() == 2 ? operands[1].f32 : nullptr;
  float *y = results[0].f32;
  const VecKernels &vec = vecKernels();
  parallelRows(rows, d, [&](int64_t r) {
    float rstd = vec.rmsRstd(x.f32 + r * d, d, eps);
    vec.normApply(x.f32 + r * d, d, 0.0f, rstd, gamma, nullptr, y + r * d);
  });
  return Error::success();
}

/// dx = rstd (g - xhat mean(g xhat)) with g = dy * gamma, xhat = x rstd;
/// dgamma = sum dy xhat over the leading dimensions.
Error rmsNormGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
                  ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, {2, 3}, {1, 2}))
    return e;
  bool hasGamma = operands.size() == 3;
  if (hasGamma != (results.size() == 2))
    return opError(inst, "returns a gamma gradient exactly when gamma is "
                         "given");
  const OpTensor &x = operands[0], &dy = operands[1];
  Expected<NormRows> norm = checkNorm(
      inst, x,
      {{"gamma", operands.drop_front(2)}, {"gamma_grad", results.drop_front()}},
      {{"result_grad", &dy}, {"input_grad", &results[0]}});
  if (!norm)
    return norm.takeError();
  float eps = norm->eps;
  int64_t d = norm->d, rows = norm->rows;
  const float *gamma = hasGamma ? operands[2].f32 : nullptr;
  float *dx = results[0].f32;
  std::vector<float> rstds(rows);
  const VecKernels &vec = vecKernels();
  // RMS norm is layer norm's algebra with mean 0 and no mean(g) term.
  parallelRows(rows, d, [&](int64_t r) {
    rstds[r] = vec.rmsRstd(x.f32 + r * d, d, eps);
    vec.normGrad(x.f32 + r * d, dy.f32 + r * d, gamma, d, 0.0f, rstds[r],
                 /*centered=*/false, dx + r * d);
  });
  if (!hasGamma)
    return Error::success();
  std::vector<double> dgamma(d, 0.0);
  parallelColumns(d, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r)
      vec.normParamGrad(x.f32 + r * d + c0, dy.f32 + r * d + c0, c1 - c0, 0.0f,
                        rstds[r], dgamma.data() + c0, nullptr);
  });
  std::copy(dgamma.begin(), dgamma.end(), results[1].f32);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// adaLN modulate and gate
//===----------------------------------------------------------------------===//

/// Checks x [B, N, D], per-sample vectors [B, D] and tensors shaped like x
/// (the verifiers' verifyModulation).
Error checkModulation(const Instruction &inst, const OpTensor &x,
                      ArrayRef<std::pair<StringRef, const OpTensor *>> vecs,
                      ArrayRef<std::pair<StringRef, const OpTensor *>> like) {
  if (Error e = checkFloatRank(inst, x, "input", 3, "[B, N, D]"))
    return e;
  ArrayRef<int64_t> s = x.type.shape;
  for (auto [name, v] : vecs)
    if (Error e = checkFloatShape(inst, *v, name, {s[0], s[2]}))
      return e;
  for (auto [name, v] : like)
    if (Error e = checkFloatShape(inst, *v, name, s))
      return e;
  return Error::success();
}

/// x * (1 + scale) + shift, shift and scale [B, D] broadcast over tokens.
Error modulate(const Instruction &inst, ArrayRef<OpTensor> operands,
               ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 1))
    return e;
  const OpTensor &x = operands[0], &shift = operands[1], &scale = operands[2];
  if (Error e = checkModulation(inst, x, {{"shift", &shift}, {"scale", &scale}},
                                {{"result", &results[0]}}))
    return e;
  int64_t b = x.type.shape[0], n = x.type.shape[1], d = x.type.shape[2];
  float *y = results[0].f32;
  parallelRows(b * n, d, [&](int64_t r) {
    const float *sh = shift.f32 + (r / n) * d, *sc = scale.f32 + (r / n) * d;
    const float *xr = x.f32 + r * d;
    float *yr = y + r * d;
    for (int64_t i = 0; i < d; ++i)
      yr[i] = xr[i] * (1.0f + sc[i]) + sh[i];
  });
  return Error::success();
}

/// dx = dy (1 + scale), dshift = sum_N dy, dscale = sum_N dy x.
Error modulateGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
                   ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 3))
    return e;
  const OpTensor &x = operands[0], &scale = operands[1], &dy = operands[2];
  if (Error e =
          checkModulation(inst, x,
                          {{"scale", &scale},
                           {"shift_grad", &results[1]},
                           {"scale_grad", &results[2]}},
                          {{"result_grad", &dy}, {"input_grad", &results[0]}}))
    return e;
  int64_t b = x.type.shape[0], n = x.type.shape[1], d = x.type.shape[2];
  float *dx = results[0].f32;
  std::vector<double> dshift(d), dscale(d);
  for (int64_t s = 0; s < b; ++s) {
    std::fill(dshift.begin(), dshift.end(), 0.0);
    std::fill(dscale.begin(), dscale.end(), 0.0);
    const float *sc = scale.f32 + s * d;
    for (int64_t t = 0; t < n; ++t) {
      int64_t off = (s * n + t) * d;
      const float *xr = x.f32 + off, *dyr = dy.f32 + off;
      float *dxr = dx + off;
      for (int64_t i = 0; i < d; ++i) {
        dxr[i] = dyr[i] * (1.0f + sc[i]);
        dshift[i] += dyr[i];
        dscale[i] += static_cast<double>(dyr[i]) * xr[i];
      }
    }
    std::copy(dshift.begin(), dshift.end(), results[1].f32 + s * d);
    std::copy(dscale.begin(), dscale.end(), results[2].f32 + s * d);
  }
  return Error::success();
}

/// x * gate, the gate [B, D] broadcast over tokens.
Error gate(const Instruction &inst, ArrayRef<OpTensor> operands,
           ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, 1))
    return e;
  const OpTensor &x = operands[0], &g = operands[1];
  if (Error e =
          checkModulation(inst, x, {{"gate", &g}}, {{"result", &results[0]}}))
    return e;
  int64_t b = x.type.shape[0], n = x.type.shape[1], d = x.type.shape[2];
  float *y = results[0].f32;
  parallelRows(b * n, d, [&](int64_t r) {
    const float *gr = g.f32 + (r / n) * d, *xr = x.f32 + r * d;
    float *yr = y + r * d;
    for (int64_t i = 0; i < d; ++i)
      yr[i] = xr[i] * gr[i];
  });
  return Error::success();
}

/// dx = dy * gate, dgate = sum_N dy x.
Error gateGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
               ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 3, 2))
    return e;
  const OpTensor &x = operands[0], &g = operands[1], &dy = operands[2];
  if (Error e =
          checkModulation(inst, x, {{"gate", &g}, {"gate_grad", &results[1]}},
                          {{"result_grad", &dy}, {"input_grad", &results[0]}}))
    return e;
  int64_t b = x.type.shape[0], n = x.type.shape[1], d = x.type.shape[2];
  float *dx = results[0].f32;
  std::vector<double> dgate(d);
  for (int64_t s = 0; s < b; ++s) {
    std::fill(dgate.begin(), dgate.end(), 0.0);
    const float *gr = g.f32 + s * d;
    for (int64_t t = 0; t < n; ++t) {
      int64_t off = (s * n + t) * d;
      const float *xr = x.f32 + off, *dyr = dy.f32 + off;
      float *dxr = dx + off;
      for (int64_t i = 0; i < d; ++i) {
        dxr[i] = dyr[i] * gr[i];
        dgate[i] += static_cast<double>(dyr[i]) * xr[i];
      }
    }
    std::copy(dgate.begin(), dgate.end(), results[1].f32 + s * d);
  }
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Activations and adds
//===----------------------------------------------------------------------===//

/// result = f(input, ...) elementwise over operands of the result's shape.
template <typename Fn>
Error elementwise(const Instruction &inst, ArrayRef<OpTensor> operands,
                  ArrayRef<OpTensor> results, size_t numOperands,
                  ArrayRef<const char *> names, Fn fn) {
  if (Error e = checkArity(inst, operands, results, numOperands, 1))
    return e;
  if (Error e = checkFloat(inst, operands[0], names[0]))
    return e;
  for (size_t i = 1; i < numOperands; ++i)
    if (Error e = checkFloatShape(inst, operands[i], names[i],
                                  operands[0].type.shape))
      return e;
  if (Error e =
          checkFloatShape(inst, results[0], "result", operands[0].type.shape))
    return e;
  int64_t count = results[0].type.numElements();
  const float *a = operands[0].f32;
  const float *b = numOperands > 1 ? operands[1].f32 : nullptr;
  float *out = results[0].f32;
  parallelRanges(count, kElementGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      out[i] = fn(a[i], b ? b[i] : 0.0f);
  });
  return Error::success();
}

/// result = f(input) or f(input, result_grad) with one of the vector
/// loops (f(x, y, n) or f(x, dy, dx, n)), in parallel chunks.
template <typename Loop>
Error vectorised(const Instruction &inst, ArrayRef<OpTensor> operands,
                 ArrayRef<OpTensor> results, Loop loop) {
  constexpr bool unary =
      std::is_invocable_v<Loop, const float *, float *, int64_t>;
  size_t numOperands = unary ? 1 : 2;
  if (Error e = checkArity(inst, operands, results, numOperands, 1))
    return e;
  if (Error e = checkFloat(inst, operands[0], "input"))
    return e;
  if (!unary)
    if (Error e = checkFloatShape(inst, operands[1], "result_grad",
                                  operands[0].type.shape))
      return e;
  if (Error e =
          checkFloatShape(inst, results[0], "result", operands[0].type.shape))
    return e;
  const float *x = operands[0].f32;
  float *out = results[0].f32;
  parallelRanges(results[0].type.numElements(), kElementGrain,
                 [&](int64_t i0, int64_t i1) {
                   if constexpr (unary)
                     loop(x + i0, out + i0, i1 - i0);
                   else
                     loop(x + i0, operands[1].f32 + i0, out + i0, i1 - i0);
                 });
  return Error::success();
}

// The exact (erf) GELU of Wan's image embedder: a few hundred tokens per
// sample, so plain loops.
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

Error gelu(const Instruction &inst, ArrayRef<OpTensor> operands,
           ArrayRef<OpTensor> results) {
  if (!inst.hasAttr(exec::kExactAttr))
    return vectorised(inst, operands, results, vecKernels().gelu);
  return vectorised(
      inst, operands, results, [](const float *x, float *y, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
      });
}

Error geluGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
               ArrayRef<OpTensor> results) {
  if (!inst.hasAttr(exec::kExactAttr))
    return vectorised(inst, operands, results, vecKernels().geluGrad);
  // d/dx x Phi(x) = Phi(x) + x phi(x).
  return vectorised(inst, operands, results,
                    [](const float *x, const float *dy, float *dx, int64_t n) {
                      for (int64_t i = 0; i < n; ++i) {
                        float cdf = 0.5f * (1.0f + std::erf(x[i] * kInvSqrt2));
                        float pdf = kInvSqrt2Pi * std::exp(-0.5f * x[i] * x[i]);
                        dx[i] = dy[i] * (cdf + x[i] * pdf);
                      }
                    });
}

Error silu(const Instruction &inst, ArrayRef<OpTensor> operands,
           ArrayRef<OpTensor> results) {
  return vectorised(inst, operands, results, vecKernels().silu);
}

Error siluGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
               ArrayRef<OpTensor> results) {
  return vectorised(inst, operands, results, vecKernels().siluGrad);
}

Error add(const Instruction &inst, ArrayRef<OpTensor> operands,
          ArrayRef<OpTensor> results) {
  return elementwise(inst, operands, results, 2, {"lhs", "rhs"},
                     [](float a, float b) { return a + b; });
}

/// Float tensors whose shapes are `full`'s and a suffix of it: the input of
/// bias_add and its bias (or their gradients).
Error checkBias(const Instruction &inst, const OpTensor &full,
                StringRef fullName, const OpTensor &bias, StringRef biasName) {
  if (Error e = checkFloat(inst, full, fullName))
    return e;
  if (Error e = checkFloat(inst, bias, biasName))
    return e;
  ArrayRef<int64_t> f = full.type.shape, b = bias.type.shape;
  if (b.size() > f.size() || f.take_back(b.size()) != b)
    return opError(inst, "bias shape " + shapeString(b) +
                             " is not a suffix of " + shapeString(f));
  return Error::success();
}

/// y = x + bias, the bias broadcast over the leading dimensions.
Error biasAdd(const Instruction &inst, ArrayRef<OpTensor> operands,
              ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 2, 1))
    return e;
  const OpTensor &x = operands[0], &bias = operands[1];
  if (Error e = checkBias(inst, x, "input", bias, "bias"))
    return e;
  if (Error e = checkFloatShape(inst, results[0], "result", x.type.shape))
    return e;
  int64_t width = bias.type.numElements();
  int64_t rows = width == 0 ? 0 : x.type.numElements() / width;
  float *y = results[0].f32;
  parallelRows(rows, width, [&](int64_t r) {
    for (int64_t i = 0; i < width; ++i)
      y[r * width + i] = x.f32[r * width + i] + bias.f32[i];
  });
  return Error::success();
}

/// Sums result_grad over its leading dimensions down to the bias shape.
Error biasAddGrad(const Instruction &inst, ArrayRef<OpTensor> operands,
                  ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  const OpTensor &dy = operands[0];
  if (Error e = checkBias(inst, dy, "result_grad", results[0], "bias_grad"))
    return e;
  int64_t width = results[0].type.numElements();
  int64_t rows = width == 0 ? 0 : dy.type.numElements() / width;
  std::vector<double> sum(width, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < width; ++i)
      sum[i] += dy.f32[r * width + i];
  std::copy(sum.begin(), sum.end(), results[0].f32);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Structural ops
//===----------------------------------------------------------------------===//

/// Values arrive widened to fp32 and the interpreter rounds the result to
/// its dtype, so a cast is a copy here.
Error cast(const Instruction &inst, ArrayRef<OpTensor> operands,
           ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  if (Error e = checkFloat(inst, operands[0], "input"))
    return e;
  if (Error e =
          checkFloatShape(inst, results[0], "result", operands[0].type.shape))
    return e;
  int64_t count = operands[0].type.numElements();
  if (count && results[0].f32 != operands[0].f32)
    std::memmove(results[0].f32, operands[0].f32, count * sizeof(float));
  return Error::success();
}

/// A row-major copy; reshape also carries index tensors, so any of the
/// three buffers may hold the data. The result may alias the input (the
/// interpreter usually makes it a view), hence memmove.
Error reshape(const Instruction &inst, ArrayRef<OpTensor> operands,
              ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, 1))
    return e;
  const OpTensor &in = operands[0], &out = results[0];
  if (Error e = checkExtents(inst, in, "input"))
    return e;
  if (Error e = checkExtents(inst, out, "result"))
    return e;
  int64_t count = in.type.numElements();
  if (count != out.type.numElements())
    return opError(inst, "cannot reshape " + Twine(count) + " elements " +
                             shapeString(in.type.shape) + " into " +
                             Twine(out.type.numElements()) + " elements " +
                             shapeString(out.type.shape));
  if (count == 0)
    return Error::success();
  auto copy = [&](const void *src, void *dst, size_t elemBytes) -> Error {
    if (!src || !dst)
      return opError(inst, "input and result must hold the same kind of "
                           "elements");
    if (src != dst)
      std::memmove(dst, src, count * elemBytes);
    return Error::success();
  };
  if (in.f32)
    return copy(in.f32, out.f32, sizeof(float));
  if (in.i32)
    return copy(in.i32, out.i32, sizeof(int32_t));
  if (in.i64)
    return copy(in.i64, out.i64, sizeof(int64_t));
  return opError(inst, "input has no data");
}

/// Like torch.split(x, widths, dim=-1): the results' last dimensions are
/// consecutive pieces of the input's.
Error split(const Instruction &inst, ArrayRef<OpTensor> operands,
            ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 1, Count::atLeast(1)))
    return e;
  const OpTensor &x = operands[0];
  if (Error e = checkFloat(inst, x, "input"))
    return e;
  if (x.type.shape.empty())
    return opError(inst, "input must have rank >= 1");
  int64_t width = x.type.shape.back(), total = 0;
  for (const OpTensor &r : results) {
    ArrayRef<int64_t> s = r.type.shape;
    if (s.empty() || s.back() <= 0)
      return opError(inst, "result " + shapeString(s) + " is not a piece of " +
                               shapeString(x.type.shape));
    if (Error e = checkFloatShape(inst, r, "result",
                                  withLast(x.type.shape, s.back())))
      return e;
    total += s.back();
  }
  if (total != width)
    return opError(inst, "results are " + Twine(total) +
                             " wide together, but the input's last "
                             "dimension is " +
                             Twine(width));
  int64_t rows = product(ArrayRef<int64_t>(x.type.shape).drop_back());
  int64_t column = 0;
  for (const OpTensor &r : results) {
    int64_t w = r.type.shape.back();
    for (int64_t row = 0; row < rows; ++row)
      std::copy(x.f32 + row * width + column, x.f32 + row * width + column + w,
                r.f32 + row * w);
    column += w;
  }
  return Error::success();
}

/// The inverse of split: inputs side by side along the last dimension.
Error concat(const Instruction &inst, ArrayRef<OpTensor> operands,
             ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, Count::atLeast(1), 1))
    return e;
  ArrayRef<int64_t> first = operands[0].type.shape;
  if (first.empty())
    return opError(inst, "inputs must have rank >= 1");
  int64_t width = 0;
  for (const OpTensor &in : operands) {
    if (Error e = checkFloat(inst, in, "input"))
      return e;
    ArrayRef<int64_t> s = in.type.shape;
    if (s.size() != first.size() || s.drop_back() != first.drop_back())
      return opError(inst, "inputs " + shapeString(first) + " and " +
                               shapeString(s) +
                               " differ outside the last dimension");
    width += s.back();
  }
  if (Error e =
          checkFloatShape(inst, results[0], "result", withLast(first, width)))
    return e;
  int64_t rows = product(first.drop_back());
  float *y = results[0].f32;
  int64_t column = 0;
  for (const OpTensor &in : operands) {
    int64_t w = in.type.shape.back();
    for (int64_t r = 0; r < rows; ++r)
      std::copy(in.f32 + r * w, in.f32 + (r + 1) * w, y + r * width + column);
    column += w;
  }
  return Error::success();
}

Error zeros(const Instruction &inst, ArrayRef<OpTensor> operands,
            ArrayRef<OpTensor> results) {
  if (Error e = checkArity(inst, operands, results, 0, 1))
    return e;
  const OpTensor &out = results[0];
  if (Error e = checkExtents(inst, out, "result"))
    return e;
  int64_t count = out.type.numElements();
  if (count == 0)
    return Error::success();
  if (out.f32)
    std::fill(out.f32, out.f32 + count, 0.0f);
  else if (out.i32)
    std::fill(out.i32, out.i32 + count, 0);
  else if (out.i64)
    std::fill(out.i64, out.i64 + count, 0);
  else
    return opError(inst, "result has no data");
  return Error::success();
}

} // namespace

void cpu::registerDenseKernels(GraphKernelTable &table) {
  table[OpCode::Linear] = linear;
  table[OpCode::LinearGradData] = linearGradData;
  table[OpCode::LinearGradParams] = linearGradParams;
  table[OpCode::LayerNorm] = layerNorm;
  table[OpCode::LayerNormGrad] = layerNormGrad;
  table[OpCode::RMSNorm] = rmsNorm;
  table[OpCode::RMSNormGrad] = rmsNormGrad;
  table[OpCode::Modulate] = modulate;
  table[OpCode::ModulateGrad] = modulateGrad;
  table[OpCode::Gate] = gate;
  table[OpCode::GateGrad] = gateGrad;
  table[OpCode::Gelu] = gelu;
  table[OpCode::GeluGrad] = geluGrad;
  table[OpCode::Silu] = silu;
  table[OpCode::SiluGrad] = siluGrad;
  table[OpCode::Add] = add;
  table[OpCode::BiasAdd] = biasAdd;
  table[OpCode::BiasAddGrad] = biasAddGrad;
  table[OpCode::Cast] = cast;
  table[OpCode::Reshape] = reshape;
  table[OpCode::Split] = split;
  table[OpCode::Concat] = concat;
  table[OpCode::Zeros] = zeros;
}
