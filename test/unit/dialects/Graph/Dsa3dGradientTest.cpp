//===- Dsa3dAutodiffTest.cpp - Reverse mode through megaslide.dsa3d -------===//
//
// The forward returns its softmax log-sum-exp beside the output; autodiff
// must hand both to dsa3d_grad, and must refuse a loss that depends on the
// log-sum-exp (dsa3d_grad has no term for it).
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphAutodiff.h"
#include "dialects/Graph/GraphOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"

#include "gtest/gtest.h"

using namespace mlir;
using namespace megaslide;

namespace {

/// One dsa3d and two losses: one on its output, one on its log-sum-exp.
constexpr const char *kModule = R"mlir(
func.func @step(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>,
                %v: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                %x0: tensor<1x32x4x16xbf16>, %noise: tensor<1x32x4x16xbf16>,
                %lx0: tensor<1x4x32xf32>, %lnoise: tensor<1x4x32xf32>) {
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %on_output = megaslide.flow_matching_loss %o, %x0, %noise
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<f32>
  %on_lse = megaslide.flow_matching_loss %lse, %lx0, %lnoise
      : (tensor<1x4x32xf32>, tensor<1x4x32xf32>, tensor<1x4x32xf32>) -> tensor<f32>
  return
}
)mlir";

struct Dsa3dAutodiff : ::testing::Test {
  void SetUp() override {
    context.loadDialect<func::FuncDialect, graph::GraphDialect>();
    module = parseSourceString<ModuleOp>(kModule, &context);
    ASSERT_TRUE(module);
    func = cast<func::FuncOp>(module->getBody()->front());
    for (Operation &op : func.getBody().front()) {
      if (auto d = dyn_cast<graph::Dsa3dOp>(op))
        dsa = d;
      else if (auto loss = dyn_cast<graph::FlowMatchingLossOp>(op))
        losses.push_back(loss.getLoss());
    }
    ASSERT_TRUE(dsa);
    ASSERT_EQ(losses.size(), 2u);
  }

  /// Differentiates `loss` with respect to q, k and v before the return.
  FailureOr<SmallVector<Value>> backward(Value loss) {
    OpBuilder b(func.getBody().front().getTerminator());
    return emitBackward(b, loss,
                        {dsa.getQuery(), dsa.getKey(), dsa.getValue()});
  }

  MLIRContext context;
  OwningOpRef<ModuleOp> module;
  func::FuncOp func;
  graph::Dsa3dOp dsa;
  SmallVector<Value> losses;
};

TEST_F(Dsa3dAutodiff, GradReadsTheForwardsOutputAndLogSumExp) {
  FailureOr<SmallVector<Value>> grads = backward(losses[0]);
  ASSERT_TRUE(succeeded(grads));
  auto grad = (*grads)[0].getDefiningOp<graph::Dsa3dGradOp>();
  ASSERT_TRUE(grad);
  EXPECT_EQ(grad.getOutput(), dsa.getResult());
  EXPECT_EQ(grad.getLse(), dsa.getLse());
  EXPECT_EQ(grad.getOffsets(), dsa.getOffsets());
  EXPECT_EQ((*grads)[1], grad.getKeyGrad());
  EXPECT_EQ((*grads)[2], grad.getValueGrad());
  EXPECT_TRUE(succeeded(verify(*module)));
}

TEST_F(Dsa3dAutodiff, RejectsALossThroughTheLogSumExp) {
  std::string message;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &d) {
    message = d.str();
    return success();
  });
  EXPECT_TRUE(failed(backward(losses[1])));
  EXPECT_NE(message.find("has no gradient through its 'lse' result"),
            std::string::npos)
      << message;
}

} // namespace
