//===- GraphOps.cpp - MegaSlide graph op verifiers ------------------------===//
//
// Local shape and type invariants of every graph op. Messages name the
// operand and print both the shape found and the shape expected.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"
#include "megaslide/runtime/support/Shape.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MathExtras.h"

#include <cmath>

using namespace mlir;
using namespace megaslide::graph;
using megaslide::shapeString;

namespace {

RankedTensorType tensorType(Value v) {
  return cast<RankedTensorType>(v.getType());
}

/// Fails with "'what' has shape [..] but expected [..]" unless equal.
LogicalResult expectShape(Operation *op, StringRef what, Value v,
                          ArrayRef<int64_t> expected) {
  ArrayRef<int64_t> actual = tensorType(v).getShape();
  if (actual == expected)
    return success();
  return op->emitOpError() << "'" << what << "' has shape "
                           << shapeString(actual) << " but expected "
                           << shapeString(expected);
}

LogicalResult expectRank(Operation *op, StringRef what, Value v, int64_t rank,
                         StringRef layout) {
  if (tensorType(v).getRank() == rank)
    return success();
  return op->emitOpError() << "'" << what << "' must have rank " << rank << " "
                           << layout << ", got "
                           << shapeString(tensorType(v).getShape());
}

/// All floating-point operands and results of a graph op share one element
/// type (casts are explicit).
LogicalResult expectSameElementType(Operation *op, ValueRange values) {
  Type first;
  for (Value v : values) {
    Type et = tensorType(v).getElementType();
    if (!isa<FloatType>(et))
      continue;
    if (!first)
      first = et;
    else if (et != first)
      return op->emitOpError() << "mixes element types " << first << " and "
                               << et << "; insert megaslide.cast";
  }
  return success();
}

LogicalResult expectSameElementType(Operation *op) {
  SmallVector<Value> all(op->getOperands());
  llvm::append_range(all, op->getResults());
  return expectSameElementType(op, all);
}

SmallVector<int64_t> withLast(ArrayRef<int64_t> shape, int64_t last) {
  SmallVector<int64_t> s(shape);
  s.back() = last;
  return s;
}

/// Norms reduce over the last dimension, so their input needs one.
LogicalResult verifyNormInput(Operation *op, Value input) {
  if (tensorType(input).getRank() >= 1)
    return success();
  return op->emitOpError()
         << "'input' must have rank >= 1 to normalise over its last "
            "dimension, got []";
}

/// Checks a norm's optional per-channel parameter: shape [D].
LogicalResult verifyChannelParam(Operation *op, StringRef what, Value param,
                                 Value input) {
  return expectShape(op, what, param, {tensorType(input).getShape().back()});
}

/// Checks the token-grid attributes and [B, N, H, Dh] operands shared by
/// the 3D-DSA ops; returns the expected offsets shape in `offsetsShape`.
LogicalResult verifyDsaOperands(Operation *op, Value q, Value k, Value v,
                                ArrayRef<int64_t> grid,
                                ArrayRef<int64_t> window,
                                ArrayRef<int64_t> tile,
                                SmallVectorImpl<int64_t> &offsetsShape) {
  if (failed(expectRank(op, "query", q, 4, "[B, N, H, Dh]")))
    return failure();
  ArrayRef<int64_t> qs = tensorType(q).getShape();
  if (failed(expectShape(op, "key", k, qs)) ||
      (v && failed(expectShape(op, "value", v, qs))))
    return failure();
  static const char *axes[] = {"t", "y", "x"};
  for (int i = 0; i < 3; ++i) {
    if (grid[i] <= 0 || tile[i] <= 0 || window[i] <= 0)
      return op->emitOpError()
             << "grid, window and tile must be positive, got "
             << "grid " << shapeString(grid) << ", window "
             << shapeString(window) << ", tile " << shapeString(tile);
    if (window[i] > grid[i])
      return op->emitOpError()
             << "window extent " << window[i] << " along " << axes[i]
             << " exceeds the grid extent " << grid[i]
             << "; use a window of at most the grid";
  }
  int64_t tokens = grid[0] * grid[1] * grid[2];
  if (qs[1] != tokens)
    return op->emitOpError()
           << "token count " << qs[1] << " does not match grid "
           << shapeString(grid) << " (" << tokens << " tokens)";
  offsetsShape.assign({qs[0], qs[2], llvm::divideCeilSigned(grid[0], tile[0]),
                       llvm::divideCeilSigned(grid[1], tile[1]),
                       llvm::divideCeilSigned(grid[2], tile[2]), window[0], 2});
  return success();
}

} // namespace

