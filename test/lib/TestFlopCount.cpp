//===- TestFlopCount.cpp - Prints FlopCountOpInterface results ------------===//
//
// A remark per counted op, so lit can pin FLOP formulas op by op.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassRegistry.h"

using namespace mlir;
using namespace megaslide::graph;

namespace {

struct TestFlopCountPass
    : PassWrapper<TestFlopCountPass, OperationPass<ModuleOp>> {
  MLIR_DEFINE_EXPLICIT_INTERNAL_INLINE_TYPE_ID(TestFlopCountPass)

  StringRef getArgument() const final { return "test-megaslide-flop-count"; }
  StringRef getDescription() const final {
    return "Emits a remark with the FLOPs of every counted op";
  }
  void runOnOperation() override {
    getOperation().walk([](FlopCountOpInterface op) {
      FlopCount c = op.getFlopCount();
      op->emitRemark() << "matmul " << c.matmul << " attention " << c.attention
                       << " other " << c.other
                       << (op->hasTrait<BackwardOp>() ? " backward" : "");
    });
  }
};

} // namespace

namespace megaslide::test {
void registerTestPrintDeviceBuffersPass();

void registerTestPasses() {
  PassRegistration<TestFlopCountPass>();
  registerTestPrintDeviceBuffersPass();
}
} // namespace megaslide::test
