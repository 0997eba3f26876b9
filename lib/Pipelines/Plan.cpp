//===- Plan.cpp - Model + video + budgets -> a plan and its report --------===//

#include "megaslide/Pipelines/Plan.h"

#include "megaslide/Analysis/PlanReport.h"
#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Report/JsonReport.h"
#include "megaslide/Support/Units.h"
#include "megaslide/Target/ExecPlan/ExportExecPlan.h"

#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/runtime/plan/HyperParameters.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
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

/// One plan and its report; a job's compared with one GPU when `compare`.
llvm::Expected<PlanResult> planOnce(MLIRContext &context, llvm::StringRef model,
                                    const VideoShape &video,
                                    const TrainingOptions &training,
                                    const PlanOptions &options, bool compare);

/// Whether the report's host plan exceeds its host-mem.
bool hostOver(const PlanReport &r) { return r.hostTotal > r.hostBudget; }

/// "123GB" (or "12MB" below 1 GB): a size the flags read back, rounded
/// up (a budget that must hold `bytes`) or down (an allowance that must not
/// exceed them).
std::string flagSize(uint64_t bytes, bool up) {
  bool gb = bytes >= 1'000'000'000;
  uint64_t unit = gb ? 1'000'000'000 : 1'000'000;
  uint64_t n = up ? (bytes + unit - 1) / unit : bytes / unit;
  return std::to_string(std::max<uint64_t>(n, 1)) + (gb ? "GB" : "MB");
}

/// When the plan's host memory exceeds host-mem: every change that might
/// make it fit (a smaller OS allowance, the NVMe tier, a bf16 EMA, the
/// streaming update, each other host-state policy, more nodes, a larger
/// host), each planned again with that change, so that what the report
/// calls a fix is one (docs/MemoryAccounting.md, "When it does not fit").
/// Smallest change first: those that fit, then those that are not enough.
llvm::Error addFitOptions(MLIRContext &context, llvm::StringRef model,
                          const VideoShape &video,
                          const TrainingOptions &training,
                          const PlanOptions &options, PlanResult &result) {
  PlanReport &report = result.report;
  ModuleOp module = *result.module;
  double step = report.recipe.optimizerStepSeconds;
  uint64_t shortfall = report.hostTotal - report.hostBudget;
  std::vector<PlanReport::FitOption> fitOptions;
  // Plans `changed`; records it unless the change cannot be planned (an
  // option that does not apply, e.g. persistent-bf16 with f32 compute).
  auto replan =
      [&](std::string change, std::string what, const PlanOptions &changed,
          std::string note = "") -> llvm::Expected<std::optional<PlanReport>> {
    llvm::Expected<PlanResult> again =
        planOnce(context, model, video, training, changed, /*compare=*/false);
    if (!again) {
      llvm::consumeError(again.takeError());
      return std::nullopt;
    }
    const PlanReport &r = again->report;
    PlanReport::FitOption o{std::move(change), std::move(what),
                            r.fits(),          r.hostTotal,
                            r.hostBudget,      r.recipe.optimizerStepSeconds,
                            std::move(note)};
    std::string cost =
        llvm::formatv("step {0:F3} s ({1}{2:F3} s)", o.stepSeconds,
                      o.stepSeconds >= step ? "+" : "", o.stepSeconds - step)
            .str();
    if (!r.tier.roles.empty())
      cost += llvm::formatv(", {0} read and written per step, I/O busy "
                            "{1:F3} s (estimate)",
                            formatBytes(r.tier.bytesPerStep), r.tier.ioSeconds)
                  .str();
    if (!hostOver(r) && !r.fits())
      cost = "the host fits but not the device: " + r.violations.front();
    o.note = o.note.empty() ? cost : o.note + "; " + cost;
    fitOptions.push_back(std::move(o));
    return std::optional<PlanReport>(r);
  };

  // The OS allowance: down to what fits, not below osAllowanceFor's floor.
  uint64_t allowance = 0;
  if (auto os = module.lookupSymbol<schedule::ResourceOp>(kOsAllowanceResource))
    allowance = os.getSize();
  {
    uint64_t floor = osAllowanceFor(0);
    uint64_t target =
        allowance <= floor
            ? allowance
            : std::max(allowance > shortfall ? allowance - shortfall : 0,
                       floor);
    PlanOptions changed = options;
    changed.osAllowance = cantFail(
        AutoByteSize::parse(target == allowance ? std::to_string(allowance)
                                                : flagSize(target, false)));
    std::string what =
        target < allowance
            ? "reserve " + formatBytes(changed.osAllowance.bytes()) +
                  " for the OS and the runtime instead of " +
                  formatBytes(allowance)
            : "the OS and runtime allowance is " + formatBytes(allowance) +
                  " already, at most the " + formatBytes(floor) +
                  " auto keeps at least";
    if (auto r = replan("--os-allowance " + changed.osAllowance.text(), what,
                        changed, "only if they need no more");
        !r)
      return r.takeError();
  }
  // The NVMe tier: the fewest drives whose I/O hides behind compute, else
  // those that fit adding the least time.
  if (options.nvmeDrives == 0) {
    std::optional<PlanReport::FitOption> chosen;
    for (int64_t drives : {1, 2, 4, 8}) {
      PlanOptions changed = options;
      changed.nvmeDrives = drives;
      auto r = replan("--nvme-drives " + std::to_string(drives),
                      "keep host state on " + std::to_string(drives) +
                          " NVMe drive(s) (megaslide-run --nvme DIR,...)",
                      changed);
      if (!r)
        return r.takeError();
      if (!*r)
        break;
      PlanReport::FitOption o = fitOptions.back();
      fitOptions.pop_back();
      if (!chosen ||
          (o.fits && (!chosen->fits || o.stepSeconds < chosen->stepSeconds)))
        chosen = o;
      if (o.fits && (*r)->tier.hidden((*r)->predictedSeconds))
        break;
      if (!o.fits && (*r)->tier.roles.empty())
        break; // no tier fits: more drives do not add RAM
    }
    if (chosen)
      fitOptions.push_back(*chosen);
  }
  // The training recipe's host buffers.
  if (report.recipe.ema == "f32") {
    PlanOptions changed = options;
    changed.ema = schedule::EmaPolicy::bf16;
    if (auto r = replan("--ema-dtype bf16",
                        "keep the EMA of the weights in bf16", changed);
        !r)
      return r.takeError();
  }
  if (report.recipe.update == "deferred" && report.job.ranks() == 1 &&
      report.recipe.gradAccum == 1) {
    PlanOptions changed = options;
    changed.update = schedule::UpdatePolicy::streaming;
    if (auto r = replan(
            "--update streaming",
            "update each parameter as its gradient arrives (clips with the "
            "previous step's global norm, an approximation)",
            changed);
        !r)
      return r.takeError();
  }
  // Every other host-state policy, smallest saving first.
  std::vector<schedule::HostStatePolicy> policies;
  for (schedule::HostStatePolicy p : schedule::hostStatePolicies())
    if (schedule::stringifyEnum(p) != report.hostStatePolicy)
      policies.push_back(p);
  llvm::stable_sort(policies, [](auto a, auto b) {
    return schedule::bytesPerParam(a) > schedule::bytesPerParam(b);
  });
  for (schedule::HostStatePolicy p : policies) {
    PlanOptions changed = options;
    changed.hostStatePolicy = p;
    if (auto r =
            replan(("--host-state-policy " + schedule::stringifyEnum(p)).str(),
                   llvm::formatv("{0} ({1} B/param)", schedule::describe(p),
                                 schedule::bytesPerParam(p))
                       .str(),
                   changed);
        !r)
      return r.takeError();
  }
  // More nodes shard the state over more hosts: from nodesToFitHost's
  // estimate up, as a job adds buffers of its own (the deferred update).
  if (int64_t nodes = nodesToFitHost(module, report.hostBudget);
      nodes > report.job.nodes) {
    PlanOptions changed = options;
    // A job needs the deferred update (docs/Distributed.md).
    std::string update;
    if (options.update == schedule::UpdatePolicy::streaming) {
      changed.update = schedule::UpdatePolicy::automatic;
      update = " --update auto";
    }
    for (int64_t more = 0; more < 4; ++more) {
      changed.nodes = nodes + more;
      llvm::Expected<PlanResult> again =
          planOnce(context, model, video, training, changed, false);
      if (!again) {
        llvm::consumeError(again.takeError());
        break;
      }
      if (!hostOver(again->report))
        break;
    }
    if (auto r = replan(
            "--nodes " + std::to_string(changed.nodes) + update,
            llvm::formatv("shard the host state over {0} nodes of {1} GPU(s)",
                          changed.nodes, report.job.gpusPerNode)
                .str(),
            changed);
        !r)
      return r.takeError();
  }
  // A larger host: what the plan needs, again with the allowance that
  // host gets.
  {
    PlanOptions changed = options;
    uint64_t need = report.hostTotal;
    for (int tries = 0; tries < 3; ++tries) {
      changed.hostMemory = cantFail(ByteBudget::parse(flagSize(need, true)));
      llvm::Expected<PlanResult> again =
          planOnce(context, model, video, training, changed, false);
      if (!again) {
        llvm::consumeError(again.takeError());
        break;
      }
      if (!hostOver(again->report))
        break;
      need = again->report.hostTotal;
    }
    if (auto r = replan(
            "--host-mem " + changed.hostMemory.text(),
            "a host with " + formatBytes(changed.hostMemory.bytes()), changed);
        !r)
      return r.takeError();
  }
  std::stable_partition(fitOptions.begin(), fitOptions.end(),
                        [](const auto &o) { return o.fits; });
  report.fitOptions = std::move(fitOptions);
  return llvm::Error::success();
}

} // namespace