//===----------------------------------------------------------------------===//
// Persistent state
//===----------------------------------------------------------------------===//

LogicalResult ParamOp::verify() {
  // Moments and gradients belong to a parameter; a persistent bf16 copy
  // may name its master.
  bool needsOf =
      getRole() == ParamRole::moment || getRole() == ParamRole::gradient;
  bool allowsOf = needsOf || getRole() == ParamRole::weight;
  if ((needsOf && !getOf()) || (!allowsOf && getOf()))
    return emitOpError() << "role '" << stringifyParamRole(getRole()) << "' "
                         << (needsOf ? "requires" : "does not take")
                         << " an 'of' parameter";
  if ((getGroup() == ParamGroup::blocks) != getLayer().has_value())
    return emitOpError() << "a block index '[i]' is required exactly for "
                            "group 'blocks'";
  if (getLayer() && getLayerAttr().getInt() < 0)
    return emitOpError() << "block index must be non-negative, got "
                         << getLayerAttr().getInt();
  Type et = getTensorType().getElementType();
  if (getRole() == ParamRole::master && !et.isF32())
    return emitOpError() << "master weights must be f32, got " << et;
  if (!isa<FloatType>(et))
    return emitOpError() << "persistent state must be floating point, got "
                         << et;
  return success();
}

/// Resolves `param` to a megaslide.param of exactly `type`.
static LogicalResult verifyParamUse(Operation *op, FlatSymbolRefAttr param,
                                    Type type,
                                    SymbolTableCollection &symbolTable) {
  auto decl = symbolTable.lookupNearestSymbolFrom<ParamOp>(op, param);
  if (!decl)
    return op->emitOpError()
           << "'" << param.getValue() << "' does not name a megaslide.param";
  if (decl.getType() != type)
    return op->emitOpError()
           << "type " << type << " does not match " << decl.getType()
           << " declared by '" << param.getValue() << "'";
  return success();
}

LogicalResult LoadOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  return verifyParamUse(*this, getParamAttr(), getType(), symbolTable);
}

LogicalResult StoreOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  return verifyParamUse(*this, getParamAttr(), getValue().getType(),
                        symbolTable);
}

LogicalResult AdamWOp::verify() {
  ArrayRef<int64_t> shape = getParam().getType().getShape();
  if (failed(expectShape(*this, "grad", getGrad(), shape)) ||
      failed(expectShape(*this, "m", getM(), shape)))
    return failure();
  double beta1 = getBeta1().convertToDouble();
  double beta2 = getBeta2().convertToDouble();
  // Written so that NaN fails too.
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    return emitOpError() << "betas must lie in [0, 1), got (" << beta1 << ", "
                         << beta2 << ")";
  if (!(getLr().convertToDouble() >= 0) || !(getEps().convertToDouble() > 0) ||
      !(getWeightDecay().convertToDouble() >= 0))
    return emitOpError() << "needs lr >= 0, eps > 0, weight_decay >= 0";
  return success();
}

//===----------------------------------------------------------------------===//
// Structural ops
//===----------------------------------------------------------------------===//

LogicalResult ReshapeOp::verify() {
  auto in = tensorType(getInput()), out = getType();
  if (!in.hasStaticShape() || !out.hasStaticShape())
    return emitOpError() << "needs static shapes";
  if (in.getNumElements() != out.getNumElements())
    return emitOpError() << "cannot reshape " << in.getNumElements()
                         << " elements " << shapeString(in.getShape())
                         << " into " << out.getNumElements() << " elements "
                         << shapeString(out.getShape());
  if (in.getElementType() != out.getElementType())
    return emitOpError() << "must not change the element type";
  return success();
}

