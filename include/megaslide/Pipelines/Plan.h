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
#include "megaslide/Pipelines/PipelineOptions.h"

namespace megaslide {

/// What planModel takes: the planning options (PipelineOptions.def) and
/// two choices that are not pipeline options: the hardware the plan is
/// timed on, and the compute type the step is built with.
struct PlanOptions : PlanningOptions {
  std::string hardwarePath; ///< empty: built-in H200 description
  /// Compute precision, "bf16" or "f32"; overrides the training options'
  /// `computeType` when set.
  std::string precision;
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