llvm::Expected<PlanResult> megaslide::planModel(MLIRContext &context,
                                                llvm::StringRef model,
                                                const VideoShape &video,
                                                const TrainingOptions &training,
                                                const PlanOptions &options) {
  llvm::Expected<PlanResult> result =
      planOnce(context, model, video, training, options, /*compare=*/true);
  if (!result || !hostOver(result->report))
    return result;
  if (llvm::Error err =
          addFitOptions(context, model, video, training, options, *result))
    return std::move(err);
  // The job's estimate of the nodes that would do is replaced by the
  // --nodes that was planned again.
  llvm::erase_if(result->report.job.advice, [](const std::string &a) {
    return llvm::StringRef(a).starts_with("more nodes: ");
  });
  return result;
}

namespace {
llvm::Expected<PlanResult> planOnce(MLIRContext &context, llvm::StringRef model,
                                    const VideoShape &video,
                                    const TrainingOptions &training,
                                    const PlanOptions &options, bool compare) {
  if (llvm::Error err = checkHyperParameters(training))
    return std::move(err);
  // check-budget reads it last, after memory is planned; refuse it here
  // as the input error it is rather than as a budget violation.
  if (options.nvmeDrives < 0)
    return llvm::createStringError("option 'nvme-drives' is " +
                                   std::to_string(options.nvmeDrives) +
                                   "; it must be 0 (no NVMe tier) or more");
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
  if (compare && result.report.job.ranks() > 1)
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
} // namespace

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
