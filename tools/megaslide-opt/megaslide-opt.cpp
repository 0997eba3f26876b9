//===- megaslide-opt.cpp - MegaSlide optimizer driver ---------------------===//
//
// mlir-opt for MegaSlide: every dialect and pass of the project, plus the
// upstream passes a pipeline author needs (canonicalize, cse, ...).
//
//===----------------------------------------------------------------------===//

#include "Graph/GraphOps.h"
#include "Schedule/ScheduleOps.h"
#include "megaslide/Pipelines/Pipelines.h"
#include "megaslide/Transforms/Passes.h"
#include "megaslide/Version.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

namespace megaslide::test {
void registerTestPasses();
} // namespace megaslide::test

int main(int argc, char **argv) {
  megaslide::addVersionPrinter("megaslide-opt");
  mlir::registerTransformsPasses();
  megaslide::registerMegaSlidePasses();
  megaslide::registerPipelines();
  megaslide::test::registerTestPasses();

  mlir::DialectRegistry registry;
  registry.insert<megaslide::graph::GraphDialect,
                  megaslide::sched::ScheduleDialect, mlir::func::FuncDialect>();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "MegaSlide optimizer driver\n", registry));
}
