//===- HardwareFlag.h - The --hw flag ---------------------------*- C++ -*-===//
//
// The hardware description the planner times a plan with and the sim
// backend replays it on: one flag of megaslide-plan, megaslide-run and
// megaslide-exec.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TOOLS_COMMON_HARDWAREFLAG_H
#define MEGASLIDE_TOOLS_COMMON_HARDWAREFLAG_H

#include "llvm/Support/CommandLine.h"

#include <string>

namespace megaslide::tools {

extern llvm::cl::OptionCategory hardwareCategory;
/// A JSON hardware description (docs/CostModel.md); empty: the built-in
/// H200 with 1.5 TB of host memory.
extern llvm::cl::opt<std::string> hardwareFile;

} // namespace megaslide::tools

#endif // MEGASLIDE_TOOLS_COMMON_HARDWAREFLAG_H