LogicalResult SplitOp::verify() {
  if (getResults().empty())
    return emitOpError() << "needs at least one result";
  auto in = tensorType(getInput());
  if (in.getRank() == 0)
    return emitOpError() << "input must have rank >= 1";
  int64_t width = 0;
  for (Value r : getResults()) {
    ArrayRef<int64_t> s = tensorType(r).getShape();
    if (s.size() != size_t(in.getRank()) ||
        s.drop_back() != in.getShape().drop_back() || s.back() <= 0)
      return emitOpError() << "result " << shapeString(s)
                           << " is not a piece of the last dimension of "
                           << shapeString(in.getShape());
    width += s.back();
  }
  if (width != in.getShape().back())
    return emitOpError() << "results are " << width
                         << " wide together, but the input's last dimension "
                            "is "
                         << in.getShape().back();
  return expectSameElementType(*this);
}

LogicalResult ConcatOp::verify() {
  if (getInputs().empty())
    return emitOpError() << "needs at least one input";
  ArrayRef<int64_t> first = tensorType(getInputs().front()).getShape();
  if (first.empty())
    return emitOpError() << "inputs must have rank >= 1";
  int64_t last = 0;
  for (Value in : getInputs()) {
    ArrayRef<int64_t> s = tensorType(in).getShape();
    if (s.size() != first.size() || s.drop_back() != first.drop_back())
      return emitOpError() << "inputs " << shapeString(first) << " and "
                           << shapeString(s)
                           << " differ outside the last dimension";
    last += s.back();
  }
  if (failed(expectShape(*this, "result", getResult(), withLast(first, last))))
    return failure();
  return expectSameElementType(*this);
}

//===----------------------------------------------------------------------===//
// Embeddings
//===----------------------------------------------------------------------===//

/// Patch extents (pt, ph, pw) of a weight [D, C, pt, ph, pw].
static SmallVector<int64_t> patchOf(Value weight) {
  return SmallVector<int64_t>(tensorType(weight).getShape().drop_front(2));
}

/// Shape of the tokens [B, N, last] of latents [B, C, T, H, W] cut into
/// `patch`; fails unless the latent extents are divisible by the patch.
static LogicalResult tokenShape(Operation *op, Value latents,
                                ArrayRef<int64_t> patch, int64_t last,
                                SmallVectorImpl<int64_t> &shape) {
  ArrayRef<int64_t> s = tensorType(latents).getShape();
  int64_t n = 1;
  for (int i = 0; i < 3; ++i) {
    if (patch[i] <= 0 || s[2 + i] % patch[i] != 0)
      return op->emitOpError()
             << "latent extents " << shapeString(s.drop_front(2))
             << " are not divisible by the patch " << shapeString(patch);
    n *= s[2 + i] / patch[i];
  }
  shape.assign({s[0], n, last});
  return success();
}

LogicalResult PatchEmbedOp::verify() {
  if (failed(expectRank(*this, "input", getInput(), 5, "[B, C, T, H, W]")) ||
      failed(expectRank(*this, "weight", getWeight(), 5, "[D, C, pt, ph, pw]")))
    return failure();
  ArrayRef<int64_t> w = tensorType(getWeight()).getShape();
  if (w[0] <= 0)
    return emitOpError() << "weight " << shapeString(w)
                         << " must have at least one output channel";
  if (w[1] != tensorType(getInput()).getShape()[1])
    return emitOpError() << "weight has " << w[1] << " input channels but the "
                         << "latents have "
                         << tensorType(getInput()).getShape()[1];
  SmallVector<int64_t> tokens;
  if (failed(expectShape(*this, "bias", getBias(), {w[0]})) ||
      failed(
          tokenShape(*this, getInput(), patchOf(getWeight()), w[0], tokens)) ||
      failed(expectShape(*this, "result", getResult(), tokens)))
    return failure();
  return expectSameElementType(*this);
}

