//===- PlanActivations.cpp - Keep, recompute or offload per block ---------===//
//
// Recompute clones a block's forward in front of its backward and points
// the backward at the clones, so the originals die within the forward;
// only the block input (the checkpoint) survives, on device or, for
// offload, on the host.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Transforms/Passes.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Pipelines/PipelineOptions.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "mlir/Pass/PassRegistry.h"
#include "llvm/ADT/SetVector.h"
#include "llvm/Support/FormatVariadic.h"

namespace megaslide {
#define GEN_PASS_DEF_PLANACTIVATIONSPASS
#include "megaslide/Transforms/Passes.h.inc"
} // namespace megaslide

#define DEBUG_TYPE "megaslide-plan-activations"

using namespace mlir;
using namespace megaslide;

namespace {

/// A block's forward ops, in program order, and where its backward starts.
struct BlockOps {
  SmallVector<Operation *> forward;
  Operation *firstBackward = nullptr;
};

/// The ops of blocks 0 to `layers` - 1, in one walk over the step. Applying
/// a policy to a block adds ops of that block only, so what this finds for
/// the other blocks stays true while the policies are applied in turn.
std::vector<BlockOps> collectBlocks(func::FuncOp step, Operation *loss,
                                    int64_t layers) {
  std::vector<BlockOps> blocks(layers);
  bool pastLoss = false;
  for (Operation &op : step.getBody().front()) {
    pastLoss |= &op == loss;
    std::optional<int64_t> layer = getLayer(&op);
    if (!layer || *layer < 0 || *layer >= layers)
      continue;
    BlockOps &block = blocks[*layer];
    if (!pastLoss)
      block.forward.push_back(&op);
    else if (!block.firstBackward)
      block.firstBackward = &op;
  }
  return blocks;
}

/// A block's checkpoint: the values from outside the block that only this
/// block reads (its input activation), unlike conditioning shared by all
/// blocks. Read from the IR as it is now, after the blocks before it.
llvm::SetVector<Value> findCheckpoints(ArrayRef<Operation *> forward,
                                       int64_t layer) {
  llvm::SetVector<Value> checkpoints;
  llvm::SmallPtrSet<Operation *, 32> forwardSet(forward.begin(), forward.end());
  for (Operation *op : forward)
    for (Value v : op->getOperands()) {
      Operation *def = v.getDefiningOp();
      if (!def || forwardSet.contains(def))
        continue;
      if (llvm::all_of(v.getUsers(),
                       [&](Operation *u) { return getLayer(u) == layer; }))
        checkpoints.insert(v);
    }
  return checkpoints;
}

/// Applies one block's policy; returns the offloaded checkpoint bytes.
uint64_t applyToBlock(func::FuncOp step, const BlockOps &block, int64_t layer,
                      ActivationPolicy policy) {
  ArrayRef<Operation *> forward = block.forward;
  Operation *firstBackward = block.firstBackward;
  if (forward.empty() || !firstBackward)
    return 0;
  llvm::SetVector<Value> checkpoints = findCheckpoints(forward, layer);
  // The ops of this block before the loss are its forward ops and the
  // copies out made below; every other op of the block is in its backward.
  // (Asking the block for op order instead would renumber the whole step
  // after each block's clones.)
  DenseMap<Operation *, unsigned> forwardIndex;
  for (auto [i, op] : llvm::enumerate(forward))
    forwardIndex[op] = i;
  llvm::SmallPtrSet<Operation *, 8> copiesOut;
  auto inBlockBackward = [&](Operation *user) {
    return getLayer(user) == layer && !forwardIndex.contains(user) &&
           !copiesOut.contains(user);
  };

  OpBuilder b(step.getContext());
  for (Value c : checkpoints)
    c.getDefiningOp()->setAttr(schedule::kCheckpointAttrName,
                               b.getI64IntegerAttr(layer));

  IRMapping map;
  uint64_t offloaded = 0;
  b.setInsertionPoint(firstBackward);
  if (policy == ActivationPolicy::offload) {
    for (Value c : checkpoints) {
      Operation *lastForwardUse = nullptr;
      for (Operation *u : c.getUsers()) {
        auto it = forwardIndex.find(u);
        if (it != forwardIndex.end() &&
            (!lastForwardUse ||
             forwardIndex.lookup(lastForwardUse) < it->second))
          lastForwardUse = u;
      }
      OpBuilder after(lastForwardUse->getBlock(),
                      ++Block::iterator(lastForwardUse));
      auto out = schedule::DeviceToHostOp::create(after, c.getLoc(), c,
                                                  /*ranks=*/nullptr);
      copiesOut.insert(out);
      auto back = schedule::HostToDeviceOp::create(b, c.getLoc(), out);
      for (Operation *op : {out.getOperation(), back.getOperation()})
        op->setAttr(graph::kLayerAttrName, b.getI64IntegerAttr(layer));
      c.replaceUsesWithIf(back, [&](OpOperand &use) {
        return inBlockBackward(use.getOwner());
      });
      map.map(c, back);
      offloaded += tensorBytes(c.getType());
    }
  }

  SmallVector<Operation *> clones;
  for (Operation *op : forward)
    clones.push_back(b.clone(*op, map));
  llvm::SmallPtrSet<Operation *, 32> cloneSet(clones.begin(), clones.end());
  for (Operation *op : forward)
    for (Value r : op->getResults())
      r.replaceUsesWithIf(map.lookup(r), [&](OpOperand &use) {
        return inBlockBackward(use.getOwner()) &&
               !cloneSet.contains(use.getOwner());
      });
  // Clones the backward does not need (e.g. the block output) go away.
  for (Operation *clone : llvm::reverse(clones)) {
    if (clone->use_empty())
      clone->erase();
    else
      clone->setAttr(schedule::kRecomputeAttrName, b.getUnitAttr());
  }
  return offloaded;
}

} // namespace

