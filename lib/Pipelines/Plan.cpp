//===- Plan.cpp - Model + video + budgets -> a plan and its report --------===//

#include "megaslide/Pipelines/Plan.h"

#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Report/JsonReport.h"
#include "megaslide/Support/Units.h"
#include "megaslide/Target/ExecPlan/ExportExecPlan.h"

#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/runtime/plan/HyperParameters.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/Support/FormatVariadic.h"

#include <chrono>
#include <cmath>

using namespace mlir;
using namespace megaslide;

namespace {

/// The path of the first number in `value` that is not finite: JSON has
/// no inf or nan, and llvm::json would print them as such.
std::optional<std::string> firstNonFinite(const llvm::json::Value &value,
                                          const std::string &path = "") {
  if (std::optional<double> number = value.getAsNumber())
    return std::isfinite(*number) ? std::nullopt
                                  : std::optional<std::string>(path);
  if (const llvm::json::Object *obj = value.getAsObject()) {
    for (const auto &[key, item] : *obj)
      if (auto bad = firstNonFinite(
              item, path.empty() ? key.str() : path + "." + key.str()))
        return bad;
  } else if (const llvm::json::Array *array = value.getAsArray()) {
    for (size_t i = 0; i < array->size(); ++i)
      if (auto bad =
              firstNonFinite((*array)[i], path + "[" + std::to_string(i) + "]"))
        return bad;
  }
  return std::nullopt;
}

/// The AdamW hyper-parameters of a step, by the rule of the command line
/// and of loaded plans (plan/HyperParameters.h).
llvm::Error checkHyperParameters(const TrainingOptions &training) {
  struct Named {
    const char *name;
    double value;
  };
  for (Named h :
       {Named{"lr", training.learningRate}, Named{"beta1", training.beta1},
        Named{"beta2", training.beta2}, Named{"eps", training.adamEps},
        Named{"weight_decay", training.weightDecay}}) {
    // A learning rate of 0 stands for the config's (TrainingOptions).
    if (llvm::StringRef(h.name) == "lr" && h.value == 0)
      continue;
    if (std::optional<std::string> problem =
            exec::checkAdamWHyperParameter(h.name, h.value))
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "option '%s': %s", h.name,
                                     problem->c_str());
  }
  return llvm::Error::success();
}

/// A diagnostic with its notes, as one readable message.
std::string render(Diagnostic &diag) {
  std::string text = diag.str();
  for (Diagnostic &note : diag.getNotes())
    text += "\n  note: " + note.str();
  return text;
}

/// A job's scaling against one GPU: the same model and options planned
/// for one rank, with the update mode the job chose (update=auto may choose
/// otherwise for one rank's host), and replayed the same way.
llvm::Error compareWithOneGpu(MLIRContext &context, llvm::StringRef model,
                              const VideoShape &video,
                              const TrainingOptions &training,
                              const PlanOptions &options, PlanReport &report) {
  PlanOptions one = options;
  one.gpusPerNode = 1;
  one.nodes = 1;
  if (std::optional<schedule::UpdatePolicy> update =
          schedule::symbolizeUpdatePolicy(report.recipe.update))
    one.update = *update;
  llvm::Expected<PlanResult> single =
      planModel(context, model, video, training, one);
  if (!single)
    return single.takeError();
  PlanReport::Job &job = report.job;
  job.oneGpuStepSeconds = single->report.recipe.optimizerStepSeconds;
  double samplesPerStep =
      double(training.batch * single->report.recipe.gradAccum);
  if (job.oneGpuStepSeconds > 0)
    job.oneGpuSamplesPerSecond = samplesPerStep / job.oneGpuStepSeconds;
  if (job.oneGpuSamplesPerSecond > 0)
    job.scalingEfficiency = job.samplesPerSecond /
                            (double(job.ranks()) * job.oneGpuSamplesPerSecond);
  return llvm::Error::success();
}

} // namespace

