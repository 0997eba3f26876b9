//===- GraphDialect.cpp - MegaSlide graph dialect -------------------------===//

#include "megaslide/Dialect/Graph/GraphOps.h"

using namespace mlir;
using namespace megaslide::graph;

#include "megaslide/Dialect/Graph/GraphDialect.cpp.inc"
#include "megaslide/Dialect/Graph/GraphEnums.cpp.inc"
#include "megaslide/Dialect/Graph/GraphInterfaces.cpp.inc"

void GraphDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "megaslide/Dialect/Graph/GraphOps.cpp.inc"
      >();
}
