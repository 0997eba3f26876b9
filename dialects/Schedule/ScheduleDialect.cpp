//===- ScheduleDialect.cpp - MegaSlide schedule dialect -------------------===//

#include "dialects/Schedule/ScheduleOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace megaslide::schedule;

#include "dialects/Schedule/ScheduleDialect.cpp.inc"
#include "dialects/Schedule/ScheduleEnums.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "dialects/Schedule/ScheduleTypes.cpp.inc"

void ScheduleDialect::initialize() {
  addTypes<
#define GET_TYPEDEF_LIST
#include "dialects/Schedule/ScheduleTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Schedule/ScheduleOps.cpp.inc"
      >();
}
