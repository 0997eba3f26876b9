//===- RecipeFlags.h - The training recipe's flags --------------*- C++ -*-===//
//
// --lr-schedule, --max-grad-norm, --ema-decay, --timestep-sampling and the
// rest of the recipe (docs/Training.md), defined once and compiled into
// megaslide-plan (which reports their cost), megaslide-run and
// megaslide-exec. No MLIR.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_RECIPEFLAGS_H
#define MEGASLIDE_TOOLS_RECIPEFLAGS_H

#include "megaslide/runtime/train/Recipe.h"

#include "llvm/Support/CommandLine.h"

namespace megaslide::tools {

extern llvm::cl::OptionCategory recipeCategory;

/// The recipe the flags give, checked (`lr`: the learning rate --min-lr
/// may not exceed; infinity where it is not known yet).
llvm::Expected<train::Recipe> readRecipeFlags(double lr);

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_RECIPEFLAGS_H
