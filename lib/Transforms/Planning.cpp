//===- Planning.cpp - Shared pieces of the planning passes ----------------===//

#include "megaslide/Transforms/Planning.h"

#include "dialects/Graph/GraphOps.h"
#include "megaslide/Model/ModelBuilder.h"

using namespace mlir;
using namespace megaslide;

FailureOr<func::FuncOp> megaslide::getTrainStep(ModuleOp module) {
  auto step = module.lookupSymbol<func::FuncOp>(kTrainStepName);
  if (!step || step.isExternal())
    return module.emitError() << "planning needs a '@" << kTrainStepName
                              << "' function (as built by megaslide-plan "
                                 "--emit-mlir)";
  return step;
}

int64_t megaslide::countLayers(func::FuncOp step) {
  int64_t layers = 0;
  step.walk([&](Operation *op) {
    if (std::optional<int64_t> l = getLayer(op))
      layers = std::max(layers, *l + 1);
  });
  return layers;
}

Operation *megaslide::findLoss(func::FuncOp step) {
  for (Operation &op : step.getBody().front())
    if (isa<graph::FlowMatchingLossOp>(op))
      return &op;
  return nullptr;
}

void megaslide::declareResource(ModuleOp module, StringRef name,
                                schedule::Residency residency, uint64_t size,
                                StringRef category) {
  if (auto existing = module.lookupSymbol<schedule::ResourceOp>(name)) {
    existing.setSize(size);
    return;
  }
  // Declarations stay together, in the order the passes made them.
  OpBuilder b(module.getBodyRegion());
  for (auto resource : module.getOps<schedule::ResourceOp>())
    b.setInsertionPointAfter(resource);
  schedule::ResourceOp::create(b, module.getLoc(), name, residency, size,
                            category);
}
