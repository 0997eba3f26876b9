//===- ScheduleOps.h - MegaSlide schedule dialect ---------------*- C++ -*-===//

#ifndef MEGASLIDE_SCHEDULE_SCHEDULEOPS_H
#define MEGASLIDE_SCHEDULE_SCHEDULEOPS_H

#include "dialects/Graph/GraphOps.h"
#include "megaslide/runtime/plan/Stream.h"

#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"

namespace megaslide::schedule {

/// Discardable attributes written by the planning passes.
inline constexpr llvm::StringLiteral kStreamAttrName = "msched.stream";
/// On the module: the pinned gradient buffers megaslide-schedule-overlap
/// sized "gradient_staging" for (the plan's gradient_buffers).
inline constexpr llvm::StringLiteral kGradientBuffersAttrName =
    "msched.gradient_buffers";
inline constexpr llvm::StringLiteral kOffsetsAttrName = "msched.offsets";
inline constexpr llvm::StringLiteral kWorkspaceAttrName = "msched.workspace";
inline constexpr llvm::StringLiteral kCheckpointAttrName = "msched.checkpoint";
/// A forward op cloned in front of its block's backward (recompute): the
/// report counts its FLOPs apart from the model's.
inline constexpr llvm::StringLiteral kRecomputeAttrName = "msched.recompute";

/// The stream of a scheduled op: its `msched.stream`, an i32 holding an
/// exec::Stream; none when absent or not a stream.
std::optional<exec::Stream> getStream(mlir::Operation *op);
/// The `msched.stream` value of `stream`.
mlir::IntegerAttr getStreamAttr(mlir::MLIRContext *context,
                                exec::Stream stream);

} // namespace megaslide::schedule

#include "dialects/Schedule/ScheduleDialect.h.inc"
#include "dialects/Schedule/ScheduleEnums.h.inc"

#define GET_TYPEDEF_CLASSES
#include "dialects/Schedule/ScheduleTypes.h.inc"

#define GET_OP_CLASSES
#include "dialects/Schedule/ScheduleOps.h.inc"

#endif // MEGASLIDE_SCHEDULE_SCHEDULEOPS_H
