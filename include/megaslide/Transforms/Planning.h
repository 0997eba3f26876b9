//===- Planning.h - Shared pieces of the planning passes --------*- C++ -*-===//
//
// The planning passes are thin wrappers over these functions, so that
// `auto` policies can try a plan on a copy of the module.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TRANSFORMS_PLANNING_H
#define MEGASLIDE_TRANSFORMS_PLANNING_H

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Analysis/CostModel.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/PassManager.h"

#include <optional>

namespace megaslide {

/// The training step of a module built by the model builder; emits an
/// error on the module when there is none.
mlir::FailureOr<mlir::func::FuncOp> getTrainStep(mlir::ModuleOp module);

using graph::getLayer;

/// Number of transformer blocks (1 + the largest layer index).
int64_t countLayers(mlir::func::FuncOp step);

/// The loss op of the step: ops after it form the backward half.
mlir::Operation *findLoss(mlir::func::FuncOp step);

/// Name of a module attribute recording each block's activation policy.
inline constexpr llvm::StringLiteral kActivationPolicyAttr =
    "msched.activation_policy";
inline constexpr llvm::StringLiteral kHostStatePolicyAttr =
    "msched.host_state_policy";

/// What megaslide-defer-updates chose: "deferred" or "streaming"; unit
/// `msched.update_auto` when `update=auto` chose it; micro-batches per
/// optimizer step; the EMA policy's name.
inline constexpr llvm::StringLiteral kUpdateAttr = "msched.update";
inline constexpr llvm::StringLiteral kUpdateAutoAttr = "msched.update_auto";
inline constexpr llvm::StringLiteral kGradAccumAttr = "msched.grad_accum";
inline constexpr llvm::StringLiteral kEmaAttr = "msched.ema";
/// What megaslide-check-budget spilled to the NVMe tier when the host
/// state did not fit host-mem: a dictionary {roles = ["moment", ...]
/// (exec::kTierRoles), window_bytes = i64 (per rank)}, which the exporter
/// writes as the plan's host_tier.
inline constexpr llvm::StringLiteral kHostTierAttr = "msched.host_tier";
/// The models trained over the plan in one run when more than one (Wan
/// 2.2's two experts): each holds a host state and an EMA of its own.
inline constexpr llvm::StringLiteral kExpertsAttr = "msched.experts";

using schedule::ActivationPolicy;

/// Rewrites the step so that each block follows its policy (keep,
/// recompute or offload; see PlanActivationsPass).
mlir::LogicalResult
applyActivationPolicies(mlir::ModuleOp module,
                        llvm::ArrayRef<ActivationPolicy> policies);

/// megaslide-plan-activations measuring the trials of `auto` with
/// `trials` (buildActivationTrialPipeline). Made without it, the pass
/// looks up the registered `megaslide-activation-trial-pipeline`.
std::unique_ptr<mlir::Pass> createPlanActivationsPass(mlir::OpPassManager trials);

/// Explicit transfers (see InsertTransfersPass), with the collectives of
/// `job` when it has several ranks.
mlir::LogicalResult insertTransfers(mlir::ModuleOp module, JobSize job = {});

/// Streams, prefetch, events and pinned staging (see ScheduleOverlapPass).
mlir::LogicalResult scheduleOverlap(mlir::ModuleOp module,
                                    int64_t prefetchDistance, int64_t buffers,
                                    int64_t gradientBuffers, bool emitRemarks);

/// Packs device buffers; returns the arena size (the planned peak).
mlir::FailureOr<int64_t> planMemory(mlir::ModuleOp module, int64_t alignment);

/// Declares (or, when planning again, resizes) the module-level resource
/// `name`.
void declareResource(mlir::ModuleOp module, llvm::StringRef name,
                     megaslide::schedule::Residency residency, uint64_t size,
                     llvm::StringRef category);

} // namespace megaslide

#endif // MEGASLIDE_TRANSFORMS_PLANNING_H