LogicalResult
megaslide::applyActivationPolicies(ModuleOp module,
                                   ArrayRef<ActivationPolicy> policies) {
  FailureOr<func::FuncOp> step = getTrainStep(module);
  if (failed(step))
    return failure();
  Operation *loss = findLoss(*step);
  if (!loss)
    return step->emitError() << "the training step has no loss";
  uint64_t offloaded = 0;
  SmallVector<Attribute> names;
  OpBuilder b(module.getContext());
  std::vector<BlockOps> blocks = collectBlocks(*step, loss, policies.size());
  for (auto [layer, policy] : llvm::enumerate(policies)) {
    names.push_back(b.getStringAttr(schedule::stringifyEnum(policy)));
    if (policy != ActivationPolicy::keep)
      offloaded += applyToBlock(*step, blocks[layer], layer, policy);
  }
  module->setAttr(kActivationPolicyAttr, b.getArrayAttr(names));
  declareResource(module, "checkpoint_pool", schedule::Residency::host, offloaded,
                  "offloaded checkpoints");
  return success();
}

namespace {

/// The name of the trial pipeline in the registry (lib/Pipelines).
constexpr llvm::StringLiteral kTrialPipeline =
    "megaslide-activation-trial-pipeline";

struct PlanActivationsPass
    : megaslide::impl::PlanActivationsPassBase<PlanActivationsPass> {
  PlanActivationsPass() = default;
  explicit PlanActivationsPass(OpPassManager trials)
      : trials(std::move(trials)) {}
  PlanActivationsPass(const PlanActivationsPass &other)
      : PlanActivationsPassBase(other), trials(other.trials) {}

  PipelineOption<&PlanningOptions::activationPolicy> policy{*this};
  PipelineOption<&PlanningOptions::gpuMemory> gpuMemory{*this};
  PipelineOption<&PlanningOptions::gpuReserve> gpuReserve{*this};
  // Only for the trial pipeline looked up when the pass runs alone; in
  // megaslide-pipeline the trials get every option of the pipeline.
  PipelineOption<&PlanningOptions::prefetchDistance> prefetchDistance{*this};
  PipelineOption<&PlanningOptions::buffers> buffers{*this};

  /// The passes that plan a copy of the step once its policies are set:
  /// given by the pipeline, else the registered trial pipeline.
  std::optional<OpPassManager> trials;

  LogicalResult initialize(MLIRContext *) override {
    if (trials || policy != ActivationPolicy::automatic)
      return success();
    const PassPipelineInfo *info = PassPipelineInfo::lookup(kTrialPipeline);
    if (!info)
      return emitError(UnknownLoc::get(&getContext()))
             << "activation-policy auto needs the pipeline '" << kTrialPipeline
             << "' (megaslide::registerPipelines)";
    trials.emplace(ModuleOp::getOperationName());
    std::string options =
        llvm::formatv("prefetch-distance={0} buffers={1}",
                      prefetchDistance.getValue(), buffers.getValue())
            .str();
    return info->addToPipeline(*trials, options, [&](const Twine &message) {
      return emitError(UnknownLoc::get(&getContext())) << message;
    });
  }

  /// Device peak of the plan `policies` would give, on a copy.
  FailureOr<int64_t> tryPolicies(ArrayRef<ActivationPolicy> policies) {
    OwningOpRef<ModuleOp> trial = getOperation().clone();
    if (failed(applyActivationPolicies(*trial, policies)))
      return failure();
    PassManager pm(&getContext(), ModuleOp::getOperationName());
    static_cast<OpPassManager &>(pm) = *trials;
    // A trial only compares peaks: the copy is thrown away, and why it
    // cannot overlap a transfer is said by the real schedule.
    pm.enableVerifier(false);
    LogicalResult ran = success();
    {
      ScopedDiagnosticHandler quiet(&getContext(), [](Diagnostic &diag) {
        return success(diag.getSeverity() != DiagnosticSeverity::Error);
      });
      ran = pm.run(*trial);
    }
    if (failed(ran))
      return failure();
    return trial->lookupSymbol<schedule::ResourceOp>("device_arena").getSize();
  }

  void runOnOperation() override {
    ModuleOp module = getOperation();
    FailureOr<func::FuncOp> step = getTrainStep(module);
    if (failed(step))
      return signalPassFailure();
    int64_t layers = countLayers(*step);
    bool automatic = policy == ActivationPolicy::automatic;
    SmallVector<ActivationPolicy> policies(
        layers, automatic ? ActivationPolicy::keep : policy.getValue());
    if (automatic && failed(chooseAutomatically(policies)))
      return signalPassFailure();
    if (failed(applyActivationPolicies(module, policies)))
      return signalPassFailure();
  }

  /// Cheapest first: keep everything, recompute everything, then offload
  /// the checkpoints of leading blocks (live longest) until it fits.
  LogicalResult
  chooseAutomatically(SmallVectorImpl<ActivationPolicy> &policies) {
    uint64_t budget = arenaBudget(gpuMemory, gpuReserve);
    int64_t layers = policies.size();
    FailureOr<int64_t> peak = tryPolicies(policies);
    if (failed(peak))
      return failure();
    if (static_cast<uint64_t>(*peak) <= budget)
      return success();
    std::fill(policies.begin(), policies.end(), ActivationPolicy::recompute);
    peak = tryPolicies(policies);
    if (failed(peak))
      return failure();
    int64_t perBlock = checkpointBytes();
    int64_t offloaded = 0;
    while (static_cast<uint64_t>(*peak) > budget && offloaded < layers) {
      int64_t excess = *peak - static_cast<int64_t>(budget);
      offloaded = std::min(
          layers,
          offloaded +
              std::max<int64_t>(1, perBlock ? (excess + perBlock - 1) / perBlock
                                            : layers));
      for (int64_t i = 0; i < offloaded; ++i)
        policies[i] = ActivationPolicy::offload;
      peak = tryPolicies(policies);
      if (failed(peak))
        return failure();
    }
    return success();
  }

  /// Bytes of block 0's checkpoint (all blocks share its shape).
  int64_t checkpointBytes() {
    FailureOr<func::FuncOp> step = getTrainStep(getOperation());
    int64_t bytes = 0;
    std::vector<BlockOps> first = collectBlocks(*step, findLoss(*step), 1);
    for (Value v : findCheckpoints(first[0].forward, 0))
      bytes += tensorBytes(v.getType());
    return bytes;
  }
};

} // namespace

std::unique_ptr<Pass> megaslide::createPlanActivationsPass(OpPassManager trials) {
  return std::make_unique<PlanActivationsPass>(std::move(trials));
}
