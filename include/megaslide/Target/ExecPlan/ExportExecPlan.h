//===- ExportExecPlan.h - Scheduled IR -> execution plan --------*- C++ -*-===//
//
// The last step of the compilation flow: the training step after
// `megaslide-pipeline` becomes the flat, serialisable program the runtime
// executes (runtime/plan/ExecPlan.h, docs/ExecutionPlan.md).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H
#define MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H

#include "plan/ExecPlan.h"

#include "megaslide/Pipelines/Plan.h"

#include "mlir/IR/BuiltinOps.h"

namespace megaslide {

/// Translates the scheduled `@train_step` of `module` (every op on a
/// stream, device values at arena offsets, one msched.pack) and its
/// parameter declarations into an execution plan, with the CUDA sources of
/// its 3D-DSA configurations. The model fields (model, modelConfig, grid,
/// batch) are left for the caller. The result is validated; a module the
/// runtime could not execute gives an error naming the op.
llvm::Expected<exec::ExecPlan> exportExecPlan(mlir::ModuleOp module);

/// Compiles `model` at `video` into a validated execution plan: builds the
/// training step, runs megaslide-pipeline, exports it, fills in the model
/// fields and passes the text through the runtime's loader, so what is run
/// is exactly what a saved plan file would give. A plan over its budgets is
/// an error listing the violations, with `*overBudget` set.
llvm::Expected<exec::ExecPlan>
compileExecPlan(mlir::MLIRContext &context, llvm::StringRef model,
                const VideoShape &video, const TrainingOptions &training,
                const PlanOptions &options, bool *overBudget = nullptr);

/// Registers `megaslide-translate --emit-exec-plan`.
void registerExportExecPlanTranslation();

} // namespace megaslide

#endif // MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H
