//===- ExportExecPlan.h - Scheduled IR -> execution plan --------*- C++ -*-===//
//
// The last step of the compilation flow: the training step after
// `megaslide-pipeline` becomes the flat, serialisable program the runtime
// executes (include/megaslide/runtime/plan/ExecPlan.h, docs/ExecutionPlan.md).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H
#define MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "mlir/IR/BuiltinOps.h"

namespace megaslide {

/// Translates the scheduled `@train_step` of `module` (every op on a
/// stream, device values at arena offsets, one msched.pack) and its
/// parameter declarations into an execution plan, with the CUDA sources of
/// its 3D-DSA configurations. The model fields (model, modelConfig, grid,
/// batch) are left for the caller. The result is validated; a module the
/// runtime could not execute gives an error naming the op.
llvm::Expected<exec::ExecPlan> exportExecPlan(mlir::ModuleOp module);

/// What the replay of a step reads (sim::buildTasks): exportExecPlan's
/// parameters, values and instructions without the instructions' op
/// attributes (`attrs`) but the deferred-update marks and `param`, the
/// kernel sources or the planned live peak, and not validated. megaslide-plan
/// replays it for its predicted step (buildPlanReport) on every run, where
/// validating 20k instructions would cost a third of planning. `origins`, when
/// given, receives the op each instruction was exported from.
llvm::Expected<exec::ExecPlan>
exportProgram(mlir::ModuleOp module,
              std::vector<mlir::Operation *> *origins = nullptr);

} // namespace megaslide

#endif // MEGASLIDE_TARGET_EXECPLAN_EXPORTEXECPLAN_H
