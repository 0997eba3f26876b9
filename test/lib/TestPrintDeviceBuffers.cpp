//===- TestPrintDeviceBuffers.cpp - Prints buffers, lifetimes, offsets ----===//
//
// One line per device buffer of @train_step: what it is, its size, live
// range and arena offset (-1 before plan-memory), so lit can pin the
// buffers and their packing (test/Analysis/device_buffers.mlir).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Analysis/DeviceBuffers.h"

#include "dialects/Schedule/ScheduleOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace megaslide;

namespace {

struct TestPrintDeviceBuffersPass
    : PassWrapper<TestPrintDeviceBuffersPass, OperationPass<ModuleOp>> {
  MLIR_DEFINE_EXPLICIT_INTERNAL_INLINE_TYPE_ID(TestPrintDeviceBuffersPass)

  StringRef getArgument() const final {
    return "test-megaslide-print-device-buffers";
  }
  StringRef getDescription() const final {
    return "Prints every device buffer with its live range and offset";
  }
  void runOnOperation() override {
    auto step = getOperation().lookupSymbol<func::FuncOp>("train_step");
    if (!step) {
      getOperation().emitError() << "no @train_step";
      return signalPassFailure();
    }
    DeviceBuffers buffers = collectDeviceBuffers(step);
    llvm::raw_ostream &os = llvm::outs();
    for (auto [i, b] : llvm::enumerate(buffers.buffers)) {
      int64_t offset = -1;
      if (b.value) {
        if (auto offsets = b.owner->getAttrOfType<DenseI64ArrayAttr>(
                schedule::kOffsetsAttrName))
          offset = offsets[cast<OpResult>(b.value).getResultNumber()];
      } else if (auto ws = b.owner->getAttrOfType<DenseI64ArrayAttr>(
                     schedule::kWorkspaceAttrName)) {
        offset = ws[0];
      }
      os << "buffer " << i << ": " << b.describe() << " size " << b.slice.size
         << " live [" << b.slice.start << ", " << b.slice.end << "] offset "
         << offset << "\n";
    }
    if (auto arena =
            getOperation().lookupSymbol<schedule::ResourceOp>("device_arena"))
      os << "arena " << arena.getSize() << "\n";
  }
};

} // namespace

namespace megaslide::test {
void registerTestPrintDeviceBuffersPass() {
  PassRegistration<TestPrintDeviceBuffersPass>();
}
} // namespace megaslide::test
