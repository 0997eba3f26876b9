//===- ExecPlanJson.h - The execution plan's file format --------*- C++ -*-===//
//
// Reads and writes an ExecPlan as its JSON text (docs/ExecutionPlan.md).
// Reading checks the format, the version and the release before the
// fields, then validates the plan (Validate.h): what a backend receives
// from here it may rely on.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_EXECPLANJSON_H
#define MEGASLIDE_RUNTIME_PLAN_EXECPLANJSON_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>

namespace megaslide::exec {

/// Parses and validates a plan; `source` names it in errors.
llvm::Expected<ExecPlan> parseExecPlan(llvm::StringRef text,
                                       llvm::StringRef source);
llvm::Expected<ExecPlan> loadExecPlan(llvm::StringRef path);

/// The plan as its JSON text (docs/ExecutionPlan.md).
std::string serialize(const ExecPlan &plan);
/// Writes serialize(plan) to `path` atomically (support/AtomicFile.h): on
/// any error `path` is as it was, and the error names it.
llvm::Error saveExecPlan(const ExecPlan &plan, llvm::StringRef path);

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_EXECPLANJSON_H