llvm::Expected<PlanResult> megaslide::planModel(MLIRContext &context,
                                                llvm::StringRef model,
                                                const VideoShape &video,
                                                const TrainingOptions &training,
                                                const PlanOptions &options) {
  if (llvm::Error err = checkHyperParameters(training))
    return std::move(err);
  TrainingOptions step = training;
  if (!options.precision.empty()) {
    llvm::Expected<ComputeType> computeType =
        parseComputeType(options.precision);
    if (!computeType)
      return computeType.takeError();
    step.computeType = *computeType;
  }
  HardwareModel hw;
  if (!options.hardwarePath.empty()) {
    llvm::Expected<HardwareModel> loaded =
        loadHardwareModel(options.hardwarePath);
    if (!loaded)
      return loaded.takeError();
    hw = *loaded;
  }

  PlanResult result;
  llvm::Expected<ModelInfo> info =
      computeModelInfo(context, model, video, step, &result.module);
  if (!info)
    return info.takeError();
  result.info = *info;

  PassManager pm(&context, ModuleOp::getOperationName());
  buildMegaSlidePipeline(pm, options);
  // Violations name ops by their role; the IR dump would bury that.
  context.printOpOnDiagnostic(false);

  std::vector<std::string> diagnostics;
  auto start = std::chrono::steady_clock::now();
  LogicalResult ran = success();
  {
    ScopedDiagnosticHandler handler(&context, [&](Diagnostic &diag) {
      if (diag.getSeverity() == DiagnosticSeverity::Error)
        diagnostics.push_back(render(diag));
      else if (diag.getSeverity() == DiagnosticSeverity::Remark)
        result.remarks.push_back(diag.str());
      return success();
    });
    ran = pm.run(*result.module);
  }
  result.pipelineSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  // Budget violations come from the last phase, after memory is planned;
  // any earlier failure is a problem with the input or options.
  bool memoryPlanned = static_cast<bool>(
      result.module->lookupSymbol<schedule::ResourceOp>("device_arena"));
  if (failed(ran) && !memoryPlanned) {
    std::string all;
    for (const std::string &d : diagnostics)
      all += (all.empty() ? "" : "\n") + d;
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "planning failed: %s", all.c_str());
  }
  std::vector<Operation *> origins;
  llvm::Expected<exec::ExecPlan> program =
      exportProgram(*result.module, &origins);
  if (!program)
    return program.takeError();
  llvm::Expected<PlanReport> report =
      buildPlanReport(*result.module, *program, origins, hw,
                      options.gpuMemory.bytes(), options.gpuReserve.bytes(),
                      arenaBudget(options.gpuMemory, options.gpuReserve),
                      options.hostMemory.bytes(),
                      failed(ran) ? diagnostics : std::vector<std::string>());
  if (!report)
    return report.takeError();
  result.report = std::move(*report);
  if (result.report.job.ranks() > 1)
    if (llvm::Error err = compareWithOneGpu(context, model, video, training,
                                            options, result.report))
      return std::move(err);
  // parseHardwareModel's ranges keep every figure finite; should one still
  // not be, refuse it by name rather than print "inf" into a JSON report.
  if (std::optional<std::string> bad = firstNonFinite(toJson(result)))
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "plan report field '%s' is not a finite number; check the hardware "
        "description '%s'",
        bad->c_str(), hw.name.c_str());
  return result;
}

llvm::json::Value megaslide::toJson(const PlanResult &result) {
  llvm::json::Value value = toJson(result.info);
  llvm::json::Object &obj = *value.getAsObject();
  addToJson(result.report, obj);
  if (llvm::json::Object *ir = obj.getObject("ir"))
    (*ir)["pipeline_seconds"] = result.pipelineSeconds;
  llvm::json::Array remarks;
  for (const std::string &r : result.remarks)
    remarks.push_back(r);
  obj["remarks"] = std::move(remarks);
  return value;
}
