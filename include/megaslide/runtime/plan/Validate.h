//===- Validate.h - What a backend may rely on in a plan --------*- C++ -*-===//
//
// A plan is untrusted input (a file anyone may edit): every invariant a
// backend relies on is checked here, once for all backends, by the loader
// (ExecPlanJson.h) and by the exporter on what it wrote
// (docs/ExecutionPlan.md, "Validation").
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_VALIDATE_H
#define MEGASLIDE_RUNTIME_PLAN_VALIDATE_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/Support/Error.h"

namespace megaslide::exec {

/// Checks every invariant a backend relies on: ids and offsets in range,
/// device offsets (values and workspaces) multiples of `alignment`, device
/// bytes inside the arena, batch x grid within kMaxTokensPerStep,
/// operand/result counts and types of each op, AdamW moments matching
/// their parameter and hyper-parameters in range (checkAdamWHyperParameter),
/// events recorded before they are waited on, every read of a value
/// written on another stream ordered after that write by record/wait
/// pairs (directly or transitively), deferred updates marked by their
/// rule (DeferredUpdates.h), no two live device values (or a workspace
/// and a live value) overlapping (the event check is one pass over the
/// instructions). Errors name the instruction and what is wrong.
llvm::Error validate(const ExecPlan &plan);

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_VALIDATE_H
