//===- PlanMemory.cpp - Static offsets in one device arena ----------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/DeviceBuffers.h"

#include "mlir/IR/Builders.h"

namespace megaslide {
#define GEN_PASS_DEF_PLANMEMORYPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-plan-memory"

using namespace mlir;
using namespace megaslide;

static LogicalResult checkAlignment(ModuleOp module, int64_t alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0)
    return module.emitError() << "option 'alignment': " << alignment
                              << " is not a positive power of two";
  return success();
}

static Packing pack(const DeviceBuffers &buffers, int64_t alignment) {
  SmallVector<Slice> slices;
  for (const DeviceBuffer &b : buffers.buffers)
    slices.push_back(b.slice);
  return packSlices(slices, alignment);
}

FailureOr<int64_t> megaslide::planMemory(ModuleOp module, int64_t alignment) {
  FailureOr<func::FuncOp> step = getTrainStep(module);
  if (failed(step) || failed(checkAlignment(module, alignment)))
    return failure();
  Block &body = step->getBody().front();
  for (auto pack : llvm::make_early_inc_range(body.getOps<schedule::PackOp>()))
    pack.erase();

  DeviceBuffers buffers = collectDeviceBuffers(*step);
  SmallVector<int64_t> sizes, starts, ends;
  for (const DeviceBuffer &b : buffers.buffers) {
    sizes.push_back(b.slice.size);
    starts.push_back(b.slice.start);
    ends.push_back(b.slice.end);
  }
  Packing packing = pack(buffers, alignment);

  // The problem and its solution, reified for tests and the plan file.
  OpBuilder b(&body, body.begin());
  schedule::PackOp::create(
      b, step->getLoc(), b.getI64IntegerAttr(alignment),
      b.getDenseI64ArrayAttr(sizes), b.getDenseI64ArrayAttr(starts),
      b.getDenseI64ArrayAttr(ends), b.getDenseI64ArrayAttr(packing.offsets),
      b.getI64IntegerAttr(packing.arenaSize));

  StringAttr offsetsName = b.getStringAttr(schedule::kOffsetsAttrName);
  for (Operation &op : body) {
    if (op.getNumResults() == 0)
      continue;
    SmallVector<int64_t> offsets;
    bool any = false;
    for (Value r : op.getResults()) {
      auto it = buffers.bufferOf.find(r);
      offsets.push_back(
          it == buffers.bufferOf.end() ? -1 : packing.offsets[it->second]);
      any |= it != buffers.bufferOf.end();
    }
    if (any)
      op.setAttr(offsetsName, b.getDenseI64ArrayAttr(offsets));
  }
  for (auto [i, buffer] : llvm::enumerate(buffers.buffers))
    if (!buffer.value)
      buffer.owner->setAttr(
          schedule::kWorkspaceAttrName,
          b.getDenseI64ArrayAttr({packing.offsets[i], buffer.slice.size}));

  declareResource(module, "device_arena", schedule::Residency::device,
                  packing.arenaSize, "device arena");
  return packing.arenaSize;
}

namespace {

struct PlanMemoryPass : megaslide::impl::PlanMemoryPassBase<PlanMemoryPass> {
  using PlanMemoryPassBase::PlanMemoryPassBase;
  void runOnOperation() override {
    if (failed(planMemory(getOperation(), alignment)))
      signalPassFailure();
  }
};

} // namespace