LogicalResult PatchEmbedGradOp::verify() {
  if (failed(expectRank(*this, "input", getInput(), 5, "[B, C, T, H, W]")) ||
      failed(expectRank(*this, "weight_grad", getWeightGrad(), 5,
                        "[D, C, pt, ph, pw]")))
    return failure();
  ArrayRef<int64_t> w = tensorType(getWeightGrad()).getShape();
  if (w[0] <= 0)
    return emitOpError() << "weight_grad " << shapeString(w)
                         << " must have at least one output channel";
  SmallVector<int64_t> tokens;
  if (failed(tokenShape(*this, getInput(), patchOf(getWeightGrad()), w[0],
                        tokens)) ||
      failed(expectShape(*this, "result_grad", getResultGrad(), tokens)) ||
      failed(expectShape(*this, "bias_grad", getBiasGrad(), {w[0]})))
    return failure();
  if (w[1] != tensorType(getInput()).getShape()[1])
    return emitOpError() << "weight_grad has " << w[1]
                         << " input channels but the latents have "
                         << tensorType(getInput()).getShape()[1];
  return expectSameElementType(*this);
}

/// Checks tokens [B, N, P*C] against latents [B, C, T*pt, Y*ph, X*pw].
static LogicalResult verifyPatchLayout(Operation *op, Value tokens,
                                       Value latents, ArrayRef<int64_t> patch) {
  if (failed(expectRank(op, "tokens", tokens, 3, "[B, N, pt*ph*pw*C]")) ||
      failed(expectRank(op, "latents", latents, 5, "[B, C, T, H, W]")))
    return failure();
  ArrayRef<int64_t> l = tensorType(latents).getShape();
  SmallVector<int64_t> expected;
  if (failed(tokenShape(op, latents, patch,
                        l[1] * patch[0] * patch[1] * patch[2], expected)))
    return failure();
  if (failed(expectShape(op, "tokens", tokens, expected)))
    return failure();
  return expectSameElementType(op);
}

LogicalResult UnpatchifyOp::verify() {
  if (failed(verifyPatchLayout(*this, getInput(), getResult(), getPatch())))
    return failure();
  ArrayRef<int64_t> l = getResult().getType().getShape();
  ArrayRef<int64_t> grid = getGrid(), patch = getPatch();
  for (int i = 0; i < 3; ++i)
    if (l[2 + i] != grid[i] * patch[i])
      return emitOpError() << "grid " << shapeString(grid) << " times patch "
                           << shapeString(patch) << " does not give latents "
                           << shapeString(l.drop_front(2));
  return success();
}

LogicalResult PatchifyOp::verify() {
  return verifyPatchLayout(*this, getResult(), getInput(), getPatch());
}

LogicalResult TimestepEmbeddingOp::verify() {
  if (failed(expectRank(*this, "timesteps", getTimesteps(), 1, "[B]")) ||
      failed(expectRank(*this, "result", getResult(), 2, "[B, dim]")))
    return failure();
  ArrayRef<int64_t> r = getResult().getType().getShape();
  if (r[0] != getTimesteps().getType().getShape()[0])
    return emitOpError() << "result batch " << r[0] << " does not match "
                         << getTimesteps().getType().getShape()[0]
                         << " timesteps";
  if (r[1] % 2 != 0 || r[1] <= 0)
    return emitOpError() << "embedding width must be positive and even, got "
                         << r[1];
  if (!(getMaxPeriod().convertToDouble() > 1))
    return emitOpError() << "max_period must exceed 1, got "
                         << getMaxPeriod().convertToDouble();
  return success();
}

LogicalResult EmbeddingOp::verify() {
  if (failed(expectRank(*this, "ids", getIds(), 1, "[B]")) ||
      failed(expectRank(*this, "table", getTable(), 2, "[V, D]")))
    return failure();
  int64_t b = tensorType(getIds()).getShape()[0];
  int64_t d = tensorType(getTable()).getShape()[1];
  if (failed(expectShape(*this, "result", getResult(), {b, d})))
    return failure();
  return expectSameElementType(*this);
}

LogicalResult EmbeddingGradOp::verify() {
  if (failed(expectRank(*this, "ids", getIds(), 1, "[B]")) ||
      failed(expectRank(*this, "table_grad", getTableGrad(), 2, "[V, D]")))
    return failure();
  int64_t b = tensorType(getIds()).getShape()[0];
  int64_t d = getTableGrad().getType().getShape()[1];
  if (failed(expectShape(*this, "result_grad", getResultGrad(), {b, d})))
    return failure();
  return expectSameElementType(*this);
}

//===----------------------------------------------------------------------===//
// Dense layers, norms, activations
//===----------------------------------------------------------------------===//

