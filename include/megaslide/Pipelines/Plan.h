//===- Plan.h - Model + video + budgets -> a plan and its report -*- C++
//-*-===//
//
// What megaslide-plan, the C API and Python run: build the training step,
// run `megaslide-pipeline`, and report. Budget violations are part of the
// result (fits = false); anything else wrong is an error.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_PIPELINES_PLAN_H
#define MEGASLIDE_PIPELINES_PLAN_H

#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Model/ModelInfo.h"

namespace megaslide {

struct PlanOptions {
  std::string gpuMemory = "141GB";
  std::string gpuReserve = "2GiB";
  std::string hostMemory = "1.5TB";
  std::string osAllowance = "64GB";
  std::string hardwarePath; ///< empty: built-in H200 description
  std::string activationPolicy = "auto";
  std::string hostStatePolicy = "master-moments";
  std::string attention = "dsa";
  /// Compute precision, "bf16" or "f32"; overrides the training options'
  /// `computeType` when set.
  std::string precision;
  std::string target = "sm_90a";
  std::vector<int64_t> dsaWindow, dsaTile; ///< empty: the pass defaults
  int64_t dsaRadius = 4;
  int64_t buffers = 2;
  int64_t prefetchDistance = 1;
};

struct PlanResult {
  ModelInfo info;
  PlanReport report;
  mlir::OwningOpRef<mlir::ModuleOp> module;
  /// Why the passes did not do something (e.g. a transfer that cannot
  /// overlap compute).
  std::vector<std::string> remarks;
  double pipelineSeconds = 0;
};

llvm::Expected<PlanResult> planModel(mlir::MLIRContext &context,
                                     llvm::StringRef model,
                                     const VideoShape &video,
                                     const TrainingOptions &training,
                                     const PlanOptions &options);

/// The model report and the plan in one object (docs/PlanSchema.md).
llvm::json::Value toJson(const PlanResult &result);

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_PLAN_H
