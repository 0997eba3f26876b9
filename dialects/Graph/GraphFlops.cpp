//===- GraphFlops.cpp - FLOP counts of graph ops --------------------------===//
//
// One multiply-add counts as 2 FLOPs. `matmul` and `attention` are exact
// products of the shapes; `other` uses per-element constants for
// elementwise work (documented in docs/FLOPs.md). Transcendentals (exp,
// tanh, sin, cos) count as one FLOP, softmax max/exp/sum are not counted,
// as in the FlashAttention papers.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

using namespace mlir;
using namespace megaslide::graph;

namespace {

uint64_t numel(Value v) {
  return static_cast<uint64_t>(
      cast<RankedTensorType>(v.getType()).getNumElements());
}

int64_t dim(Value v, int64_t i) {
  auto shape = cast<RankedTensorType>(v.getType()).getShape();
  return shape[i < 0 ? shape.size() + i : i];
}

FlopCount matmul(uint64_t flops, uint64_t other = 0) {
  FlopCount c;
  c.matmul = flops;
  c.other = other;
  return c;
}

FlopCount attention(uint64_t flops) {
  FlopCount c;
  c.attention = flops;
  return c;
}

FlopCount elementwise(uint64_t flops) {
  FlopCount c;
  c.other = flops;
  return c;
}

/// Per-element FLOPs of the elementwise ops (docs/FLOPs.md).
namespace per_element {
constexpr uint64_t adamw = 14, rope = 3, modulate = 3, modulateGrad = 5,
                   gate = 1, gateGrad = 4, gelu = 9, geluGrad = 15, silu = 4,
                   siluGrad = 6, layerNorm = 7, layerNormGrad = 11, rmsNorm = 4,
                   rmsNormGrad = 8, affine = 2, flow = 3, weightedLoss = 2,
                   weightedLossGrad = 1;
} // namespace per_element

/// Score and value products of attention with `keys` keys per query.
/// Forward: 2 matmuls (QK^T, PV). Backward: 5 (S recomputed, dV, dP, dQ, dK).
uint64_t attentionFlops(Value q, uint64_t keys, uint64_t matmuls) {
  // q is [B, N, H, Dh]: every query meets `keys` keys in every head.
  return 2 * matmuls * numel(q) * keys;
}

uint64_t dsaWindow(ArrayRef<int64_t> window) {
  return static_cast<uint64_t>(window[0] * window[1] * window[2]);
}

} // namespace

FlopCount AdamWOp::getFlopCount() {
  return elementwise(per_element::adamw * numel(getParam()));
}

FlopCount PatchEmbedOp::getFlopCount() {
  uint64_t patchSize = numel(getWeight()) / dim(getWeight(), 0);
  return matmul(2 * numel(getResult()) * patchSize, numel(getResult()));
}

FlopCount PatchEmbedGradOp::getFlopCount() {
  uint64_t patchSize = numel(getWeightGrad()) / dim(getWeightGrad(), 0);
  return matmul(2 * numel(getResultGrad()) * patchSize, numel(getResultGrad()));
}

FlopCount TimestepEmbeddingOp::getFlopCount() {
  return elementwise(3 * numel(getResult()));
}

FlopCount EmbeddingOp::getFlopCount() { return FlopCount(); }

FlopCount EmbeddingGradOp::getFlopCount() {
  return elementwise(numel(getResultGrad()));
}

FlopCount LinearOp::getFlopCount() {
  uint64_t out = numel(getResult());
  return matmul(2 * out * dim(getWeight(), 1), getBias() ? out : 0);
}

FlopCount LinearGradDataOp::getFlopCount() {
  return matmul(2 * numel(getResultGrad()) * dim(getWeight(), 1));
}

FlopCount LinearGradParamsOp::getFlopCount() {
  uint64_t dy = numel(getResultGrad());
  return matmul(2 * dy * dim(getInput(), -1), getBiasGrad() ? dy : 0);
}

FlopCount LayerNormOp::getFlopCount() {
  uint64_t k =
      per_element::layerNorm + (getAffine().empty() ? 0 : per_element::affine);
  return elementwise(k * numel(getInput()));
}