LogicalResult LinearOp::verify() {
  if (failed(expectRank(*this, "weight", getWeight(), 2, "[out, in]")))
    return failure();
  auto in = tensorType(getInput());
  ArrayRef<int64_t> w = tensorType(getWeight()).getShape();
  if (in.getRank() < 1 || in.getShape().back() != w[1])
    return emitOpError() << "input " << shapeString(in.getShape())
                         << " does not end in the weight's in-features "
                         << w[1];
  if (getBias() && failed(expectShape(*this, "bias", getBias(), {w[0]})))
    return failure();
  if (failed(expectShape(*this, "result", getResult(),
                         withLast(in.getShape(), w[0]))))
    return failure();
  return expectSameElementType(*this);
}

LogicalResult LinearGradDataOp::verify() {
  if (failed(expectRank(*this, "weight", getWeight(), 2, "[out, in]")))
    return failure();
  ArrayRef<int64_t> dy = tensorType(getResultGrad()).getShape();
  ArrayRef<int64_t> w = tensorType(getWeight()).getShape();
  if (dy.empty() || dy.back() != w[0])
    return emitOpError() << "result_grad " << shapeString(dy)
                         << " does not end in the weight's out-features "
                         << w[0];
  if (failed(
          expectShape(*this, "input_grad", getInputGrad(), withLast(dy, w[1]))))
    return failure();
  return expectSameElementType(*this);
}

LogicalResult LinearGradParamsOp::verify() {
  ArrayRef<int64_t> x = tensorType(getInput()).getShape();
  ArrayRef<int64_t> dy = tensorType(getResultGrad()).getShape();
  if (x.empty() || x.size() != dy.size() || x.drop_back() != dy.drop_back())
    return emitOpError() << "input " << shapeString(x) << " and result_grad "
                         << shapeString(dy) << " differ in leading dimensions";
  if (failed(expectShape(*this, "weight_grad", getWeightGrad(),
                         {dy.back(), x.back()})) ||
      (getBiasGrad() &&
       failed(expectShape(*this, "bias_grad", getBiasGrad(), {dy.back()}))))
    return failure();
  return expectSameElementType(*this);
}

static LogicalResult verifyEps(Operation *op, double eps) {
  if (eps > 0)
    return success();
  return op->emitOpError() << "eps must be positive, got " << eps;
}

LogicalResult LayerNormOp::verify() {
  if (failed(verifyNormInput(*this, getInput())))
    return failure();
  if (getAffine().size() != 0 && getAffine().size() != 2)
    return emitOpError() << "takes either no affine operands or both gamma "
                            "and beta, got "
                         << getAffine().size();
  for (Value a : getAffine())
    if (failed(verifyChannelParam(*this, "affine", a, getInput())))
      return failure();
  if (failed(expectShape(*this, "result", getResult(),
                         tensorType(getInput()).getShape())))
    return failure();
  return success(succeeded(verifyEps(*this, getEps().convertToDouble())) &&
                 succeeded(expectSameElementType(*this)));
}

LogicalResult LayerNormGradOp::verify() {
  if (failed(verifyNormInput(*this, getInput())))
    return failure();
  if (getAffine().size() != 0 && getAffine().size() != 2)
    return emitOpError() << "takes either no affine operands or both gamma "
                            "and beta, got "
                         << getAffine().size();
  if (getAffineGrads().size() != getAffine().size())
    return emitOpError() << "returns one gradient per affine operand: expected "
                         << getAffine().size() << ", got "
                         << getAffineGrads().size();
  ArrayRef<int64_t> x = tensorType(getInput()).getShape();
  for (Value a : llvm::concat<Value>(getAffine(), getAffineGrads()))
    if (failed(verifyChannelParam(*this, "affine", a, getInput())))
      return failure();
  if (failed(expectShape(*this, "result_grad", getResultGrad(), x)) ||
      failed(expectShape(*this, "input_grad", getInputGrad(), x)))
    return failure();
  return success(succeeded(verifyEps(*this, getEps().convertToDouble())) &&
                 succeeded(expectSameElementType(*this)));
}

