//===- megaslide-exec.cpp - Run a saved execution plan --------------------===//
//
// The runtime-only executor: megaslide-run's run driver (RunDriver.h)
// without the compiler, so it links no MLIR and, in the runtime-only
// build, no shared LLVM (docs/Runtime.md, "A runtime without MLIR").
//
//===----------------------------------------------------------------------===//

#include "megaslide/Tools/RunDriver.h"

int main(int argc, char **argv) {
  megaslide::tools::RunTool tool;
  tool.name = "megaslide-exec";
  tool.overview =
      "megaslide-exec: train with a saved execution plan (compiled "
      "elsewhere by megaslide-run --save-plan)\n\n"
      "Example:\n  megaslide-exec --plan tiny.json --backend cuda --steps 200";
  return megaslide::tools::runMain(argc, argv, tool);
}
