//===- ScheduleDialect.cpp - MegaSlide schedule dialect -------------------===//

#include "megaslide/Dialect/Schedule/ScheduleOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace megaslide::schedule;

#include "megaslide/Dialect/Schedule/ScheduleDialect.cpp.inc"
#include "megaslide/Dialect/Schedule/ScheduleEnums.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "megaslide/Dialect/Schedule/ScheduleTypes.cpp.inc"

void ScheduleDialect::initialize() {
  addTypes<
#define GET_TYPEDEF_LIST
#include "megaslide/Dialect/Schedule/ScheduleTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "megaslide/Dialect/Schedule/ScheduleOps.cpp.inc"
      >();
}
