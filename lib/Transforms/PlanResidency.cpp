//===- PlanResidency.cpp - Host-state policy and host resources -----------===//
//
// Persistent state lives on the host; this pass applies the chosen policy
// to its declarations and declares the host buffers that are not model
// tensors. Device residency of values follows in insert-transfers.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Pipelines/PipelineOptions.h"

#include "mlir/IR/Builders.h"

namespace megaslide {
#define GEN_PASS_DEF_PLANRESIDENCYPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-plan-residency"

using namespace mlir;
using namespace megaslide;
using namespace megaslide::graph;

namespace {

/// Moments in bf16: the declarations, their loads and the AdamW results
/// change type together.
void narrowMoments(ModuleOp module) {
  Type bf16 = BFloat16Type::get(module.getContext());
  DenseSet<StringRef> moments;
  for (auto param : module.getOps<ParamOp>())
    if (param.getRole() == ParamRole::moment) {
      param.setType(param.getTensorType().clone(bf16));
      moments.insert(param.getSymName());
    }
  module.walk([&](LoadOp load) {
    if (!moments.contains(load.getParam()))
      return;
    load.getResult().setType(load.getType().clone(bf16));
    for (Operation *user : load->getUsers())
      if (auto adamw = dyn_cast<AdamWOp>(user)) {
        adamw.getNewM().setType(adamw.getM().getType());
        adamw.getNewV().setType(adamw.getV().getType());
      }
  });
}

/// Declares `<name>.bf16`, a persistent bf16 copy of every trainable
/// parameter, refreshed by the host optimizer and fetched instead of a
/// cast of the master.
void addPersistentCopies(ModuleOp module) {
  Type bf16 = BFloat16Type::get(module.getContext());
  for (auto param : llvm::make_early_inc_range(module.getOps<ParamOp>())) {
    if (param.getRole() != ParamRole::master)
      continue;
    OpBuilder b(param);
    b.setInsertionPointAfter(param);
    ParamOp::create(b, param.getLoc(), (param.getSymName() + ".bf16").str(),
                    ParamRole::weight, param.getGroup(), param.getLayerAttr(),
                    FlatSymbolRefAttr::get(param.getSymNameAttr()),
                    param.getTensorType().clone(bf16));
  }
}

/// Whether compute reads a bf16 working copy of some master: steps built
/// with f32 compute have none, so a persistent bf16 copy would be dead
/// weight in host memory.
bool hasBf16WorkingCopies(ModuleOp module) {
  SymbolTable symbols(module);
  WalkResult found = module.walk([&](CastOp cast) {
    auto load = cast.getInput().getDefiningOp<LoadOp>();
    auto param = load ? symbols.lookup<ParamOp>(load.getParam()) : ParamOp();
    if (param && param.getRole() == ParamRole::master &&
        getElementTypeOrSelf(cast.getType()).isBF16())
      return WalkResult::interrupt();
    return WalkResult::advance();
  });
  return found.wasInterrupted();
}

struct PlanResidencyPass
    : megaslide::impl::PlanResidencyPassBase<PlanResidencyPass> {
  PlanResidencyPass() = default;
  PlanResidencyPass(const PlanResidencyPass &other)
      : PlanResidencyPassBase(other) {}

  PipelineOption<&PlanningOptions::hostStatePolicy> hostStatePolicy{*this};
  PipelineOption<&PlanningOptions::osAllowance> osAllowance{*this};
  PipelineOption<&PlanningOptions::hostMemory> hostMemory{*this};
  PipelineOption<&PlanningOptions::experts> experts{*this};
  PipelineOption<&PlanningOptions::gpusPerNode> gpusPerNode{*this};
  PipelineOption<&PlanningOptions::nodes> nodes{*this};

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();
    if (module->hasAttr(kHostStatePolicyAttr)) {
      module.emitError() << "residency is already planned ("
                         << module->getAttr(kHostStatePolicyAttr) << ")";
      return signalPassFailure();
    }
    switch (hostStatePolicy) {
    case schedule::HostStatePolicy::bf16_moments:
      narrowMoments(module);
      break;
    case schedule::HostStatePolicy::persistent_bf16:
      if (!hasBf16WorkingCopies(module)) {
        module.emitError()
            << "option 'host-state-policy': 'persistent-bf16' keeps a bf16 "
               "working copy of every weight, but this step computes in "
               "f32 and never reads one; use master-moments or bf16-moments";
        return signalPassFailure();
      }
      addPersistentCopies(module);
      break;
    case schedule::HostStatePolicy::int8_moments:
    case schedule::HostStatePolicy::factored_moments:
      // The declarations keep their fp32 type: the runtime stores the
      // moments as the policy says (schedule::momentBytes), and the host
      // accounting counts those bytes (hostParamBytes).
      if (int64_t ranks = gpusPerNode * nodes;
          ranks > 1 && schedule::oneRankOnly(hostStatePolicy.getValue())) {
        module.emitError()
            << "option 'host-state-policy': '"
            << schedule::stringifyEnum(hostStatePolicy.getValue())
            << "' is for a job of one rank (its block scales and "
               "row/column statistics are not sharded); this job has "
            << ranks << "; use master-moments or bf16-moments";
        return signalPassFailure();
      }
      break;
    case schedule::HostStatePolicy::master_moments:
      break;
    }
    if (experts < 1 || experts > 2) {
      module.emitError() << "option 'experts' must be 1 or 2 (Wan 2.2's two "
                            "experts), got "
                         << experts;
      return signalPassFailure();
    }
    OpBuilder b(module.getContext());
    if (experts > 1)
      module->setAttr(kExpertsAttr, b.getI64IntegerAttr(experts));
    module->setAttr(kHostStatePolicyAttr,
                    b.getStringAttr(schedule::stringifyEnum(hostStatePolicy)));

    // The data batch is staged in pinned memory; the allowance covers the
    // OS, the CUDA driver and the runtime's own heap.
    uint64_t batchBytes = 0;
    for (Type t : step->getArgumentTypes())
      batchBytes += tensorBytes(t);
    declareResource(module, "data_batch", schedule::Residency::pinned, batchBytes,
                    "data batch");
    declareResource(module, kOsAllowanceResource, schedule::Residency::host,
                    osAllowance.bytesOr(osAllowanceFor(hostMemory.bytes())),
                    "OS and runtime allowance");
  }
};

} // namespace
