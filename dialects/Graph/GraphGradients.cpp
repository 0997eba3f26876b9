//===- GraphGradients.cpp - Backward of every forward graph op ------------===//
//
// DifferentiableOpInterface implementations: each forward op emits the
// dedicated backward op(s) for the operands that need a gradient. Reverse
// mode over whole modules is `megaslide::emitBackward` (GraphAutodiff.h).
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

#include "mlir/IR/Builders.h"

using namespace mlir;
using namespace megaslide::graph;

namespace {

/// Appends `grads` for the operands that need them, nulls elsewhere.
void assign(SmallVectorImpl<Value> &out, ArrayRef<bool> needed,
            ArrayRef<Value> grads) {
  for (auto [need, g] : llvm::zip_equal(needed, grads))
    out.push_back(need ? g : Value());
}

LogicalResult noGradientFor(Operation *op, StringRef operand) {
  return op->emitOpError() << "has no gradient with respect to '" << operand
                           << "' (it is data, not state)";
}

} // namespace

LogicalResult CastOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                    ArrayRef<bool> needed,
                                    SmallVectorImpl<Value> &out) {
  Value dx = CastOp::create(b, getLoc(), getInput().getType(), dys[0]);
  assign(out, needed, {dx});
  return success();
}

LogicalResult ReshapeOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                       ArrayRef<bool> needed,
                                       SmallVectorImpl<Value> &out) {
  Value dx = ReshapeOp::create(b, getLoc(), getInput().getType(), dys[0]);
  assign(out, needed, {dx});
  return success();
}

LogicalResult SplitOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                     ArrayRef<bool> needed,
                                     SmallVectorImpl<Value> &out) {
  SmallVector<Value> parts;
  for (auto [dy, r] : llvm::zip_equal(dys, getResults()))
    parts.push_back(dy ? dy : ZerosOp::create(b, getLoc(), r.getType()));
  Value dx = ConcatOp::create(b, getLoc(), getInput().getType(), parts);
  assign(out, needed, {dx});
  return success();
}

LogicalResult ConcatOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                      ArrayRef<bool> needed,
                                      SmallVectorImpl<Value> &out) {
  auto split = SplitOp::create(b, getLoc(), getInputs().getTypes(), dys[0]);
  assign(out, needed, SmallVector<Value>(split.getResults()));
  return success();
}

LogicalResult PatchEmbedOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                          ArrayRef<bool> needed,
                                          SmallVectorImpl<Value> &out) {
  if (needed[0])
    return noGradientFor(*this, "input");
  auto grad = PatchEmbedGradOp::create(b, getLoc(), getWeight().getType(),
                                       getBias().getType(), getInput(), dys[0]);
  assign(out, needed, {Value(), grad.getWeightGrad(), grad.getBiasGrad()});
  return success();
}

LogicalResult UnpatchifyOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                          ArrayRef<bool> needed,
                                          SmallVectorImpl<Value> &out) {
  Value dx = PatchifyOp::create(b, getLoc(), getInput().getType(), dys[0],
                                getPatchAttr());
  assign(out, needed, {dx});
  return success();
}

LogicalResult EmbeddingOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                         ArrayRef<bool> needed,
                                         SmallVectorImpl<Value> &out) {
  if (needed[0])
    return noGradientFor(*this, "ids");
  Value dt = EmbeddingGradOp::create(b, getLoc(), getTable().getType(),
                                     getIds(), dys[0]);
  assign(out, needed, {Value(), dt});
  return success();
}

LogicalResult LinearOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                      ArrayRef<bool> needed,
                                      SmallVectorImpl<Value> &out) {
  Value dx, dw, db;
  if (needed[0])
    dx = LinearGradDataOp::create(b, getLoc(), getInput().getType(), dys[0],
                                  getWeight());
  if (needed[1] || (getBias() && needed[2])) {
    Type biasType = getBias() ? getBias().getType() : Type();
    auto grad = LinearGradParamsOp::create(b, getLoc(), getWeight().getType(),
                                           biasType, getInput(), dys[0]);
    dw = grad.getWeightGrad();
    db = grad.getBiasGrad();
  }
  SmallVector<Value> grads = {dx, dw};
  if (getBias())
    grads.push_back(db);
  assign(out, needed, grads);
  return success();
}

LogicalResult LayerNormOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                         ArrayRef<bool> needed,
                                         SmallVectorImpl<Value> &out) {
  auto grad = LayerNormGradOp::create(b, getLoc(), getInput().getType(),
                                      getAffine().getTypes(), getInput(),
                                      dys[0], getAffine(), getEpsAttr());
  SmallVector<Value> grads = {grad.getInputGrad()};
  llvm::append_range(grads, grad.getAffineGrads());
  assign(out, needed, grads);
  return success();
}

LogicalResult RMSNormOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                       ArrayRef<bool> needed,
                                       SmallVectorImpl<Value> &out) {
  Type gammaType = getGamma() ? getGamma().getType() : Type();
  auto grad =
      RMSNormGradOp::create(b, getLoc(), getInput().getType(), gammaType,
                            getInput(), dys[0], getGamma(), getEpsAttr());
  SmallVector<Value> grads = {grad.getInputGrad()};
  if (getGamma())
    grads.push_back(grad.getGammaGrad());
  assign(out, needed, grads);
  return success();
}

