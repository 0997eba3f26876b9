//===- megaslide-run.cpp - Compile a training step and run it -------------===//
//
// Compiles the training step of a model from the planning flags (or loads
// a saved plan) and runs it with the shared run driver (RunDriver.h):
// megaslide-exec without the compiler.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Tools/PlanFlags.h"
#include "megaslide/Tools/RunDriver.h"

#include "megaslide/Pipelines/CompileExecPlan.h"

#include "mlir/IR/MLIRContext.h"

using namespace llvm;
using namespace megaslide;

namespace {

/// A resumed run compiles with the checkpoint's AdamW settings and
/// precision unless the command line gives them.
Error adoptStoredSettings(const train::Settings &stored,
                          tools::PlanFlags &flags) {
  auto number = [&](StringRef name, double &out) -> Error {
    std::optional<std::string> v = train::findSetting(stored, name);
    if (v && StringRef(*v).getAsDouble(out))
      return createStringError("the checkpoint's " + name + " '" + *v +
                               "' is not a number");
    return Error::success();
  };
  if (!tools::flagGiven("lr"))
    if (Error e = number("lr", flags.training.learningRate))
      return e;
  if (!tools::flagGiven("weight-decay"))
    if (Error e = number("weight_decay", flags.training.weightDecay))
      return e;
  if (std::optional<std::string> v = train::findSetting(stored, "precision");
      v && !tools::flagGiven("precision"))
    flags.options.precision = *v;
  return Error::success();
}

} // namespace

int main(int argc, char **argv) {
  tools::PlanFlags flags;
  tools::RunTool tool;
  tool.name = "megaslide-run";
  tool.overview =
      "megaslide-run: train a video DiT with a compiled execution plan\n\n"
      "Example:\n  megaslide-run --model tiny --backend cpu --steps 200";
  tool.categories = {&tools::planCategory};
  tool.checkFlags = [&](bool planGiven) -> Error {
    Expected<tools::PlanFlags> read = tools::readPlanFlags();
    if (!read)
      return read.takeError();
    flags = std::move(*read);
    if (flags.model.empty() && !planGiven)
      return createStringError(
          "--model is required (a preset name or a .json config), unless "
          "--plan FILE runs a saved execution plan");
    if (!flags.videoGiven) {
      if (flags.video.frames || flags.video.height || flags.video.width)
        return createStringError("give all of --frames, --height and "
                                 "--width, or none (default 17 x 128 x 128)");
      flags.video = {17, 128, 128, false};
    }
    return Error::success();
  };
  tool.compile = [&](const train::Settings *stored,
                     int &exitCode) -> Expected<exec::ExecPlan> {
    if (stored)
      if (Error e = adoptStoredSettings(*stored, flags))
        return std::move(e);
    mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
    bool overBudget = false;
    Expected<exec::ExecPlan> plan =
        compileExecPlan(context, flags.model, flags.video, flags.training,
                        flags.options, &overBudget);
    if (overBudget)
      exitCode = 3;
    return plan;
  };
  return tools::runMain(argc, argv, tool);
}
