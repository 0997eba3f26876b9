//===- GraphDialect.cpp - MegaSlide graph dialect -------------------------===//

#include "dialects/Graph/GraphOps.h"

using namespace mlir;
using namespace megaslide::graph;

#include "dialects/Graph/GraphDialect.cpp.inc"
#include "dialects/Graph/GraphEnums.cpp.inc"
#include "dialects/Graph/GraphInterfaces.cpp.inc"

void GraphDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "dialects/Graph/GraphOps.cpp.inc"
      >();
}
