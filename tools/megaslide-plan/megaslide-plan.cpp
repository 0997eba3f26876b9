//===- megaslide-plan.cpp - Size a model before touching a GPU ------------===//
//
// Model config + video shape -> parameter counts, tokens, FLOPs and memory
// figures, as text or JSON (docs/PlanSchema.md); optionally the training-
// step IR for megaslide-opt.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Model/ModelInfo.h"
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
enum class Format { Text, Json };
cl::opt<Format> reportFormat(
    "format", cl::init(Format::Text), cl::cat(category),
    cl::desc("Report format"),
    cl::values(clEnumValN(Format::Text, "text", "readable"),
               clEnumValN(Format::Json, "json", "docs/PlanSchema.md")));
cl::opt<std::string> output("o", cl::init("-"), cl::cat(category),
                            cl::desc("Report file"), cl::value_desc("FILE"));
cl::opt<std::string> emitMlir("emit-mlir", cl::cat(category),
                              cl::desc("Also write the training-step module"),
                              cl::value_desc("FILE"));

int fail(const Twine &message) {
  WithColor::error(errs(), "megaslide-plan") << message << "\n";
  return 1;
}

} // namespace

int main(int argc, char **argv) {
  addVersionPrinter("megaslide-plan");
  cl::HideUnrelatedOptions(category);
  cl::ParseCommandLineOptions(
      argc, argv,
      "megaslide-plan: parameters, tokens, FLOPs and memory of a DiT "
      "training step\n\n"
      "Example:\n  megaslide-plan --model megaslide-105b --frames 81 "
      "--height 720 --width 1280\n");

  VideoShape video{frames, height, width, latent};
  TrainingOptions options;
  options.batch = batch;
  if (textLen.getNumOccurrences())
    options.textLen = textLen;

  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  mlir::OwningOpRef<mlir::ModuleOp> module;
  Expected<ModelInfo> info =
      computeModelInfo(context, model, video, options, &module);
  if (!info)
    return fail(toString(info.takeError()));

  if (!emitMlir.empty()) {
    std::error_code ec;
    ToolOutputFile file(emitMlir, ec, sys::fs::OF_None);
    if (ec)
      return fail("cannot write '" + emitMlir + "': " + ec.message());
    module->print(file.os());
    file.keep();
  }

  std::error_code ec;
  ToolOutputFile out(output, ec, sys::fs::OF_None);
  if (ec)
    return fail("cannot write '" + output + "': " + ec.message());
  if (reportFormat == Format::Json)
    out.os() << formatv("{0:2}", toJson(*info)) << "\n";
  else
    printText(*info, out.os());
  out.keep();
  return 0;
}
