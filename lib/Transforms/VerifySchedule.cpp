//===- VerifySchedule.cpp - Gates between planning phases -----------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/CostModel.h"

namespace megaslide {
#define GEN_PASS_DEF_VERIFYSCHEDULEPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-verify-schedule"

using namespace mlir;
using namespace megaslide;

namespace {

bool isBookkeeping(Operation *op) {
  return isa<schedule::PackOp, schedule::BudgetCheckOp, schedule::RecordOp,
             schedule::WaitOp, schedule::JoinOp>(op);
}

LogicalResult verifyTransfers(func::FuncOp step) {
  WalkResult r = step.walk([](Operation *op) {
    if (isa<graph::LoadOp, graph::StoreOp, graph::AdamWOp>(op)) {
      op->emitOpError() << "reads or writes host state inside the step; "
                           "run megaslide-insert-transfers";
      return WalkResult::interrupt();
    }
    return WalkResult::advance();
  });
  return failure(r.wasInterrupted());
}

LogicalResult verifyStreams(func::FuncOp step) {
  for (Operation &op : step.getBody().front())
    if (!isBookkeeping(&op) && !op.hasAttr(schedule::kStreamAttrName))
      return op.emitOpError() << "has no stream; run "
                                 "megaslide-schedule-overlap";
  return success();
}

/// A job's collectives run on the comm stream, and every fetch of its
/// shard is all-gathered before anything reads it.
LogicalResult verifyCollectives(func::FuncOp step) {
  for (Operation &op : step.getBody().front()) {
    if (isa<schedule::AllGatherOp, schedule::ReduceScatterOp>(op) &&
        schedule::getStream(&op) != exec::Stream::Comm)
      return op.emitOpError() << "is a collective off the comm stream";
    auto fetch = dyn_cast<schedule::FetchOp>(op);
    if (!fetch || !fetch.getRanks())
      continue;
    for (Operation *user : fetch->getUsers()) {
      auto gather = dyn_cast<schedule::AllGatherOp>(user);
      if (!gather || gather.getRanks() != *fetch.getRanks())
        return user->emitOpError()
               << "reads a fetched shard before its all_gather over "
               << *fetch.getRanks() << " ranks";
    }
  }
  return success();
}

LogicalResult verifyMemory(ModuleOp module, func::FuncOp step) {
  auto arena = module.lookupSymbol<schedule::ResourceOp>("device_arena");
  if (!arena)
    return module.emitError() << "has no device arena; run "
                                 "megaslide-plan-memory";
  for (Operation &op : step.getBody().front()) {
    std::optional<exec::Stream> stream = schedule::getStream(&op);
    if (!stream ||
        (*stream != exec::Stream::Compute &&
         *stream != exec::Stream::HostToDevice &&
         *stream != exec::Stream::Comm) ||
        op.getNumResults() == 0)
      continue;
    auto offsets = op.getAttrOfType<DenseI64ArrayAttr>(schedule::kOffsetsAttrName);
    if (!offsets || offsets.size() != static_cast<int64_t>(op.getNumResults()))
      return op.emitOpError() << "produces device values without offsets";
    for (auto [offset, result] :
         llvm::zip(offsets.asArrayRef(), op.getResults()))
      if (offset < 0 ||
          offset + static_cast<int64_t>(tensorBytes(result.getType())) >
              static_cast<int64_t>(arena.getSize()))
        return op.emitOpError()
               << "result at offset " << offset << " does not fit the arena of "
               << arena.getSize() << " bytes";
  }
  return success();
}

struct VerifySchedulePass
    : megaslide::impl::VerifySchedulePassBase<VerifySchedulePass> {
  using VerifySchedulePassBase::VerifySchedulePassBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();
    LogicalResult ok = failure();
    if (phase == "transfers")
      ok = verifyTransfers(*step);
    else if (phase == "streams")
      ok = success(succeeded(verifyTransfers(*step)) &&
                   succeeded(verifyStreams(*step)) &&
                   succeeded(verifyCollectives(*step)));
    else if (phase == "memory")
      ok = success(succeeded(verifyTransfers(*step)) &&
                   succeeded(verifyStreams(*step)) &&
                   succeeded(verifyCollectives(*step)) &&
                   succeeded(verifyMemory(module, *step)));
    else
      module.emitError() << "option 'phase': unknown phase '" << phase
                         << "'; use transfers, streams or memory";
    if (failed(ok))
      signalPassFailure();
  }
};

} // namespace
