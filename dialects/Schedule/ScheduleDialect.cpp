//===- ScheduleDialect.cpp - MegaSlide schedule dialect -------------------===//

#include "Schedule/ScheduleOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace megaslide::sched;

#include "Schedule/ScheduleDialect.cpp.inc"
#include "Schedule/ScheduleEnums.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "Schedule/ScheduleTypes.cpp.inc"

void ScheduleDialect::initialize() {
  addTypes<
#define GET_TYPEDEF_LIST
#include "Schedule/ScheduleTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "Schedule/ScheduleOps.cpp.inc"
      >();
}
