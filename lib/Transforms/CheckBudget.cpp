//===- CheckBudget.cpp - Device and host budgets --------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Pipelines/PipelineOptions.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Analysis/DeviceBuffers.h"
#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Support/Units.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/Diagnostics.h"

#include <map>

namespace megaslide {
#define GEN_PASS_DEF_CHECKBUDGETPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-check-budget"

using namespace mlir;
using namespace megaslide;

namespace {

/// Names the buffers live at the device peak, largest first, and says what
/// would shrink them; `budget` is the arena's (arenaBudget).
void explainDevicePeak(func::FuncOp step, ModuleOp module, int64_t arena,
                       uint64_t gpu, uint64_t reserve, uint64_t budget) {
  DeviceBuffers buffers = collectDeviceBuffers(step);
  DevicePeak peak = findDevicePeak(buffers);
  const std::vector<const DeviceBuffer *> &atPeak = peak.buffers;
  const std::map<std::string, int64_t> &byCategory = peak.byCategory;
  Operation *culprit = atPeak.empty() ? step.getOperation() : atPeak[0]->owner;
  InFlightDiagnostic diag = culprit->emitError()
                            << "device memory plan needs " << formatBytes(arena)
                            << " at its peak but the GPU budget of "
                            << formatBytes(gpu) << " leaves "
                            << formatBytes(budget)
                            << " after the runtime reserve of "
                            << formatBytes(reserve);
  std::string categories;
  for (const auto &[name, bytes] : byCategory)
    categories +=
        (categories.empty() ? "" : ", ") + name + " " + formatBytes(bytes);
  diag.attachNote() << "live at the peak: " << categories;
  for (const DeviceBuffer *b : llvm::ArrayRef(atPeak).take_front(5))
    diag.attachNote(b->owner->getLoc())
        << "largest consumer: " << formatBytes(b->slice.size) << " "
        << b->describe();
  // What would make it fit: activations, checkpoints and the arena's
  // fragmentation scale with the token count; weights and gradients do not.
  int64_t fixed = 0;
  for (const auto &[name, bytes] : byCategory)
    if (name != "activations" && name != "checkpoints" &&
        name != "attention workspace")
      fixed += bytes;
  double tokenFraction =
      arena > fixed ? (double(budget) - double(fixed)) / double(arena - fixed)
                    : 0;
  std::string advice;
  auto policies = module->getAttrOfType<ArrayAttr>(kActivationPolicyAttr);
  // Without a recorded policy every activation is kept.
  auto anyPolicy = [&](StringRef name) {
    return !policies ? name == "keep"
                     : llvm::any_of(policies, [&](Attribute a) {
                         return cast<StringAttr>(a).getValue() == name;
                       });
  };
  if (anyPolicy("keep"))
    advice += "recompute blocks from checkpoints instead of keeping their "
              "activations (--activation-policy auto); ";
  else if (anyPolicy("recompute"))
    advice += "offload activation checkpoints to the host "
              "(--activation-policy offload); ";
  if (tokenFraction > 0)
    advice += llvm::formatv("activations and checkpoints scale with the "
                            "tokens: at most about {0:P0} of them (fewer "
                            "frames or a smaller resolution) could fit",
                            std::min(tokenFraction, 1.0))
                  .str();
  else
    advice += "weights and gradients in flight alone exceed the budget: use "
              "fewer weight buffers (--buffers 1) or a GPU with more memory";
  diag.attachNote() << "to fit: " << advice;
}

struct CheckBudgetPass : megaslide::impl::CheckBudgetPassBase<CheckBudgetPass> {
  CheckBudgetPass() = default;
  CheckBudgetPass(const CheckBudgetPass &other) : CheckBudgetPassBase(other) {}

  PipelineOption<&PlanningOptions::gpuMemory> gpuMemory{*this};
  PipelineOption<&PlanningOptions::gpuReserve> gpuReserve{*this};
  PipelineOption<&PlanningOptions::hostMemory> hostMemory{*this};

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();
    uint64_t host = hostMemory.bytes();
    uint64_t budget = arenaBudget(gpuMemory, gpuReserve);
    auto arena = module.lookupSymbol<schedule::ResourceOp>("device_arena");
    if (!arena) {
      module.emitError() << "no device arena: run megaslide-plan-memory first";
      return signalPassFailure();
    }