FlopCount LayerNormGradOp::getFlopCount() {
  uint64_t k = per_element::layerNormGrad +
               (getAffine().empty() ? 0 : 2 * per_element::affine);
  return elementwise(k * numel(getInput()));
}

FlopCount RMSNormOp::getFlopCount() {
  uint64_t k = per_element::rmsNorm + (getGamma() ? 1 : 0);
  return elementwise(k * numel(getInput()));
}

FlopCount RMSNormGradOp::getFlopCount() {
  uint64_t k =
      per_element::rmsNormGrad + (getGamma() ? per_element::affine : 0);
  return elementwise(k * numel(getInput()));
}

FlopCount ModulateOp::getFlopCount() {
  return elementwise(per_element::modulate * numel(getInput()));
}

FlopCount ModulateGradOp::getFlopCount() {
  return elementwise(per_element::modulateGrad * numel(getInput()));
}

FlopCount GateOp::getFlopCount() {
  return elementwise(per_element::gate * numel(getInput()));
}

FlopCount GateGradOp::getFlopCount() {
  return elementwise(per_element::gateGrad * numel(getInput()));
}

FlopCount GeluOp::getFlopCount() {
  return elementwise(per_element::gelu * numel(getInput()));
}

FlopCount GeluGradOp::getFlopCount() {
  return elementwise(per_element::geluGrad * numel(getInput()));
}

FlopCount SiluOp::getFlopCount() {
  return elementwise(per_element::silu * numel(getInput()));
}

FlopCount SiluGradOp::getFlopCount() {
  return elementwise(per_element::siluGrad * numel(getInput()));
}

FlopCount AddOp::getFlopCount() { return elementwise(numel(getResult())); }

FlopCount BiasAddOp::getFlopCount() { return elementwise(numel(getResult())); }

FlopCount BiasAddGradOp::getFlopCount() {
  return elementwise(numel(getResultGrad()));
}

FlopCount Rope3dOp::getFlopCount() {
  return elementwise(per_element::rope * numel(getInput()));
}

FlopCount AttentionOp::getFlopCount() {
  return attention(attentionFlops(getQuery(), dim(getKey(), 1), 2));
}

FlopCount AttentionGradOp::getFlopCount() {
  return attention(attentionFlops(getQuery(), dim(getKey(), 1), 5));
}

FlopCount Dsa3dOp::getFlopCount() {
  return attention(attentionFlops(getQuery(), dsaWindow(getWindow()), 2));
}

FlopCount Dsa3dGradOp::getFlopCount() {
  return attention(attentionFlops(getQuery(), dsaWindow(getWindow()), 5));
}

FlopCount Dsa3dOffsetsOp::getFlopCount() {
  // Pool query tiles (1 add/element), build per-frame 2D prefix sums of the
  // keys (2 adds/element), then per tile, key frame and candidate
  // displacement a box sum (3 adds) and a dot product (2) per channel.
  ArrayRef<int64_t> g = getGrid(), t = getTile();
  uint64_t batchHeads = dim(getQuery(), 0) * dim(getQuery(), 2);
  uint64_t headDim = dim(getQuery(), 3);
  uint64_t tiles = ((g[0] + t[0] - 1) / t[0]) * ((g[1] + t[1] - 1) / t[1]) *
                   ((g[2] + t[2] - 1) / t[2]);
  uint64_t candidates = (2 * getRadius() + 1) * (2 * getRadius() + 1);
  return attention(3 * numel(getQuery()) + batchHeads * tiles * getWindow()[0] *
                                               candidates * 5 * headDim);
}

FlopCount FlowInterpolateOp::getFlopCount() {
  return elementwise(per_element::flow * numel(getResult()));
}

FlopCount FlowMatchingLossOp::getFlopCount() {
  // Weighted: the weight's product and the unweighted sum too.
  return elementwise(
      (per_element::flow + (getWeights() ? per_element::weightedLoss : 0)) *
      numel(getLatents()));
}

FlopCount FlowMatchingLossGradOp::getFlopCount() {
  return elementwise(
      (per_element::flow + (getWeights() ? per_element::weightedLossGrad : 0)) *
      numel(getLatents()));
}
