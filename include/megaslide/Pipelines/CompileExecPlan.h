//===- CompileExecPlan.h - Model + video + budgets -> a plan ----*- C++ -*-===//
//
// The whole compilation flow in one call: planModel, then the exporter
// (megaslide/Target/ExecPlan/ExportExecPlan.h). What megaslide-run and the
// C API's trainer compile with.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_PIPELINES_COMPILEEXECPLAN_H
#define MEGASLIDE_PIPELINES_COMPILEEXECPLAN_H

#include "megaslide/Pipelines/Plan.h"
#include "megaslide/runtime/plan/ExecPlan.h"

namespace megaslide {

/// What the planner predicts of a plan (its PlanReport's own figures),
/// which the execution plan does not carry.
struct PlanFigures {
  int64_t devicePeak = 0;      ///< planned device peak (the arena), bytes
  double predictedSeconds = 0; ///< predicted step time
  std::vector<std::string> violations; ///< of its budgets; empty: it fits
};

/// Compiles `model` at `video` into a validated execution plan: builds the
/// training step, runs megaslide-pipeline, exports it, fills in the model
/// fields and passes the text through the runtime's loader, so what is run
/// is exactly what a saved plan file would give. A plan over its budgets is
/// an error listing the violations, with `*overBudget` set. `figures`, if
/// given, is filled once planned, over budget or not.
llvm::Expected<exec::ExecPlan>
compileExecPlan(mlir::MLIRContext &context, llvm::StringRef model,
                const VideoShape &video, const TrainingOptions &training,
                const PlanOptions &options, bool *overBudget = nullptr,
                PlanFigures *figures = nullptr);

} // namespace megaslide

#endif // MEGASLIDE_PIPELINES_COMPILEEXECPLAN_H
