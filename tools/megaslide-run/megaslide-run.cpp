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
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

using namespace llvm;
using namespace megaslide;

namespace {

cl::opt<std::string> planCache(
    "plan-cache", cl::cat(tools::planCategory),
    cl::desc("Keep the plans of --buckets here, keyed by what they are "
             "compiled from (default: $MEGASLIDE_CACHE_DIR/plans, else "
             "${XDG_CACHE_HOME:-~/.cache}/megaslide/plans)"),
    cl::value_desc("DIR"));

/// One plan per bucket (docs/Runtime.md, "Buckets"), each from the plan
/// cache or compiled into it; the table of them; exit code 3 naming those
/// over their budgets.
Expected<std::vector<train::BucketPlan>>
compileBuckets(const tools::PlanFlags &flags, int &exitCode) {
  std::string cacheDir = planCache.getNumOccurrences()
                             ? planCache.getValue()
                             : tools::defaultPlanCacheDir();
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::vector<tools::PlannedBucket> planned;
  double compileSeconds = 0;
  for (const tools::Bucket &bucket : flags.buckets) {
    Expected<tools::PlannedBucket> one =
        tools::compileBucket(context, flags, bucket, cacheDir);
    if (!one)
      return one.takeError();
    if (one->fromCache)
      outs() << formatv("bucket {0}: loaded from the plan cache in {1:F2} s\n",
                        bucket.name(), one->seconds);
    else
      outs() << formatv("bucket {0}: compiled in {1:F2} s\n", bucket.name(),
                        one->seconds);
    compileSeconds += one->fromCache ? 0 : one->seconds;
    planned.push_back(std::move(*one));
  }
  outs() << formatv("plans: {0} buckets, {1:F2} s compiling{2}\n",
                    planned.size(), compileSeconds,
                    cacheDir.empty() ? std::string(" (no plan cache: no "
                                                   "HOME)")
                                     : " (cache: " + cacheDir + ")");
  tools::printBucketTable(outs(), planned);
  outs().flush();
  std::string over;
  for (const tools::PlannedBucket &p : planned)
    if (!p.fits()) {
      over += "\n  bucket " + p.bucket.name() + ":";
      for (const std::string &v : p.figures.violations)
        over += " " + StringRef(v).split('\n').first.str();
    }
  if (!over.empty()) {
    exitCode = 3;
    return createStringError("not every bucket's plan fits its budgets (see "
                             "megaslide-plan --buckets for the reports):" +
                             over);
  }
  std::vector<train::BucketPlan> plans;
  for (tools::PlannedBucket &p : planned)
    plans.push_back(
        {p.bucket.name(), std::move(*p.plan), p.figures.predictedSeconds});
  return plans;
}

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
    // A rank plans its own step: the job's size is the launcher's.
    for (auto [name, value] :
         {std::pair{"gpus-per-node", flags.options.gpusPerNode},
          std::pair{"nodes", flags.options.nodes}})
      if (value != 1)
        return createStringError(
            "--" + std::string(name) + " " + std::to_string(value) +
            ": megaslide-run takes its job's size from its launcher "
            "(mpirun -np N, srun; docs/Distributed.md) and plans each rank's "
            "step; --gpus-per-node and --nodes are for megaslide-plan");
    // The plan counts the drives --nvme gives.
    if (int64_t drives = int64_t(tools::nvmeDirectories().size())) {
      if (tools::flagGiven("nvme-drives") && flags.options.nvmeDrives != drives)
        return createStringError(
            "--nvme-drives " + std::to_string(flags.options.nvmeDrives) +
            " but --nvme gives " + std::to_string(drives) +
            " directories: the tier stripes over one drive per directory; "
            "leave out --nvme-drives");
      flags.options.nvmeDrives = drives;
    }
    if (flags.model.empty() && !planGiven)
      return createStringError(
          "--model is required (a preset name or a .json config), unless "
          "--plan FILE runs a saved execution plan");
    if (planGiven && !flags.buckets.empty())
      return createStringError("--plan runs one saved plan; --buckets "
                               "compiles one per bucket: give one of them");
    if (!flags.videoGiven) {
      if (flags.video.frames || flags.video.height || flags.video.width)
        return createStringError("give all of --frames, --height and "
                                 "--width, or none (default 17 x 128 x 128)");
      flags.video = {17, 128, 128, false};
    }
    return Error::success();
  };
  tool.compile =
      [&](const train::Settings *stored, StringRef dataDir,
          const tools::JobShape &job,
          int &exitCode) -> Expected<std::vector<train::BucketPlan>> {
    if (stored)
      if (Error e = adoptStoredSettings(*stored, flags))
        return std::move(e);
    flags.options.gpusPerNode = job.gpusPerNode;
    flags.options.nodes = job.nodes;
    // A prepared folder holds its bucket file: used unless the command
    // line gives the shapes.
    SmallString<256> found(dataDir);
    sys::path::append(found, "buckets.json");
    if (flags.buckets.empty() && !flags.anyVideoFlag && !dataDir.empty() &&
        sys::fs::exists(found)) {
      Expected<std::vector<tools::Bucket>> buckets =
          tools::readBucketFile(found);
      if (!buckets)
        return buckets.takeError();
      flags.buckets = std::move(*buckets);
      flags.bucketFile = std::string(found);
      outs() << "buckets: " << found
             << " (--data's bucket file; --buckets FILE or --frames, "
                "--height and --width choose otherwise)\n";
    }
    if (!flags.buckets.empty())
      return compileBuckets(flags, exitCode);
    mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
    bool overBudget = false;
    Expected<exec::ExecPlan> plan =
        compileExecPlan(context, flags.model, flags.video, flags.training,
                        flags.options, &overBudget);
    if (overBudget)
      exitCode = 3;
    if (!plan)
      return plan.takeError();
    std::vector<train::BucketPlan> one;
    one.push_back({"", std::move(*plan), 0});
    return one;
  };
  return tools::runMain(argc, argv, tool);
}
