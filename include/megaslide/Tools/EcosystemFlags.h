//===- EcosystemFlags.h - Other trainers' flags, answered -------*- C++ -*-===//
//
// Users come from diffusers' training scripts, accelerate and musubi-tuner
// with their flags. LLVM's "Did you mean" answers by spelling alone, which
// sent --gradient_checkpointing to --overwrite-checkpoints; these flags are
// answered from a table instead (docs/Training.md, "Flags of other
// trainers"), and no flag that deletes anything is suggested by spelling.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_ECOSYSTEMFLAGS_H
#define MEGASLIDE_TOOLS_ECOSYSTEMFLAGS_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

namespace megaslide::tools {

/// A flag of another trainer and what MegaSlide has instead.
struct EcosystemFlag {
  const char *name;   ///< spelled with '-' (an '_' spelling matches too)
  const char *origin; ///< "diffusers", "accelerate", "musubi-tuner"
  const char *flag;   ///< MegaSlide's flag (no dashes), or "" if none
  const char *advice; ///< the value to give, or why it is not supported
};

/// The table, in the order of docs/Training.md.
llvm::ArrayRef<EcosystemFlag> ecosystemFlags();

/// The table as the Markdown docs/Training.md shows.
void printEcosystemFlags(llvm::raw_ostream &os);

/// Looks at the flags of `argv` before cl::ParseCommandLineOptions: one of
/// another trainer's gets its equivalent (or "not supported") and false;
/// for any other unknown flag, the options in `destructive` are hidden from
/// LLVM's spelling suggestions.
bool checkEcosystemFlags(int argc, char **argv, llvm::StringRef tool,
                         llvm::ArrayRef<llvm::StringRef> destructive);

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_ECOSYSTEMFLAGS_H
