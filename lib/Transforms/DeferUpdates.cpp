//===- DeferUpdates.cpp - When the host AdamW updates ---------------------===//
//
// Streaming updates each parameter as its gradient lands, so no decision
// can wait for every gradient. Deferring keeps the gradients on the host
// until backward ends (global-norm clipping, skipping a non-finite step,
// accumulation) and moves each update before the next step's first fetch
// of the parameter, where it overlaps the next forward. This pass chooses
// between them by the host budget and marks the schedule; the runtime and
// the sim read the marks from the execution plan (docs/ExecutionPlan.md).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Pipelines/PipelineOptions.h"
#include "megaslide/Support/Units.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/StringSet.h"

namespace megaslide {
#define GEN_PASS_DEF_DEFERUPDATESPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-defer-updates"

using namespace mlir;
using namespace megaslide;

namespace {

/// Marks the deferred updates (exec::fetchesApplyingUpdates, the rule the
/// runtime marks plans by): each host_adamw, and the first fetch of each
/// parameter it updates.
LogicalResult markDeferred(ModuleOp module, func::FuncOp step) {
  llvm::StringMap<schedule::HostAdamWOp> updates;
  llvm::StringSet<> updated;
  for (auto update : step.getOps<schedule::HostAdamWOp>()) {
    update.setDeferred(true);
    updates[update.getParam()] = update;
    updated.insert(update.getParam());
  }
  SymbolTable symbols(module);
  SmallVector<schedule::FetchOp> fetches;
  SmallVector<StringRef> masters;
  for (auto fetch : step.getOps<schedule::FetchOp>()) {
    auto param = symbols.lookup<graph::ParamOp>(fetch.getParam());
    fetches.push_back(fetch);
    masters.push_back(
        param ? exec::updatedMaster(param.getSymName(),
                                    graph::stringifyParamRole(param.getRole()),
                                    param.getOf().value_or(""))
              : StringRef());
  }
  std::vector<bool> applies = exec::fetchesApplyingUpdates(masters, updated);
  llvm::StringSet<> applied;
  for (auto [fetch, master, marked] :
       llvm::zip_equal(fetches, masters, applies))
    if (marked) {
      fetch.setAppliesUpdate(true);
      applied.insert(master);
    }
  for (auto &[name, update] : updates)
    if (!applied.contains(name))
      return update.emitOpError()
             << "updates '" << name
             << "', which no fetch of the step reads; a deferred update "
                "runs before the parameter's first fetch";
  return success();
}

struct DeferUpdatesPass
    : megaslide::impl::DeferUpdatesPassBase<DeferUpdatesPass> {
  DeferUpdatesPass() = default;
  DeferUpdatesPass(const DeferUpdatesPass &other)
      : DeferUpdatesPassBase(other) {}

  PipelineOption<&PlanningOptions::update> update{*this};
  PipelineOption<&PlanningOptions::gradAccum> gradAccum{*this};
  PipelineOption<&PlanningOptions::ema> ema{*this};
  PipelineOption<&PlanningOptions::hostMemory> hostMemory{*this};

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();
    uint64_t host = hostMemory.bytes();
    if (module->hasAttr(kUpdateAttr)) {
      module.emitError() << "updates are already planned ("
                         << module->getAttr(kUpdateAttr) << ")";
      return signalPassFailure();
    }
    int64_t microBatches = gradAccum;
    if (microBatches < 1 || microBatches > exec::kMaxGradAccum) {
      module.emitError() << "option 'grad-accum': " << microBatches
                         << " micro-batches per optimizer step; give 1 to "
                         << exec::kMaxGradAccum;
      return signalPassFailure();
    }
    int64_t ranks = jobSizeOf(module).ranks();
    if (ranks > 1 && update == schedule::UpdatePolicy::streaming) {
      module.emitError()
          << "a job of " << ranks
          << " ranks sums every gradient over the ranks before one global "
             "decision (skip, clipping) that every rank makes alike: that "
             "needs the deferred update, but 'update' is 'streaming'; use "
             "--update deferred (or auto)";
      return signalPassFailure();
    }
    if (microBatches > 1 && update == schedule::UpdatePolicy::streaming) {
      module.emitError()
          << "option 'grad-accum': " << microBatches
          << " micro-batches per optimizer step sum their gradients in an "
             "fp32 host buffer and update once, after the last: that needs "
             "the deferred update, but 'update' is 'streaming'; use "
             "--update deferred (or auto)";
      return signalPassFailure();
    }

    RecipeBytes bytes = recipeBytes(module, microBatches, ema);
    uint64_t used = 0;
    for (const auto &entry : hostMemoryByCategory(module))
      used += entry.second;
    uint64_t free = host > used ? host - used : 0;
    // A job shards them over its ranks: a node holds its ranks' shares.
    uint64_t deferredNeeds =
        nodeShare(module, bytes.deferredBytes() + bytes.emaBytes);

    schedule::UpdatePolicy mode = update;
    OpBuilder b(module.getContext());
    if (mode == schedule::UpdatePolicy::automatic) {
      // Accumulation and a job have no streaming form: check-budget
      // reports it when it does not fit.
      bool defer = microBatches > 1 || ranks > 1 || deferredNeeds <= free;
      mode = defer ? schedule::UpdatePolicy::deferred
                   : schedule::UpdatePolicy::streaming;
      module->setAttr(kUpdateAutoAttr, b.getUnitAttr());
      if (!defer) {
        auto policy = module->getAttrOfType<StringAttr>(kHostStatePolicyAttr);
        std::optional<schedule::HostStatePolicy> p =
            policy ? schedule::symbolizeHostStatePolicy(policy.getValue())
                   : std::nullopt;
        module.emitRemark()
            << "update=auto streams the updates: deferring them needs "
            << formatBytes(deferredNeeds) << " of host memory ("
            << explainDeferredBytes(bytes) << ") but " << formatBytes(free)
            << " of host-mem is free; "
            << deferAdvice(
                   module, deferredNeeds - free, bytes,
                   p.value_or(schedule::HostStatePolicy::master_moments), ema);
      }
    }
    bool deferred = mode == schedule::UpdatePolicy::deferred;
    module->setAttr(kUpdateAttr,
                    b.getStringAttr(schedule::stringifyEnum(mode)));
    module->setAttr(kGradAccumAttr, b.getI64IntegerAttr(microBatches));
    module->setAttr(kEmaAttr, b.getStringAttr(schedule::stringifyEnum(ema)));

    if (deferred && bytes.accumulatorBytes)
      declareResource(module, kGradientAccumulatorResource,
                      schedule::Residency::host, bytes.accumulatorBytes,
                      "gradient accumulator (fp32)");
    else if (deferred && bytes.gradientBytes)
      declareResource(module, kRetainedGradientsResource,
                      schedule::Residency::host, bytes.gradientBytes,
                      "retained gradients");
    if (bytes.emaBytes)
      declareResource(
          module, kEmaResource, schedule::Residency::host, bytes.emaBytes,
          ("EMA weights (" + schedule::stringifyEnum(ema) + ")").str());
    if (deferred && failed(markDeferred(module, *step)))
      return signalPassFailure();
  }
};

} // namespace
