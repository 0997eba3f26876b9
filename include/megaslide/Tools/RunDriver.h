//===- RunDriver.h - Train with an execution plan ---------------*- C++ -*-===//
//
// megaslide-run and megaslide-exec are one program: this driver parses the
// run flags (backend, steps, seed, weights, data, checkpoints, metrics,
// trace, gradients), runs the steps and saves what was asked. The tools
// differ only in where a plan comes from without --plan: megaslide-run
// compiles one (MLIR), megaslide-exec, the runtime-only executor, needs
// --plan (docs/Runtime.md, "A runtime without MLIR").
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_COMMON_RUNDRIVER_H
#define MEGASLIDE_TOOLS_COMMON_RUNDRIVER_H

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/train/Session.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Error.h"

#include <functional>
#include <vector>

namespace megaslide::tools {

/// The job a compiled plan is for (PipelineOptions' gpus-per-node and
/// nodes): one rank's step, or on the cuda backend the launcher's job,
/// whose device collectives the plan holds (docs/Distributed.md).
struct JobShape {
  int64_t gpusPerNode = 1, nodes = 1;
};

struct RunTool {
  const char *name;     ///< for messages: "megaslide-run"
  const char *overview; ///< --help text before the options
  /// Option categories shown by --help besides the run options.
  std::vector<const llvm::cl::OptionCategory *> categories;
  /// Checks the tool's own flags once parsed, before any output is
  /// touched; `planGiven`: whether --plan was given.
  std::function<llvm::Error(bool planGiven)> checkFlags;
  /// The plan when no --plan is given, or one per bucket
  /// (docs/Runtime.md, "Buckets"); `stored` holds the settings of the
  /// checkpoint a --resume continues (null otherwise), which the compiled
  /// plan adopts unless its flags say otherwise; `dataDir` the run's
  /// --data (the checkpoint's where a resume takes it). Sets `exitCode`
  /// for a plan over its budgets; `job` the job it is for. Null: --plan is
  /// required.
  std::function<llvm::Expected<std::vector<train::BucketPlan>>(
      const train::Settings *stored, llvm::StringRef dataDir,
      const JobShape &job, int &exitCode)>
      compile;
};

/// main() of the tool.
int runMain(int argc, char **argv, const RunTool &tool);

/// Whether the option `name` was given on the command line.
bool flagGiven(llvm::StringRef name);

/// The NVMe tier's directories (--nvme), one per drive.
std::vector<std::string> nvmeDirectories();

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_COMMON_RUNDRIVER_H