LogicalResult RMSNormOp::verify() {
  if (failed(verifyNormInput(*this, getInput())))
    return failure();
  if (getGamma() &&
      failed(verifyChannelParam(*this, "gamma", getGamma(), getInput())))
    return failure();
  if (failed(expectShape(*this, "result", getResult(),
                         tensorType(getInput()).getShape())))
    return failure();
  return success(succeeded(verifyEps(*this, getEps().convertToDouble())) &&
                 succeeded(expectSameElementType(*this)));
}

LogicalResult RMSNormGradOp::verify() {
  if (failed(verifyNormInput(*this, getInput())))
    return failure();
  if (static_cast<bool>(getGamma()) != static_cast<bool>(getGammaGrad()))
    return emitOpError()
           << "returns a gamma gradient exactly when gamma is given";
  ArrayRef<int64_t> x = tensorType(getInput()).getShape();
  if (getGamma() &&
      (failed(verifyChannelParam(*this, "gamma", getGamma(), getInput())) ||
       failed(verifyChannelParam(*this, "gamma_grad", getGammaGrad(),
                                 getInput()))))
    return failure();
  if (failed(expectShape(*this, "result_grad", getResultGrad(), x)) ||
      failed(expectShape(*this, "input_grad", getInputGrad(), x)))
    return failure();
  return success(succeeded(verifyEps(*this, getEps().convertToDouble())) &&
                 succeeded(expectSameElementType(*this)));
}

/// Checks x [B, N, D] and per-sample vectors [B, D] (adaLN shift/scale/gate).
static LogicalResult
verifyModulation(Operation *op, Value x,
                 ArrayRef<std::pair<StringRef, Value>> vecs,
                 ArrayRef<std::pair<StringRef, Value>> like) {
  if (failed(expectRank(op, "input", x, 3, "[B, N, D]")))
    return failure();
  ArrayRef<int64_t> s = tensorType(x).getShape();
  for (auto [name, v] : vecs)
    if (failed(expectShape(op, name, v, {s[0], s[2]})))
      return failure();
  for (auto [name, v] : like)
    if (failed(expectShape(op, name, v, s)))
      return failure();
  return expectSameElementType(op);
}

LogicalResult ModulateOp::verify() {
  return verifyModulation(*this, getInput(),
                          {{"shift", getShift()}, {"scale", getScale()}},
                          {{"result", getResult()}});
}

LogicalResult ModulateGradOp::verify() {
  return verifyModulation(
      *this, getInput(),
      {{"scale", getScale()},
       {"shift_grad", getShiftGrad()},
       {"scale_grad", getScaleGrad()}},
      {{"result_grad", getResultGrad()}, {"input_grad", getInputGrad()}});
}

LogicalResult GateOp::verify() {
  return verifyModulation(*this, getInput(), {{"gate", getGate()}},
                          {{"result", getResult()}});
}

LogicalResult GateGradOp::verify() {
  return verifyModulation(
      *this, getInput(), {{"gate", getGate()}, {"gate_grad", getGateGrad()}},
      {{"result_grad", getResultGrad()}, {"input_grad", getInputGrad()}});
}

/// `bias` must be a suffix of `full`.
static LogicalResult verifyBiasSuffix(Operation *op, Value full, Value bias) {
  ArrayRef<int64_t> f = tensorType(full).getShape();
  ArrayRef<int64_t> b = tensorType(bias).getShape();
  if (b.size() > f.size() || f.take_back(b.size()) != b)
    return op->emitOpError() << "bias shape " << shapeString(b)
                             << " is not a suffix of " << shapeString(f);
  return expectSameElementType(op);
}

LogicalResult BiasAddOp::verify() {
  if (failed(expectShape(*this, "result", getResult(),
                         tensorType(getInput()).getShape())))
    return failure();
  return verifyBiasSuffix(*this, getInput(), getBias());
}

LogicalResult BiasAddGradOp::verify() {
  return verifyBiasSuffix(*this, getResultGrad(), getBiasGrad());
}

//===----------------------------------------------------------------------===//
// Attention
//===----------------------------------------------------------------------===//

