//===- CompileExecPlan.cpp - Model + video + budgets -> a plan ------------===//

#include "megaslide/Pipelines/CompileExecPlan.h"

#include "megaslide/Target/ExecPlan/ExportExecPlan.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"

using namespace mlir;
using namespace megaslide;

llvm::Expected<exec::ExecPlan> megaslide::compileExecPlan(
    MLIRContext &context, StringRef model, const VideoShape &video,
    const TrainingOptions &training, const PlanOptions &options,
    bool *overBudget, PlanFigures *figures) {
  llvm::Expected<PlanResult> planned =
      planModel(context, model, video, training, options);
  if (!planned)
    return planned.takeError();
  if (figures)
    *figures = {planned->report.devicePeak, planned->report.predictedSeconds,
                planned->report.violations};
  if (!planned->report.fits()) {
    std::string why;
    for (const std::string &v : planned->report.violations)
      why += "\n  " + StringRef(v).split('\n').first.str();
    if (overBudget)
      *overBudget = true;
    return llvm::createStringError("the plan does not fit its budgets (see "
                                   "megaslide-plan for the full report):" +
                                   why);
  }
  llvm::Expected<exec::ExecPlan> plan = exportExecPlan(*planned->module);
  if (!plan)
    return plan.takeError();
  const ModelInfo &info = planned->info;
  plan->model = info.config.name;
  plan->modelConfig = info.config.sourceJson;
  plan->grid.assign(info.geometry.grid.begin(), info.geometry.grid.end());
  plan->batch = info.options.batch;
  return exec::parseExecPlan(exec::serialize(*plan), "<compiled plan>");
}
