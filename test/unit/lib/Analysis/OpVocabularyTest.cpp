//===- OpVocabularyTest.cpp - Ops.def against the dialects ----------------===//
//
// include/megaslide/runtime/plan/Ops.def is the runtime's list of the ops a plan carries.
// Here it is checked against the ops the graph and schedule dialects
// register: each of its ops is a registered `megaslide.<name>` (graph) or
// `msched.<name>` (schedule) op, and every registered op is either one of
// them or one that never reaches a plan (kNotInPlans). planOpOf, which the
// exporter and the cost model use, maps each IR op to its plan op. The
// backends are checked against Ops.def in the runtime's tests (a cpu kernel
// for every graph op: ExecPlanTest; a cuda lowering for every graph op but
// the 3D-DSA ones: CudaBackendTest), and sim::costKindOf is generated from
// its cost column, so a new op in a dialect fails here until it is in
// Ops.def, and there until every backend runs it (docs/AddingAnOp.md).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Analysis/CostModel.h"

#include "megaslide/Dialect/Graph/GraphOps.h"
#include "megaslide/Dialect/Schedule/ScheduleOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/MLIRContext.h"

#include "gtest/gtest.h"

#include <set>
#include <string>

using namespace mlir;
using namespace megaslide;

namespace {

/// Registered ops the exporter never writes as instructions: graph params
/// and host-state access (insert-transfers replaces load, store and adamw;
/// verify-schedule refuses any left), and the schedule ops that become the
/// plan's header, offsets and events, and launch, which no pass emits.
const std::set<std::string> kNotInPlans = {
    "megaslide.param", "megaslide.load",  "megaslide.store",
    "megaslide.adamw", "msched.resource", "msched.budget_check",
    "msched.pack",     "msched.launch",   "msched.join"};

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
           "registers it";
    EXPECT_FALSE(kNotInPlans.count(irName(op))) << irName(op);
  }
}

TEST(OpVocabularyTest, EveryRegisteredOpIsInOpsDefOrNeverInAPlan) {
  std::set<std::string> inDef;
  for (exec::OpCode op : exec::kAllOpCodes)
    inDef.insert(irName(op));
  std::set<std::string> registered = dialectOps(context());
  for (const std::string &name : registered)
    EXPECT_TRUE(inDef.count(name) || kNotInPlans.count(name))
        << name
        << " is registered but not in include/megaslide/runtime/plan/Ops.def: add it "
           "there and to every backend (docs/AddingAnOp.md)";
  for (const std::string &name : kNotInPlans)
    EXPECT_TRUE(registered.count(name)) << name << " is no longer registered";
}

TEST(OpVocabularyTest, PlanOpOfMapsEachIrOpToItsPlanOp) {
  OpBuilder builder(&context());
  Location loc = builder.getUnknownLoc();
  std::set<std::string> names = dialectOps(context());
  names.insert("func.return");
  for (const std::string &name : names) {
    Operation *op = Operation::create(OperationState(loc, name));
    std::optional<exec::OpCode> code = planOpOf(op);
    bool carried = !kNotInPlans.count(name) && name != "func.return";
    EXPECT_EQ(code.has_value(), carried) << name;
    if (code) {
      EXPECT_EQ(irName(*code), name);
    }
    op->destroy();
  }
}
