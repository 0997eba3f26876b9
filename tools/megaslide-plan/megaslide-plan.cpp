//===- megaslide-plan.cpp - Size a model before touching a GPU ------------===//
//
// Model config + video shape + budgets -> parameter counts, FLOPs, the
// planned host and device memory, transfers and the predicted step time,
// as text, JSON (docs/PlanSchema.md) or a self-contained HTML report.
// Exit status: 0 fits, 3 does not fit, 1 bad input.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Tools/EcosystemFlags.h"
#include "megaslide/Tools/HardwareFlag.h"
#include "megaslide/Tools/PlanFlags.h"

#include "megaslide/Model/ModelConfig.h"
#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Report/HtmlReport.h"
#include "megaslide/Report/TextReport.h"
#include "megaslide/Version.h"
#include "megaslide/runtime/support/AtomicFile.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/WithColor.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory category("megaslide-plan options");

enum class Format { Text, Json, Html };
cl::opt<Format> reportFormat(
    "format", cl::init(Format::Text), cl::cat(category),
    cl::desc("Report format"),
    cl::values(clEnumValN(Format::Text, "text", "readable"),
               clEnumValN(Format::Json, "json", "docs/PlanSchema.md"),
               clEnumValN(Format::Html, "html", "self-contained page")));
cl::opt<std::string> output("o", cl::init("-"), cl::cat(category),
                            cl::desc("Report file"), cl::value_desc("FILE"));
cl::opt<std::string> emitMlir("emit-mlir", cl::cat(category),
                              cl::desc("Also write the training-step module "
                                       "as built (before planning)"),
                              cl::value_desc("FILE"));
cl::opt<std::string> emitPlan("emit-plan-mlir", cl::cat(category),
                              cl::desc("Also write the planned module"),
                              cl::value_desc("FILE"));

int fail(const Twine &message) {
  WithColor::error(errs(), "megaslide-plan") << message << "\n";
  return 1;
}

/// Writes `path` atomically ("-" is stdout): a failure leaves an existing
/// file as it was, and `error` names it.
bool writeFile(StringRef path, function_ref<void(raw_ostream &)> write,
               std::string &error) {
  if (Error err = writeFileAtomically(path, write)) {
    error = toString(std::move(err));
    return false;
  }
  return true;
}

/// --buckets: every bucket planned, one table of them worst first (text)
/// or an array (JSON); exit 3 naming each bucket that does not fit.
int planBuckets(const tools::PlanFlags &flags) {
  if (reportFormat == Format::Html || !emitMlir.empty() || !emitPlan.empty())
    return fail("--buckets reports a table of the buckets (--format text or "
                "json); for the full report or the IR of one, give its "
                "--frames, --height and --width");
  if (Error err = checkOutputFile(output))
    return fail(toString(std::move(err)));
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::vector<tools::PlannedBucket> planned;
  for (const tools::Bucket &bucket : flags.buckets) {
    Expected<PlanResult> plan = planModel(context, flags.model, bucket.video(),
                                          flags.training, flags.options);
    if (!plan)
      return fail("bucket " + bucket.name() + ": " +
                  toString(plan.takeError()));
    tools::PlannedBucket p;
    p.bucket = bucket;
    p.figures = {plan->report.devicePeak, plan->report.predictedSeconds,
                 plan->report.violations};
    planned.push_back(std::move(p));
  }
  std::string error;
  bool written = writeFile(
      output,
      [&](raw_ostream &os) {
        if (reportFormat == Format::Json)
          os << formatv("{0:2}",
                        json::Value(json::Object{
                            {"model", flags.model},
                            {"bucket_file", flags.bucketFile},
                            {"buckets", tools::bucketTableJson(planned)}}))
             << "\n";
        else
          tools::printBucketTable(os, planned);
      },
      error);
  if (!written)
    return fail(error);
  bool fits = true;
  for (const tools::PlannedBucket &p : planned)
    for (const std::string &v : p.figures.violations) {
      fits = false;
      WithColor::error(errs(), "megaslide-plan")
          << "bucket " << p.bucket.name() << ": "
          << StringRef(v).split('\n').first << "\n";
    }
  return fits ? 0 : 3;
}

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-plan");
  cl::HideUnrelatedOptions({&tools::planCategory, &tools::recipeCategory,
                            &tools::hardwareCategory, &category});
  if (!tools::checkEcosystemFlags(argc, argv, "megaslide-plan", {}))
    return 1;
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-plan: does a DiT training step fit this GPU and host, and "
      "how long will it take?\n\n"
      "Example:\n  megaslide-plan --model megaslide-105b --frames 81 "
      "--height 720 --width 1280 --gpu-mem 141GB --host-mem 1.5TB\n\n"
      "Exit status: 0 fits, 3 does not fit, 1 bad input.\n");

  Expected<tools::PlanFlags> flags = tools::readPlanFlags();
  if (!flags)
    return fail(toString(flags.takeError()));
  if (flags->model.empty())
    return fail("--model is required: one of the presets " +
                join(presetNames(), ", ") + ", or a path to a .json config");
  if (!flags->buckets.empty())
    return planBuckets(*flags);
  if (!flags->videoGiven)
    return fail("--frames, --height and --width are required");
  const std::string &model = flags->model;
  const VideoShape &video = flags->video;
  const TrainingOptions &training = flags->training;
  const PlanOptions &options = flags->options;
  // Outputs that cannot be written are found before the planning work.
  for (const std::string &path :
       {output.getValue(), emitMlir.getValue(), emitPlan.getValue()})
    if (!path.empty())
      if (Error err = checkOutputFile(path))
        return fail(toString(std::move(err)));

  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::string error;
  // The module as built, before any planning pass rewrites it; written
  // once planning has accepted every input, so that a bad flag leaves the
  // files the user has as they were.
  mlir::OwningOpRef<mlir::ModuleOp> built;
  if (!emitMlir.empty()) {
    Expected<ModelInfo> info =
        computeModelInfo(context, model, video, training, &built);
    if (!info)
      return fail(toString(info.takeError()));
  }
  Expected<PlanResult> plan =
      planModel(context, model, video, training, options);
  if (!plan)
    return fail(toString(plan.takeError()));
  if (built && !writeFile(
                   emitMlir, [&](raw_ostream &os) { built->print(os); }, error))
    return fail(error);
  if (!emitPlan.empty() &&
      !writeFile(
          emitPlan, [&](raw_ostream &os) { plan->module->print(os); }, error))
    return fail(error);

  bool written = writeFile(
      output,
      [&](raw_ostream &os) {
        switch (reportFormat) {
        case Format::Json:
          os << formatv("{0:2}", toJson(*plan)) << "\n";
          break;
        case Format::Html:
          os << renderHtmlReport(toJson(*plan));
          break;
        case Format::Text:
          printText(plan->info, os);
          os << "\n";
          printText(plan->report, os);
          if (!plan->remarks.empty()) {
            os << "\nPlanner remarks (" << plan->remarks.size() << "):\n";
            for (const std::string &r : ArrayRef(plan->remarks).take_front(5))
              os << "  " << r << "\n";
            if (plan->remarks.size() > 5)
              os << "  ... (all in --format json)\n";
          }
          break;
        }
      },
      error);
  if (!written)
    return fail(error);
  if (!plan->report.fits()) {
    // Say why on stderr whatever the format (first lines; the report has
    // the notes), so scripts and users of --format json see it.
    for (const std::string &v : plan->report.violations)
      WithColor::error(errs(), "megaslide-plan")
          << StringRef(v).split('\n').first << "\n";
    return 3;
  }
  return 0;
}
