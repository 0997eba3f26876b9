//===- CostModel.h - What each op of a scheduled step costs -----*- C++ -*-===//
//
// The cost inputs of an op of the planned `@train_step` (FLOPs by category,
// bytes moved). The hardware description and the formula that times them
// live in the runtime (include/megaslide/runtime/sim/HardwareModel.h): the execution-plan
// exporter stores these CostInputs in the plan, and the sim backend's
// replay of it, which megaslide-plan's report runs too, times them with
// sim::secondsFor.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_COSTMODEL_H
#define MEGASLIDE_ANALYSIS_COSTMODEL_H

#include "megaslide/runtime/sim/HardwareModel.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Operation.h"
#include "mlir/IR/SymbolTable.h"

namespace megaslide {

using sim::HardwareModel;
using sim::loadHardwareModel;
using sim::parseHardwareModel;
using sim::toJson;

/// Bytes of a ranked tensor type.
uint64_t tensorBytes(mlir::Type type);

/// The job a step is planned for: `gpus-per-node` ranks on each of
/// `nodes` nodes. megaslide-insert-transfers records a job of several
/// ranks on the module (kGpusPerNodeAttr, kNodesAttr); a module without
/// them is one GPU's.
struct JobSize {
  int64_t gpusPerNode = 1, nodes = 1;
  int64_t ranks() const { return gpusPerNode * nodes; }
};
inline constexpr llvm::StringLiteral kGpusPerNodeAttr = "msched.gpus_per_node";
inline constexpr llvm::StringLiteral kNodesAttr = "msched.nodes";
JobSize jobSizeOf(mlir::ModuleOp module);

/// Bytes of the largest rank's shard (rank 0's, dist::shardRange: balanced,
/// 16-element aligned) of a tensor of `type` over `ranks` ranks.
uint64_t shardBytes(mlir::Type type, int64_t ranks);
/// Host bytes of persistent state `param` (a graph.param) on the largest
/// rank of a job of `ranks`: its type's, except an AdamW moment of a
/// policy that does not store it as its type says (int8-moments,
/// factored-moments: schedule::momentBytes; planned for one rank only).
uint64_t hostParamBytes(mlir::Operation *param, int64_t ranks = 1);
/// Bytes a fetch, h2d or d2h copies: its rank's shard when it is marked
/// with `ranks` (a job of several ranks), else its whole result.
uint64_t transferBytes(mlir::Operation *op);

/// The execution-plan op (include/megaslide/runtime/plan/Ops.def) of a `megaslide` or
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
/// `h2d`, `d2h`: transferBytes) and, for a fetch, the bytes of the
/// persistent tensor (its shard) read on the host; a collective's whole
/// tensor and its job. Zero for ops that do no work.
/// `symbols` caches the lookups of fetched parameters across calls.
exec::CostInputs costInputsOf(mlir::Operation *op,
                              mlir::SymbolTableCollection &symbols);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_COSTMODEL_H
