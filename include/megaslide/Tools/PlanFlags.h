//===- PlanFlags.h - Command-line flags shared by the tools -----*- C++ -*-===//
//
// megaslide-plan and megaslide-run compile the same training step from the
// same flags (model, video, budgets, policies, 3D-DSA geometry); they are
// defined once here and compiled into both tools, with --hw
// (HardwareFlag.h) shared with megaslide-exec.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_COMMON_PLANFLAGS_H
#define MEGASLIDE_TOOLS_COMMON_PLANFLAGS_H

#include "megaslide/Pipelines/Plan.h"
#include "megaslide/Tools/Buckets.h"
#include "megaslide/Tools/RecipeFlags.h"

#include "llvm/Support/CommandLine.h"

namespace megaslide::tools {

extern llvm::cl::OptionCategory planCategory;

struct PlanFlags {
  std::string model;
  VideoShape video;
  TrainingOptions training;
  PlanOptions options;
  /// The training recipe (docs/Training.md); megaslide-plan reports what
  /// it costs, megaslide-run follows it.
  train::Recipe recipe;
  /// Whether --frames, --height and --width were all given.
  bool videoGiven = false;
  /// Whether any of --frames, --height, --width and --latent was given.
  bool anyVideoFlag = false;
  /// --buckets: its file and the shapes it lists (docs/Runtime.md,
  /// "Buckets"); empty without it.
  std::string bucketFile;
  std::vector<Bucket> buckets;
};

/// The parsed flags; errors name the flag.
llvm::Expected<PlanFlags> readPlanFlags();

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_COMMON_PLANFLAGS_H
