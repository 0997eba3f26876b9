//===- PlanReport.h - What a planned training step costs --------*- C++ -*-===//
//
// Reads a module after `megaslide-pipeline` and reports host and device
// memory by category and per block, transfer volume, and the step time
// predicted by replaying its execution plan on a hardware model, next to
// its lower bound. Schema: docs/PlanSchema.md.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_PLANREPORT_H
#define MEGASLIDE_ANALYSIS_PLANREPORT_H

#include "megaslide/Analysis/CostModel.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <string>
#include <utility>
#include <vector>

namespace megaslide {

struct PlanReport {
  HardwareModel hardware;
  uint64_t gpuBudget = 0, gpuReserve = 0, hostBudget = 0;
  std::vector<std::string> violations;
  bool fits() const { return violations.empty(); }

  std::string hostStatePolicy;
  std::vector<std::string> activationPolicy; ///< per block

  uint64_t hostTotal = 0;
  /// Host bytes MegaSlide itself uses (all but the OS and runtime
  /// allowance) per parameter.
  double hostBytesPerParam = 0;
  std::vector<std::pair<std::string, uint64_t>> hostByCategory;

  int64_t devicePeak = 0; ///< arena size: the planned device peak
  int64_t peakStep = 0;   ///< op index where live bytes peak
  std::vector<std::pair<std::string, uint64_t>> deviceByCategory;
  /// The largest buffers live at the peak: (bytes, description).
  std::vector<std::pair<uint64_t, std::string>> topConsumers;

  struct Layer {
    int64_t index;
    uint64_t params = 0;
    uint64_t hostBytes = 0;  ///< persistent state of the block
    uint64_t shardBytes = 0; ///< weights fetched per pass
    uint64_t devicePeak = 0; ///< live device bytes while it computes
    uint64_t checkpointBytes = 0;
    std::string activationPolicy;
  };
  std::vector<Layer> layers;

  uint64_t h2dBytes = 0, d2hBytes = 0;
  std::vector<std::pair<std::string, uint64_t>> h2dByKind, d2hByKind;

  /// FLOPs of the compute stream: all of them (recomputation included),
  /// and those of the recomputed forward ops (msched.recompute).
  uint64_t deviceFlops = 0, recomputeFlops = 0;
  /// The step as planned (3D-DSA where rewritten) without recomputation.
  uint64_t modelFlops() const { return deviceFlops - recomputeFlops; }
  /// Model-FLOP utilisation: modelFlops() / (predicted step x the dense
  /// tensor-core peak of the plan's precision).
  double mfu() const {
    return predictedSeconds > 0 && peakFlops > 0
               ? double(modelFlops()) / (predictedSeconds * peakFlops)
               : 0.0;
  }
  double peakFlops = 0;
  double predictedSeconds = 0, lowerBoundSeconds = 0;
  double busySeconds[exec::kNumStreams] = {}; ///< by exec::Stream
  /// Predicted device time per kernel family (sim::KernelFamily; the
  /// compute stream's busy time split by what the cuda backend launches).
  struct Family {
    double seconds = 0;
    uint64_t instructions = 0, flops = 0, bytes = 0;
  };
  Family byFamily[sim::kNumKernelFamilies] = {};

  /// Live device bytes over predicted time, downsampled: (seconds, bytes).
  std::vector<std::pair<double, uint64_t>> memoryTimeline;
  /// Busy intervals per stream, merged per block: (stream, start, end, label).
  struct Interval {
    int stream;
    double start, end;
    std::string label;
  };
  std::vector<Interval> streamTimeline;
};

/// Host memory of a planned module by category, largest first: persistent
/// state by role and every host or pinned `msched.resource`.
std::vector<std::pair<std::string, uint64_t>>
hostMemoryByCategory(mlir::ModuleOp module);

/// Builds the report of a planned module. `program` is the module's
/// training step as exported for the runtime (exportProgram), `origins` the
/// op of each of its instructions: the step time is the sim backend's
/// replay of the program (sim::buildTasks, docs/CostModel.md), so the
/// planner and the backend predict one step. `violations` are the budget
/// errors the pipeline reported (empty when it fits). Fails when the
/// replay does (sim::buildTasks: e.g. a time that is not finite).
llvm::Expected<PlanReport>
buildPlanReport(mlir::ModuleOp module, const exec::ExecPlan &program,
                llvm::ArrayRef<mlir::Operation *> origins,
                const HardwareModel &hw, uint64_t gpuBudget,
                uint64_t gpuReserve, uint64_t hostBudget,
                std::vector<std::string> violations);

/// Adds the report's fields to `out` (docs/PlanSchema.md).
void addToJson(const PlanReport &report, llvm::json::Object &out);
void printText(const PlanReport &report, llvm::raw_ostream &os);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_PLANREPORT_H
