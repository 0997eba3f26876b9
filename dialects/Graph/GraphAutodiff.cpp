//===- GraphAutodiff.cpp - Reverse-mode differentiation of graph IR -------===//

#include "dialects/Graph/GraphAutodiff.h"
#include "dialects/Graph/GraphOps.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/ScopeExit.h"

using namespace mlir;
using namespace megaslide::graph;

namespace {

/// Copies the block index of the op being differentiated onto every op its
/// backward inserts, so per-layer planning sees forward and backward alike.
struct LayerPropagator : OpBuilder::Listener {
  Attribute layer;
  void notifyOperationInserted(Operation *op, OpBuilder::InsertPoint) override {
    if (layer)
      op->setAttr(kLayerAttrName, layer);
  }
};

} // namespace

FailureOr<SmallVector<Value>>
megaslide::emitBackward(OpBuilder &builder, Value loss, ArrayRef<Value> wrt) {
  Operation *root = loss.getDefiningOp();
  if (!root)
    return failure();
  Block *block = root->getBlock();

  // Values that depend on some `wrt` value: only they need gradients.
  DenseSet<Value> active(wrt.begin(), wrt.end());
  for (Operation &op : block->without_terminator()) {
    if (llvm::any_of(op.getOperands(),
                     [&](Value v) { return active.contains(v); }))
      active.insert(op.getResults().begin(), op.getResults().end());
    if (&op == root)
      break;
  }

  // Accumulated gradient of every active value reached from the loss.
  DenseMap<Value, Value> grads;
  auto accumulate = [&](Location loc, Value v, Value g) {
    auto [it, inserted] = grads.try_emplace(v, g);
    if (!inserted)
      it->second = AddOp::create(builder, loc, it->second, g);
  };

  LayerPropagator propagator;
  OpBuilder::Listener *previousListener = builder.getListener();
  builder.setListener(&propagator);
  llvm::scope_exit restore([&] { builder.setListener(previousListener); });

  for (Operation *op = root; op; op = op->getPrevNode()) {
    bool isRoot = op == root;
    SmallVector<Value> resultGrads;
    bool reached = isRoot;
    for (Value r : op->getResults()) {
      resultGrads.push_back(grads.lookup(r));
      reached |= static_cast<bool>(resultGrads.back());
    }
    if (!reached)
      continue;
    SmallVector<bool> needed;
    for (Value operand : op->getOperands())
      needed.push_back(active.contains(operand));
    if (llvm::none_of(needed, [](bool b) { return b; }))
      continue;
    auto differentiable = dyn_cast<DifferentiableOpInterface>(op);
    if (!differentiable)
      return op->emitOpError() << "is on the path to the loss but has no "
                                  "gradient (DifferentiableOpInterface)";
    SmallVector<Value> operandGrads;
    propagator.layer = op->getAttr(kLayerAttrName);
    if (failed(differentiable.emitGradients(builder, resultGrads, needed,
                                            operandGrads)))
      return failure();
    for (auto [operand, g] : llvm::zip_equal(op->getOperands(), operandGrads))
      if (g)
        accumulate(op->getLoc(), operand, g);
  }

  // Zero gradients of unreachable values belong to no block.
  propagator.layer = nullptr;
  SmallVector<Value> result;
  for (Value v : wrt) {
    Value g = grads.lookup(v);
    result.push_back(g ? g
                       : ZerosOp::create(builder, loss.getLoc(), v.getType()));
  }
  return result;
}
