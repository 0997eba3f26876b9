//===- CheckBudget.cpp - Device and host budgets --------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"
#include "megaslide/runtime/host/NvmeTier.h"

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

uint64_t hostTotalOf(ModuleOp module) {
  uint64_t total = 0;
  for (const auto &entry : hostMemoryByCategory(module))
    total += entry.second;
  return total;
}

/// Spills host state to the NVMe tier when it does not fit `host`: of the
/// sets of tierable roles (exec::kTierRoles), the one that fits moving the
/// fewest bytes per step (each tiered byte is read and written once per
/// optimizer step), recorded as kHostTierAttr. The window holds at least
/// two parameters' tiered state: one read ahead while one is written
/// back. Returns whether one fits; none is recorded when none does.
bool chooseHostTier(ModuleOp module, uint64_t host, uint64_t minWindow,
                    int64_t drives) {
  std::vector<std::pair<uint64_t, std::vector<std::string>>> sets;
  size_t numRoles = std::size(exec::kTierRoles);
  for (size_t mask = 1; mask < (size_t(1) << numRoles); ++mask) {
    std::vector<std::string> roles;
    uint64_t moved = 0;
    bool empty = false;
    for (size_t i = 0; i < numRoles; ++i)
      if (mask & (size_t(1) << i)) {
        uint64_t bytes = tierRoleBytesPerRank(module, exec::kTierRoles[i]);
        empty |= bytes == 0;
        roles.push_back(exec::kTierRoles[i]);
        moved += bytes;
      }
    if (!empty)
      sets.push_back({moved, std::move(roles)});
  }
  llvm::stable_sort(sets, [](auto &a, auto &b) { return a.first < b.first; });
  Builder b(module.getContext());
  for (const auto &[moved, roles] : sets) {
    // The runtime's tier takes no window below its smallest.
    uint64_t window =
        std::max({minWindow, 2 * largestTierParamBytes(module, roles),
                  host::kMinTierWindowBytes});
    SmallVector<Attribute> names;
    for (const std::string &role : roles)
      names.push_back(b.getStringAttr(role));
    module->setAttr(
        kHostTierAttr,
        b.getDictionaryAttr(
            {b.getNamedAttr("roles", b.getArrayAttr(names)),
             b.getNamedAttr("drives", b.getI64IntegerAttr(drives)),
             b.getNamedAttr("window_bytes",
                            b.getI64IntegerAttr(int64_t(window)))}));
    if (hostTotalOf(module) <= host)
      return true;
  }
  module->removeAttr(kHostTierAttr);
  return false;
}

struct CheckBudgetPass : megaslide::impl::CheckBudgetPassBase<CheckBudgetPass> {
  CheckBudgetPass() = default;
  CheckBudgetPass(const CheckBudgetPass &other) : CheckBudgetPassBase(other) {}

  PipelineOption<&PlanningOptions::gpuMemory> gpuMemory{*this};
  PipelineOption<&PlanningOptions::gpuReserve> gpuReserve{*this};
  PipelineOption<&PlanningOptions::hostMemory> hostMemory{*this};
  PipelineOption<&PlanningOptions::nvmeDrives> nvmeDrives{*this};
  PipelineOption<&PlanningOptions::nvmeWindow> nvmeWindow{*this};

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

    if (nvmeDrives < 0) {
      module.emitError() << "option 'nvme-drives' is "
                         << static_cast<int64_t>(nvmeDrives)
                         << "; it must be 0 (no NVMe tier) or more";
      return signalPassFailure();
    }
    // Host: persistent state plus every host or pinned resource, less
    // what the NVMe tier holds when the rest does not fit otherwise.
    module->removeAttr(kHostTierAttr);
    uint64_t untiered = hostTotalOf(module);
    bool tiered = untiered > host && nvmeDrives > 0 &&
                  chooseHostTier(module, host, nvmeWindow.bytes(), nvmeDrives);
    std::vector<std::pair<std::string, uint64_t>> hostByCategory =
        hostMemoryByCategory(module);
    uint64_t hostTotal = 0;
    for (const auto &entry : hostByCategory)
      hostTotal += entry.second;
    if (!tiered && hostTotal > host) {
      InFlightDiagnostic diag = module.emitError() << "host memory plan needs "
                                                   << formatBytes(hostTotal)
                                                   << " but the host budget is "
                                                   << formatBytes(host);
      if (jobSizeOf(module).ranks() > 1)
        diag << " (per node: " << jobSizeOf(module).gpusPerNode
             << " ranks' shares and the OS allowance)";
      for (const auto &[name, bytes] : hostByCategory)
        diag.attachNote() << name << ": " << formatBytes(bytes);
      if (nvmeDrives > 0)
        diag.attachNote() << "the NVMe tier ("
                          << static_cast<int64_t>(nvmeDrives)
                          << " drives) cannot make up the difference: "
                             "even with every tierable role on it the host "
                             "plan exceeds host-mem";
      // No change is suggested unchecked: planModel plans each again.
      diag.attachNote() << "megaslide-plan's report lists what would fit, "
                           "each change planned again (\"To fit\")";
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