LogicalResult Rope3dOp::verify() {
  if (failed(expectRank(*this, "input", getInput(), 4, "[B, N, H, Dh]")))
    return failure();
  ArrayRef<int64_t> s = getInput().getType().getShape();
  ArrayRef<int64_t> grid = getGrid(), dims = getDims();
  if (grid[0] * grid[1] * grid[2] != s[1])
    return emitOpError() << "token count " << s[1] << " does not match grid "
                         << shapeString(grid);
  if (dims[0] + dims[1] + dims[2] != s[3] ||
      llvm::any_of(dims, [](int64_t d) { return d < 0 || d % 2 != 0; }))
    return emitOpError() << "dims " << shapeString(dims)
                         << " must be even and sum to the head dim " << s[3];
  if (!(getTheta().convertToDouble() > 1))
    return emitOpError() << "theta must exceed 1";
  return success();
}

double AttentionOp::getEffectiveScale() {
  if (auto s = getScale())
    return s->convertToDouble();
  return 1.0 / std::sqrt(double(tensorType(getQuery()).getShape()[3]));
}

/// q [B, Nq, H, Dh]; k, v [B, Nk, H, Dh].
/// An explicit softmax scale must be a positive finite number.
static LogicalResult verifyScale(Operation *op, std::optional<APFloat> scale) {
  if (!scale)
    return success();
  double s = scale->convertToDouble();
  if (s > 0 && std::isfinite(s))
    return success();
  return op->emitOpError() << "scale must be positive and finite, got " << s;
}

static LogicalResult verifyAttentionOperands(Operation *op, Value q, Value k,
                                             Value v) {
  if (failed(expectRank(op, "query", q, 4, "[B, N, H, Dh]")) ||
      failed(expectRank(op, "key", k, 4, "[B, N, H, Dh]")))
    return failure();
  ArrayRef<int64_t> qs = tensorType(q).getShape(),
                    ks = tensorType(k).getShape();
  if (qs[0] != ks[0] || qs[2] != ks[2] || qs[3] != ks[3])
    return op->emitOpError()
           << "query " << shapeString(qs) << " and key " << shapeString(ks)
           << " differ in batch, heads or head dim";
  if (failed(expectShape(op, "value", v, ks)))
    return failure();
  return expectSameElementType(op);
}

LogicalResult AttentionOp::verify() {
  if (failed(verifyScale(*this, getScale())))
    return failure();
  if (failed(verifyAttentionOperands(*this, getQuery(), getKey(), getValue())))
    return failure();
  return expectShape(*this, "result", getResult(),
                     tensorType(getQuery()).getShape());
}

LogicalResult AttentionGradOp::verify() {
  if (failed(verifyScale(*this, getScale())))
    return failure();
  if (failed(verifyAttentionOperands(*this, getQuery(), getKey(), getValue())))
    return failure();
  ArrayRef<int64_t> qs = tensorType(getQuery()).getShape();
  ArrayRef<int64_t> ks = tensorType(getKey()).getShape();
  if (failed(expectShape(*this, "output", getOutput(), qs)) ||
      failed(expectShape(*this, "output_grad", getOutputGrad(), qs)) ||
      failed(expectShape(*this, "query_grad", getQueryGrad(), qs)) ||
      failed(expectShape(*this, "key_grad", getKeyGrad(), ks)) ||
      failed(expectShape(*this, "value_grad", getValueGrad(), ks)))
    return failure();
  return success();
}

/// The softmax log-sum-exp of a 3D-DSA op: fp32 [B, H, N] for q [B, N, H, Dh].
/// Its element type is fixed by the op definition (f32), and it is left out
/// of the same-element-type check of the 16-bit tensors.
static LogicalResult verifyDsaLse(Operation *op, Value q, Value lse) {
  ArrayRef<int64_t> qs = tensorType(q).getShape();
  return expectShape(op, "lse", lse, {qs[0], qs[2], qs[1]});
}

LogicalResult Dsa3dOp::verify() {
  if (failed(verifyScale(*this, getScale())))
    return failure();
  SmallVector<int64_t> offsets;
  if (failed(verifyDsaOperands(*this, getQuery(), getKey(), getValue(),
                               getGrid(), getWindow(), getTile(), offsets)) ||
      failed(expectShape(*this, "offsets", getOffsets(), offsets)) ||
      failed(expectShape(*this, "result", getResult(),
                         tensorType(getQuery()).getShape())) ||
      failed(verifyDsaLse(*this, getQuery(), getLse())))
    return failure();
  return expectSameElementType(*this,
                               {getQuery(), getKey(), getValue(), getResult()});
}