LogicalResult ModulateOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                        ArrayRef<bool> needed,
                                        SmallVectorImpl<Value> &out) {
  auto grad = ModulateGradOp::create(b, getLoc(), getInput().getType(),
                                     getShift().getType(), getScale().getType(),
                                     getInput(), getScale(), dys[0]);
  assign(out, needed,
         {grad.getInputGrad(), grad.getShiftGrad(), grad.getScaleGrad()});
  return success();
}

LogicalResult GateOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                    ArrayRef<bool> needed,
                                    SmallVectorImpl<Value> &out) {
  auto grad =
      GateGradOp::create(b, getLoc(), getInput().getType(), getGate().getType(),
                         getInput(), getGate(), dys[0]);
  assign(out, needed, {grad.getInputGrad(), grad.getGateGrad()});
  return success();
}

LogicalResult GeluOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                    ArrayRef<bool> needed,
                                    SmallVectorImpl<Value> &out) {
  Value dx = GeluGradOp::create(b, getLoc(), getInput().getType(), getInput(),
                                dys[0], getExact());
  assign(out, needed, {dx});
  return success();
}

LogicalResult SiluOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                    ArrayRef<bool> needed,
                                    SmallVectorImpl<Value> &out) {
  Value dx = SiluGradOp::create(b, getLoc(), getInput(), dys[0]);
  assign(out, needed, {dx});
  return success();
}

LogicalResult AddOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                   ArrayRef<bool> needed,
                                   SmallVectorImpl<Value> &out) {
  assign(out, needed, {dys[0], dys[0]});
  return success();
}

LogicalResult BiasAddOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                       ArrayRef<bool> needed,
                                       SmallVectorImpl<Value> &out) {
  Value db;
  if (needed[1])
    db = BiasAddGradOp::create(b, getLoc(), getBias().getType(), dys[0]);
  assign(out, needed, {dys[0], db});
  return success();
}

LogicalResult Rope3dOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                      ArrayRef<bool> needed,
                                      SmallVectorImpl<Value> &out) {
  // A rotation's adjoint is the rotation by the negated angle.
  auto inverse = Rope3dOp::create(b, getLoc(), dys[0], getGridAttr(),
                                  getDimsAttr(), getThetaAttr(),
                                  getInverse() ? UnitAttr() : b.getUnitAttr());
  assign(out, needed, {inverse.getResult()});
  return success();
}

LogicalResult AttentionOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                         ArrayRef<bool> needed,
                                         SmallVectorImpl<Value> &out) {
  auto grad = AttentionGradOp::create(b, getLoc(), getQuery().getType(),
                                      getKey().getType(), getValue().getType(),
                                      getQuery(), getKey(), getValue(),
                                      getResult(), dys[0], getScaleAttr());
  assign(out, needed,
         {grad.getQueryGrad(), grad.getKeyGrad(), grad.getValueGrad()});
  return success();
}

LogicalResult Dsa3dOp::emitGradients(OpBuilder &b, ArrayRef<Value> dys,
                                     ArrayRef<bool> needed,
                                     SmallVectorImpl<Value> &out) {
  // The log-sum-exp is a by-product kept for the backward; dsa3d_grad has
  // no term for a loss that depends on it.
  if (dys[1])
    return emitOpError() << "has no gradient through its 'lse' result (it "
                            "feeds the backward only)";
  auto grad = Dsa3dGradOp::create(
      b, getLoc(), getQuery().getType(), getKey().getType(),
      getValue().getType(), getQuery(), getKey(), getValue(), getOffsets(),
      getResult(), getLse(), dys[0], getGridAttr(), getWindowAttr(),
      getTileAttr(), getScaleAttr());
  // Offsets are integers: no gradient flows into offset estimation.
  assign(
      out, needed,
      {grad.getQueryGrad(), grad.getKeyGrad(), grad.getValueGrad(), Value()});
  return success();
}

LogicalResult FlowMatchingLossOp::emitGradients(OpBuilder &b,
                                                ArrayRef<Value> dys,
                                                ArrayRef<bool> needed,
                                                SmallVectorImpl<Value> &out) {
  // The loss is the root of the backward pass: its upstream gradient is 1.
  if (dys[0])
    return emitOpError() << "must be the root of differentiation";
  // The unweighted loss is reported, not differentiated.
  if (dys.size() > 1 && dys[1])
    return emitOpError() << "cannot differentiate the unweighted loss";
  static constexpr StringLiteral kData[] = {"latents", "noise", "weights"};
  for (size_t i = 1; i < needed.size(); ++i)
    if (needed[i])
      return noGradientFor(*this, kData[i - 1]);
  Value dp = FlowMatchingLossGradOp::create(
      b, getLoc(), getPrediction().getType(), getPrediction(), getLatents(),
      getNoise(), getWeights());
  SmallVector<Value> grads(needed.size());
  grads[0] = dp;
  assign(out, needed, grads);
  return success();
}
