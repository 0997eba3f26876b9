//===- Passes.h - MegaSlide planning passes ---------------------*- C++ -*-===//

#ifndef MEGASLIDE_TRANSFORMS_PASSES_H
#define MEGASLIDE_TRANSFORMS_PASSES_H

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Support/Units.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

namespace megaslide {

#define GEN_PASS_DECL
#include "megaslide/Transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "megaslide/Transforms/Passes.h.inc"

} // namespace megaslide

#endif // MEGASLIDE_TRANSFORMS_PASSES_H