LogicalResult Dsa3dGradOp::verify() {
  if (failed(verifyScale(*this, getScale())))
    return failure();
  SmallVector<int64_t> offsets;
  if (failed(verifyDsaOperands(*this, getQuery(), getKey(), getValue(),
                               getGrid(), getWindow(), getTile(), offsets)) ||
      failed(expectShape(*this, "offsets", getOffsets(), offsets)))
    return failure();
  ArrayRef<int64_t> qs = tensorType(getQuery()).getShape();
  for (auto [name, v] : {std::pair<StringRef, Value>{"output", getOutput()},
                         {"output_grad", getOutputGrad()},
                         {"query_grad", getQueryGrad()},
                         {"key_grad", getKeyGrad()},
                         {"value_grad", getValueGrad()}})
    if (failed(expectShape(*this, name, v, qs)))
      return failure();
  if (failed(verifyDsaLse(*this, getQuery(), getLse())))
    return failure();
  return expectSameElementType(
      *this, {getQuery(), getKey(), getValue(), getOutput(), getOutputGrad(),
              getQueryGrad(), getKeyGrad(), getValueGrad()});
}

LogicalResult Dsa3dOffsetsOp::verify() {
  SmallVector<int64_t> offsets;
  if (failed(verifyDsaOperands(*this, getQuery(), getKey(), Value(), getGrid(),
                               getWindow(), getTile(), offsets)) ||
      failed(expectShape(*this, "offsets", getOffsets(), offsets)))
    return failure();
  return expectSameElementType(*this);
}

//===----------------------------------------------------------------------===//
// Flow matching
//===----------------------------------------------------------------------===//

LogicalResult FlowInterpolateOp::verify() {
  ArrayRef<int64_t> x = tensorType(getLatents()).getShape();
  if (x.empty())
    return emitOpError() << "latents must have a batch dimension";
  if (failed(expectShape(*this, "noise", getNoise(), x)) ||
      failed(expectShape(*this, "timesteps", getTimesteps(), {x[0]})) ||
      failed(expectShape(*this, "result", getResult(), x)))
    return failure();
  // Timesteps stay fp32 whatever the latents' precision.
  return expectSameElementType(*this, {getLatents(), getNoise(), getResult()});
}

/// The prediction matches the latents except for possibly more channels;
/// the optional weights are one per sample.
static LogicalResult verifyPrediction(Operation *op, Value pred, Value latents,
                                      Value noise, Value weights) {
  ArrayRef<int64_t> x = tensorType(latents).getShape();
  ArrayRef<int64_t> p = tensorType(pred).getShape();
  if (failed(expectShape(op, "noise", noise, x)))
    return failure();
  if (weights && !x.empty() &&
      failed(expectShape(op, "weights", weights, {x[0]})))
    return failure();
  bool ok = x.size() >= 2 && p.size() == x.size() && p[0] == x[0] &&
            p[1] >= x[1] && p.drop_front(2) == x.drop_front(2);
  if (!ok)
    return op->emitOpError()
           << "prediction " << shapeString(p) << " must match the latents "
           << shapeString(x) << " except for extra channels";
  // The loss itself and the weights are fp32.
  return expectSameElementType(op, {pred, latents, noise});
}

void FlowMatchingLossOp::getAsmResultNames(OpAsmSetValueNameFn setNameFn) {
  if (Value unweighted = getUnweightedLoss()) {
    setNameFn(getLoss(), "loss");
    setNameFn(unweighted, "unweighted_loss");
  }
}

LogicalResult FlowMatchingLossOp::verify() {
  if (!getWeights() != !getUnweightedLoss())
    return emitOpError() << "returns the unweighted loss exactly when it "
                            "has weights";
  return verifyPrediction(*this, getPrediction(), getLatents(), getNoise(),
                          getWeights());
}

LogicalResult FlowMatchingLossGradOp::verify() {
  if (failed(expectShape(*this, "prediction_grad", getPredictionGrad(),
                         tensorType(getPrediction()).getShape())))
    return failure();
  return verifyPrediction(*this, getPrediction(), getLatents(), getNoise(),
                          getWeights());
}

#define GET_OP_CLASSES
#include "dialects/Graph/GraphOps.cpp.inc"
