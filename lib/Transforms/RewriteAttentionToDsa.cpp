//===- RewriteAttentionToDsa.cpp - Global attention -> 3D-DSA -------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Pipelines/PipelineOptions.h"

#include "mlir/IR/Builders.h"

namespace megaslide {
#define GEN_PASS_DEF_REWRITEATTENTIONTODSAPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-rewrite-attention-to-dsa"

using namespace mlir;
using namespace megaslide;
using namespace megaslide::graph;

namespace {

/// Defaults sized for 720p video grids: tiles of 3 x 5 x 8 = 120 queries,
/// windows of 3 x 3 x 3 tiles.
constexpr int64_t kDefaultTile[] = {3, 5, 8};
constexpr int64_t kDefaultWindow[] = {9, 15, 24};

struct RewriteAttentionToDsaPass
    : megaslide::impl::RewriteAttentionToDsaPassBase<
          RewriteAttentionToDsaPass> {
  using RewriteAttentionToDsaPassBase::RewriteAttentionToDsaPassBase;
  RewriteAttentionToDsaPass() = default;
  RewriteAttentionToDsaPass(const RewriteAttentionToDsaPass &other)
      : RewriteAttentionToDsaPassBase(other) {}

  PipelineOption<&PlanningOptions::dsaWindow> window{*this};
  PipelineOption<&PlanningOptions::dsaTile> tile{*this};
  PipelineOption<&PlanningOptions::dsaRadius> radius{*this};

  void runOnOperation() override {
    SmallVector<int64_t> windowSize(window.begin(), window.end());
    SmallVector<int64_t> tileSize(tile.begin(), tile.end());
    if (windowSize.empty())
      windowSize.assign(std::begin(kDefaultWindow), std::end(kDefaultWindow));
    if (tileSize.empty())
      tileSize.assign(std::begin(kDefaultTile), std::end(kDefaultTile));
    if (windowSize.size() != 3 || tileSize.size() != 3 ||
        llvm::any_of(llvm::concat<int64_t>(windowSize, tileSize),
                     [](int64_t v) { return v <= 0; }) ||
        radius < 0) {
      getOperation().emitError()
          << "options 'window' and 'tile' need three positive extents "
             "(t,y,x) and 'radius' must be non-negative";
      return signalPassFailure();
    }
    // Rewriting erases attention_grad ops, so walk first, rewrite after.
    SmallVector<AttentionOp> attentions;
    getOperation().walk([&](AttentionOp a) { attentions.push_back(a); });
    for (AttentionOp attention : attentions)
      rewrite(attention, windowSize, tileSize);
  }

  void rewrite(AttentionOp attention, ArrayRef<int64_t> windowSize,
               ArrayRef<int64_t> tileSize) {
    auto rope = attention.getQuery().getDefiningOp<Rope3dOp>();
    if (!rope || !attention.getKey().getDefiningOp<Rope3dOp>())
      return; // cross-attention: keys are text tokens, not a grid
    std::optional<int64_t> layer = getLayer(attention);
    if (!layers.empty() && (!layer || !llvm::is_contained(layers, *layer)))
      return;
    ArrayRef<int64_t> grid = rope.getGrid();
    static const char *axes[] = {"t", "y", "x"};
    for (int i = 0; i < 3; ++i)
      if (windowSize[i] > grid[i]) {
        attention.emitRemark()
            << "kept global attention: the token grid (" << grid[0] << ", "
            << grid[1] << ", " << grid[2] << ") is smaller than the 3D-DSA "
            << "window along " << axes[i] << " (" << windowSize[i] << ")";
        return;
      }
    OpBuilder b(attention);
    auto q = attention.getQuery(), k = attention.getKey(),
         v = attention.getValue();
    auto shape = cast<RankedTensorType>(q.getType()).getShape();
    SmallVector<int64_t> offsetsShape = {shape[0], shape[2]};
    for (int i = 0; i < 3; ++i)
      offsetsShape.push_back((grid[i] + tileSize[i] - 1) / tileSize[i]);
    offsetsShape.append({windowSize[0], 2});
    auto gridAttr = b.getDenseI64ArrayAttr(grid);
    auto windowAttr = b.getDenseI64ArrayAttr(windowSize);
    auto tileAttr = b.getDenseI64ArrayAttr(tileSize);
    auto offsets = Dsa3dOffsetsOp::create(
        b, attention.getLoc(),
        RankedTensorType::get(offsetsShape, b.getI32Type()), q, k, gridAttr,
        windowAttr, tileAttr, b.getI64IntegerAttr(radius));
    // The forward's fp32 log-sum-exp [B, H, N] is what the backward reads.
    auto lseType =
        RankedTensorType::get({shape[0], shape[2], shape[1]}, b.getF32Type());
    auto dsa = Dsa3dOp::create(b, attention.getLoc(), attention.getType(),
                               lseType, q, k, v, offsets, gridAttr, windowAttr,
                               tileAttr, attention.getScaleAttr());
    for (Operation *op : {offsets.getOperation(), dsa.getOperation()})
      if (layer)
        op->setAttr(kLayerAttrName, attention->getAttr(kLayerAttrName));

    for (Operation *user : llvm::make_early_inc_range(attention->getUsers())) {
      auto grad = dyn_cast<AttentionGradOp>(user);
      if (!grad || grad.getOutput() != attention.getResult())
        continue;
      OpBuilder gb(grad);
      auto dsaGrad = Dsa3dGradOp::create(
          gb, grad.getLoc(), grad.getQueryGrad().getType(),
          grad.getKeyGrad().getType(), grad.getValueGrad().getType(), q, k, v,
          offsets, dsa.getResult(), dsa.getLse(), grad.getOutputGrad(),
          gridAttr, windowAttr, tileAttr, attention.getScaleAttr());
      if (Attribute l = grad->getAttr(kLayerAttrName))
        dsaGrad->setAttr(kLayerAttrName, l);
      grad.replaceAllUsesWith(dsaGrad.getResults());
      grad.erase();
    }
    attention.replaceAllUsesWith(dsa.getResult());
    attention.erase();
  }
};

} // namespace
