//===- OpVocabularyTest.cpp - Ops.def against the dialects ----------------===//
//
// include/megaslide/runtime/plan/Ops.def, the runtime's list of the ops a
// plan carries, is generated from the ops' definitions (megaslide-tblgen
// -gen-plan-ops, dialects/PlanOp.td), and
// test/Docs/reference_current.test fails while the committed copy differs
// from the build's. So every registered op is in it unless its definition
// says why plans never carry it, by construction, and no list of those ops
// is kept here. Here the compiled copy is checked against the registered
// dialects without lit: each of its ops is a registered `megaslide.<name>`
// (graph) or `msched.<name>` (schedule) op, and planOpOf, which the exporter
// and the cost model use, maps each IR op to its plan op. The backends are
// checked against Ops.def in the runtime's tests (a cpu kernel for every
// graph op: ExecPlanTest; a cuda lowering for every graph op but the 3D-DSA
// ones: CudaBackendTest), so a new op fails there until every backend runs
// it (docs/AddingAnOp.md).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Analysis/CostModel.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/MLIRContext.h"

#include "gtest/gtest.h"

#include <set>
#include <string>

using namespace mlir;
using namespace megaslide;

namespace {

/// The IR name of a plan op.
std::string irName(exec::OpCode op) {
  return std::string(exec::isScheduleOp(op) ? "msched." : "megaslide.") +
         exec::opName(op);
}

std::set<std::string> dialectOps(MLIRContext &context) {
  std::set<std::string> names;
  for (RegisteredOperationName name : context.getRegisteredOperations()) {
    StringRef dialect = name.getDialectNamespace();
    if (dialect == "megaslide" || dialect == "msched")
      names.insert(name.getStringRef().str());
  }
  return names;
}

MLIRContext &context() {
  static MLIRContext *ctx = [] {
    auto *c = new MLIRContext;
    c->loadDialect<graph::GraphDialect, schedule::ScheduleDialect,
                   func::FuncDialect>();
    return c;
  }();
  return *ctx;
}

} // namespace

TEST(OpVocabularyTest, EveryPlanOpIsRegisteredByItsDialect) {
  std::set<std::string> registered = dialectOps(context());
  for (exec::OpCode op : exec::kAllOpCodes) {
    EXPECT_TRUE(registered.count(irName(op)))
        << irName(op)
        << " is in include/megaslide/runtime/plan/Ops.def but no dialect "
           "registers it: rebuild and run scripts/update-docs.sh";
  }
}

TEST(OpVocabularyTest, PlanOpOfMapsEachIrOpToItsPlanOp) {
  std::set<std::string> inDef;
  for (exec::OpCode op : exec::kAllOpCodes)
    inDef.insert(irName(op));
  OpBuilder builder(&context());
  Location loc = builder.getUnknownLoc();
  std::set<std::string> names = dialectOps(context());
  names.insert("func.return");
  for (const std::string &name : names) {
    Operation *op = Operation::create(OperationState(loc, name));
    std::optional<exec::OpCode> code = planOpOf(op);
    EXPECT_EQ(code.has_value(), inDef.count(name) == 1) << name;
    if (code) {
      EXPECT_EQ(irName(*code), name);
    }
    op->destroy();
  }
}
