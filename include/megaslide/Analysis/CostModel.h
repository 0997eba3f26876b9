//===- CostModel.h - What each op of a scheduled step costs -----*- C++ -*-===//
//
// The cost inputs of an op of the planned `@train_step` (FLOPs by category,
// bytes moved) and its time on a hardware description. The description and
// the formula live in the runtime (runtime/sim/HardwareModel.h), shared with
// the sim backend: the planner derives CostInputs from the IR here, the
// execution-plan exporter stores the same CostInputs in the plan, and both
// time them with sim::secondsFor.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_COSTMODEL_H
#define MEGASLIDE_ANALYSIS_COSTMODEL_H

#include "sim/HardwareModel.h"

#include "mlir/IR/Operation.h"
#include "mlir/IR/SymbolTable.h"

namespace megaslide {

using sim::HardwareModel;
using sim::loadHardwareModel;
using sim::parseHardwareModel;
using sim::toJson;

/// Bytes of a ranked tensor type.
uint64_t tensorBytes(mlir::Type type);

/// The execution-plan op (runtime/plan/Ops.def) of a `megaslide` or
/// `msched` op, or nullopt for the ops a plan does not carry (params,
/// host-state access, packing, budget checks, joins, the terminator).
std::optional<exec::OpCode> planOpOf(mlir::Operation *op);

/// Which formula of sim::secondsFor times `op`: a plan op as Ops.def says
/// (sim::costKindOf); the graph ops the plan does not carry (load, store,
/// adamw, before insert-transfers) as device kernels; every other op is no
/// work.
sim::CostKind costKindOf(mlir::Operation *op);

/// What `op` of a scheduled training step does, as the execution plan
/// records it: FLOPs by category (graph ops with FlopCountOpInterface;
/// 14 per parameter for `msched.host_adamw`), bytes read and written
/// through HBM (graph ops but reshape, a view), copied over PCIe (`fetch`,
/// `h2d`, `d2h`: result bytes) and, for a fetch, the bytes of the
/// persistent tensor read on the host. Zero for ops that do no work.
/// `symbols` caches the lookups of fetched parameters across calls.
exec::CostInputs costInputsOf(mlir::Operation *op,
                              mlir::SymbolTableCollection &symbols);

/// Where an op's time goes on `hw`.
struct OpCost {
  uint64_t flops = 0;
  uint64_t bytes = 0; ///< moved through HBM, PCIe or host memory
  double seconds = 0;
};

/// costInputsOf, timed by sim::secondsFor; an op whose first result is
/// fp32 runs its tensor work at `f32_dense_flops`.
OpCost costOf(mlir::Operation *op, const HardwareModel &hw,
              mlir::SymbolTableCollection &symbols);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_COSTMODEL_H
