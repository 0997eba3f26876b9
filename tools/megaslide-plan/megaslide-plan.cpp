//===- megaslide-plan.cpp - Size a model before touching a GPU ------------===//
//
// Model config + video shape + budgets -> parameter counts, FLOPs, the
// planned host and device memory, transfers and the predicted step time,
// as text, JSON (docs/PlanSchema.md) or a self-contained HTML report.
// Exit status: 0 fits, 3 does not fit, 1 bad input.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Version.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/WithColor.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::OptionCategory category("megaslide-plan options");

cl::opt<std::string> model("model", cl::Required, cl::cat(category),
                           cl::desc("Preset name or path to a JSON config"),
                           cl::value_desc("NAME|FILE"));
cl::opt<int64_t> frames("frames", cl::Required, cl::cat(category),
                        cl::desc("Video frames (pixels unless --latent)"));
cl::opt<int64_t> height("height", cl::Required, cl::cat(category),
                        cl::desc("Video height"));
cl::opt<int64_t> width("width", cl::Required, cl::cat(category),
                       cl::desc("Video width"));
cl::opt<bool> latent("latent", cl::cat(category),
                     cl::desc("Sizes are in latent elements, not pixels"));
cl::opt<int64_t> batch("batch", cl::init(1), cl::cat(category),
                       cl::desc("Samples per training step"));
cl::opt<int64_t> textLen("text-len", cl::init(0), cl::cat(category),
                         cl::desc("Text tokens per prompt (default: config)"));
cl::opt<std::string> gpuMem("gpu-mem", cl::init("141GB"), cl::cat(category),
                            cl::desc("GPU memory budget (GB, GiB, TB, TiB)"));
cl::opt<std::string> gpuReserve(
    "gpu-reserve", cl::init("2GiB"), cl::cat(category),
    cl::desc("Part of the GPU budget kept for the CUDA context and libraries"));
cl::opt<std::string> hostMem("host-mem", cl::init("1.5TB"), cl::cat(category),
                             cl::desc("Host memory budget"));
cl::opt<std::string>
    osAllowance("os-allowance", cl::init("64GB"), cl::cat(category),
                cl::desc("Host memory reserved for the OS and runtime"));
cl::opt<std::string> hardware("hw", cl::cat(category),
                              cl::desc("Hardware description (JSON; default: "
                                       "built-in H200 + 1.5 TB host)"),
                              cl::value_desc("FILE"));
cl::opt<std::string>
    activationPolicy("activation-policy", cl::init("auto"), cl::cat(category),
                     cl::desc("keep | recompute | offload | auto"));
cl::opt<std::string> hostStatePolicy(
    "host-state-policy", cl::init("master-moments"), cl::cat(category),
    cl::desc("master-moments | persistent-bf16 | bf16-moments"));
cl::opt<std::string> attention("attention", cl::init("dsa"), cl::cat(category),
                               cl::desc("dsa | global"));
cl::opt<std::string>
    precision("precision", cl::init("bf16"), cl::cat(category),
              cl::desc("Compute precision of activations, working weights "
                       "and gradients: bf16 | f32 (masters and moments are "
                       "fp32 either way)"));
cl::list<int64_t> dsaWindow("dsa-window", cl::CommaSeparated, cl::cat(category),
                            cl::desc("3D-DSA key window t,y,x in tokens "
                                     "(default 9,15,24)"));
cl::list<int64_t> dsaTile("dsa-tile", cl::CommaSeparated, cl::cat(category),
                          cl::desc("3D-DSA query tile t,y,x in tokens "
                                   "(default 3,5,8)"));
cl::opt<int64_t> dsaRadius("dsa-radius", cl::init(4), cl::cat(category),
                           cl::desc("Largest displacement offset estimation "
                                    "searches"));
cl::opt<int64_t> buffers("buffers", cl::init(2), cl::cat(category),
                         cl::desc("Weight-shard buffers on device"));
cl::opt<int64_t> prefetch("prefetch", cl::init(1), cl::cat(category),
                          cl::desc("Blocks ahead that weights are fetched"));
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

bool writeFile(StringRef path, function_ref<void(raw_ostream &)> write,
               std::string &error) {
  std::error_code ec;
  ToolOutputFile file(path, ec, sys::fs::OF_None);
  if (ec) {
    error = "cannot write '" + path.str() + "': " + ec.message();
    return false;
  }
  write(file.os());
  file.keep();
  return true;
}

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-plan");
  cl::HideUnrelatedOptions(category);
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-plan: does a DiT training step fit this GPU and host, and "
      "how long will it take?\n\n"
      "Example:\n  megaslide-plan --model megaslide-105b --frames 81 "
      "--height 720 --width 1280 --gpu-mem 141GB --host-mem 1.5TB\n\n"
      "Exit status: 0 fits, 3 does not fit, 1 bad input.\n");

  VideoShape video{frames, height, width, latent};
  TrainingOptions training;
  training.batch = batch;
  if (textLen.getNumOccurrences())
    training.textLen = textLen;
  // Parsed here too: --emit-mlir builds the step before planModel runs.
  Expected<ComputeType> computeType = parseComputeType(precision);
  if (!computeType)
    return fail(toString(computeType.takeError()));
  training.computeType = *computeType;
  PlanOptions options;
  options.gpuMemory = gpuMem;
  options.gpuReserve = gpuReserve;
  options.hostMemory = hostMem;
  options.osAllowance = osAllowance;
  options.hardwarePath = hardware;
  options.activationPolicy = activationPolicy;
  options.hostStatePolicy = hostStatePolicy;
  options.attention = attention;
  options.precision = precision;
  options.buffers = buffers;
  options.dsaWindow.assign(dsaWindow.begin(), dsaWindow.end());
  options.dsaTile.assign(dsaTile.begin(), dsaTile.end());
  options.dsaRadius = dsaRadius;
  options.prefetchDistance = prefetch;

  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::string error;
  if (!emitMlir.empty()) {
    // The module as built, before any planning pass rewrites it.
    mlir::OwningOpRef<mlir::ModuleOp> built;
    Expected<ModelInfo> info =
        computeModelInfo(context, model, video, training, &built);
    if (!info)
      return fail(toString(info.takeError()));
    if (!writeFile(
            emitMlir, [&](raw_ostream &os) { built->print(os); }, error))
      return fail(error);
  }
  Expected<PlanResult> plan =
      planModel(context, model, video, training, options);
  if (!plan)
    return fail(toString(plan.takeError()));
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
