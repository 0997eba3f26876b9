//===- GraphDialect.cpp - MegaSlide graph dialect -------------------------===//

#include "Graph/GraphOps.h"

using namespace mlir;
using namespace megaslide::graph;

#include "Graph/GraphDialect.cpp.inc"
#include "Graph/GraphEnums.cpp.inc"
#include "Graph/GraphInterfaces.cpp.inc"

void GraphDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "Graph/GraphOps.cpp.inc"
      >();
}
