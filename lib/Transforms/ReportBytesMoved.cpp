//===- ReportBytesMoved.cpp - PCIe bytes per transformer block ------------===//
//
// A read-only reporting pass, and the worked example of
// docs/AddingAPass.md: it shows the parts every MegaSlide pass has (a
// TableGen entry, DEBUG_TYPE, options, remarks, a lit test) without
// planning anything.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Support/Units.h"

#include "llvm/Support/Debug.h"

#include <map>

namespace megaslide {
#define GEN_PASS_DEF_REPORTBYTESMOVEDPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-report-bytes-moved"

using namespace mlir;
using namespace megaslide;

namespace {

/// What one block (or everything outside the blocks) moves over PCIe.
struct Traffic {
  Operation *firstTransfer = nullptr; ///< where the remark points
  uint64_t hostToDeviceBytes = 0, deviceToHostBytes = 0;
  int64_t hostToDeviceCount = 0, deviceToHostCount = 0;
};

StringRef plural(int64_t count) {
  return count == 1 ? "transfer" : "transfers";
}

void emitReport(const Traffic &t, StringRef who) {
  t.firstTransfer->emitRemark()
      << who << " " << formatBytes(t.hostToDeviceBytes) << " host->device in "
      << t.hostToDeviceCount << " " << plural(t.hostToDeviceCount) << ", "
      << formatBytes(t.deviceToHostBytes) << " device->host in "
      << t.deviceToHostCount << " " << plural(t.deviceToHostCount);
}

struct ReportBytesMovedPass
    : megaslide::impl::ReportBytesMovedPassBase<ReportBytesMovedPass> {
  using ReportBytesMovedPassBase::ReportBytesMovedPassBase;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();

    // Before insert-transfers, host state is read in place and nothing
    // crosses PCIe explicitly: a report would say "0 B" and be wrong.
    WalkResult unscheduled = step->walk([](Operation *op) {
      if (!isa<graph::LoadOp, graph::StoreOp, graph::AdamWOp>(op))
        return WalkResult::advance();
      op->emitOpError() << "reads or writes host state inside the step; "
                           "run megaslide-insert-transfers before "
                           "megaslide-report-bytes-moved";
      return WalkResult::interrupt();
    });
    if (unscheduled.wasInterrupted())
      return signalPassFailure();

    // The cost model's accounting (result bytes of each transfer), so the
    // figures add up to the plan report's "Transfers per step".
    SymbolTableCollection symbols;
    std::map<int64_t, Traffic> blocks;
    Traffic outside;
    for (Operation &op : step->getBody().front()) {
      sim::CostKind kind = costKindOf(&op);
      bool toDevice =
          kind == sim::CostKind::Fetch || kind == sim::CostKind::HostToDevice;
      if (!toDevice && kind != sim::CostKind::DeviceToHost)
        continue;
      std::optional<int64_t> layer = getLayer(&op);
      Traffic &t = layer ? blocks[*layer] : outside;
      if (!t.firstTransfer)
        t.firstTransfer = &op;
      uint64_t bytes = costInputsOf(&op, symbols).bytes;
      LLVM_DEBUG(llvm::dbgs() << bytes << " B: " << op << "\n");
      if (toDevice) {
        t.hostToDeviceBytes += bytes;
        ++t.hostToDeviceCount;
        hostToDeviceBytes += bytes;
      } else {
        t.deviceToHostBytes += bytes;
        ++t.deviceToHostCount;
        deviceToHostBytes += bytes;
      }
      ++numTransfers;
    }

    auto large = [&](const Traffic &t) {
      return t.hostToDeviceBytes + t.deviceToHostBytes >= minBytes.bytes();
    };
    for (auto &[layer, t] : blocks)
      if (large(t))
        emitReport(t, ("block " + Twine(layer) + " moves").str());
    if (outside.firstTransfer && large(outside))
      emitReport(outside, "ops outside the blocks (embeddings, head, data "
                          "batch, loss) move");
    markAllAnalysesPreserved();
  }
};

} // namespace