    bool fits = true;
    if (static_cast<uint64_t>(arena.getSize()) > budget) {
      explainDevicePeak(*step, module, arena.getSize(), gpuMemory.bytes(),
                        gpuReserve.bytes(), budget);
      fits = false;
    }

    // Host: persistent state plus every host or pinned resource.
    std::vector<std::pair<std::string, uint64_t>> hostByCategory =
        hostMemoryByCategory(module);
    uint64_t hostTotal = 0;
    for (const auto &entry : hostByCategory)
      hostTotal += entry.second;
    if (hostTotal > host) {
      InFlightDiagnostic diag = module.emitError() << "host memory plan needs "
                                                   << formatBytes(hostTotal)
                                                   << " but the host budget is "
                                                   << formatBytes(host);
      if (jobSizeOf(module).ranks() > 1)
        diag << " (per node: " << jobSizeOf(module).gpusPerNode
             << " ranks' shares and the OS allowance)";
      for (const auto &[name, bytes] : hostByCategory)
        diag.attachNote() << name << ": " << formatBytes(bytes);
      // The training recipe's buffers (megaslide-defer-updates) are
      // choices too.
      auto resourceBytes = [&](StringRef name) -> uint64_t {
        auto r = module.lookupSymbol<schedule::ResourceOp>(name);
        return r ? r.getSize() : 0;
      };
      uint64_t retained = resourceBytes(kRetainedGradientsResource);
      uint64_t ema = resourceBytes(kEmaResource);
      auto emaPolicy = module->getAttrOfType<StringAttr>(kEmaAttr);
      if (retained && jobSizeOf(module).ranks() == 1)
        diag.attachNote() << "to fit: --update streaming frees the "
                          << formatBytes(retained)
                          << " of retained gradients (it clips with the "
                             "previous step's global norm, an approximation, "
                             "and stops at a non-finite gradient)";
      if (ema && emaPolicy && emaPolicy.getValue() == "f32")
        diag.attachNote() << "to fit: --ema-dtype bf16 frees "
                          << formatBytes(ema / 2) << " of the EMA";
      // A job shards the state over its ranks: more nodes hold less each.
      JobSize job = jobSizeOf(module);
      if (job.ranks() > 1) {
        int64_t nodes = nodesToFitHost(module, host);
        if (nodes > job.nodes)
          diag.attachNote()
              << "to fit: --nodes " << nodes << " (of " << job.gpusPerNode
              << " GPUs each) shards the host state so that "
                 "each node's host-mem holds its share";
      }
      auto policy = module->getAttrOfType<StringAttr>(kHostStatePolicyAttr);
      schedule::HostStatePolicy smallest = schedule::HostStatePolicy::bf16_moments;
      if (policy && policy.getValue() == schedule::stringifyEnum(smallest))
        diag.attachNote() << "to fit: use a host with more memory or a "
                             "smaller model";
      else
        diag.attachNote() << "to fit: keep AdamW moments in bf16 "
                             "(--host-state-policy "
                          << schedule::stringifyEnum(smallest) << ", "
                          << schedule::bytesPerParam(smallest)
                          << " B/param), or use a host with more memory";
      fits = false;
    }
    if (!fits)
      return signalPassFailure();

    // The exporter carries the budget into the execution plan, whose
    // device guard (the cuda backend) checks the arena against it before it
    // allocates (docs/ExecutionPlan.md).
    Block &body = step->getBody().front();
    for (auto check :
         llvm::make_early_inc_range(body.getOps<schedule::BudgetCheckOp>()))
      check.erase();
    OpBuilder b(&body, body.begin());
    schedule::BudgetCheckOp::create(b, step->getLoc(), "device_arena",
                                    static_cast<int64_t>(budget));
  }
};

} // namespace
