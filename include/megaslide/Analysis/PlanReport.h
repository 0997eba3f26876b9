//===- PlanReport.h - What a planned training step costs --------*- C++ -*-===//
//
// Reads a module after `megaslide-pipeline` and reports host and device
// memory by category and per block, transfer volume, and the step time
// predicted by replaying its execution plan on a hardware model, next to
// its lower bound. Rendered as text and JSON (docs/PlanSchema.md) by
// lib/Report.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_PLANREPORT_H
#define MEGASLIDE_ANALYSIS_PLANREPORT_H

#include "dialects/Schedule/SchedulePolicies.h"
#include "megaslide/Analysis/CostModel.h"
#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/sim/Timeline.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/Error.h"

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace megaslide {

/// The host buffers of the training recipe, as megaslide-defer-updates
/// declares them (`msched.resource`; category in parentheses).
inline constexpr llvm::StringLiteral kRetainedGradientsResource =
    "retained_gradients"; ///< deferred update, gradients' type
inline constexpr llvm::StringLiteral kGradientAccumulatorResource =
    "gradient_accumulator"; ///< grad-accum > 1, fp32
inline constexpr llvm::StringLiteral kEmaResource = "ema_weights";
/// The host memory the OS and the runtime keep (`os-allowance`), one per
/// node.
inline constexpr llvm::StringLiteral kOsAllowanceResource = "os_allowance";

/// What the recipe's host buffers would take in a module after
/// insert-transfers, whatever the update mode: bytes = trainable
/// parameters x bytes per parameter.
struct RecipeBytes {
  uint64_t trainableParams = 0; ///< elements of the masters host_adamw updates
  /// The gradients as they reach the host AdamW (bf16 plans: 2 B/param,
  /// f32: 4): what the deferred update retains with grad-accum 1.
  uint64_t gradientBytes = 0;
  uint64_t accumulatorBytes = 0; ///< fp32, grad-accum > 1 only
  uint64_t emaBytes = 0;
  /// What the deferred update adds: the retained gradients, or the
  /// accumulator, which holds them when accumulating.
  uint64_t deferredBytes() const {
    return accumulatorBytes ? accumulatorBytes : gradientBytes;
  }
};
struct PlanReport {
  HardwareModel hardware;
  uint64_t gpuBudget = 0, gpuReserve = 0, hostBudget = 0;
  uint64_t arenaBudget = 0; ///< the device arena's share of gpuBudget
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
  /// The gradient ring (exec::layoutHostPool; 0 slots: every host value
  /// has pinned bytes of its own) and what its waits add to the step.
  int64_t gradientRingSlots = 0, gradientRingSlotBytes = 0;
  int64_t gradientCopies = 0;
  sim::IssueWaits issueWaits;
  /// Predicted device time per kernel family (sim::KernelFamily; the
  /// compute stream's busy time split by what the cuda backend launches).
  struct Family {
    double seconds = 0;
    uint64_t instructions = 0, flops = 0, bytes = 0;
  };
  Family byFamily[sim::kNumKernelFamilies] = {};
  /// The elementwise family's predicted time by op (exec::opName).
  std::map<std::string, double> elementwiseByOp;

  /// The training recipe's planning (megaslide-defer-updates): empty
  /// `update` when the module was not planned by it.
  struct Recipe {
    std::string update; ///< "deferred" | "streaming"
    bool chosenByAuto = false;
    std::string reason; ///< why this update mode
    int64_t gradAccum = 1;
    std::string ema = "none";
    RecipeBytes bytes;
    /// Host budget less every host buffer but the recipe's.
    uint64_t hostFreeBytes = 0;
    /// Each update mode planned, the chosen one from this plan and the
    /// other by replaying the program with its marks toggled.
    struct Mode {
      std::string name;
      bool available = true;  ///< streaming cannot accumulate
      uint64_t hostBytes = 0; ///< the recipe's host buffers in this mode
      bool hostFits = false;  ///< hostFreeBytes holds them
      double stepSeconds = 0; ///< replayed step
      double hostOptimizerSeconds = 0; ///< busy time of the host stream
      std::string note;
    };
    Mode deferred, streaming;
    /// The deferred updates in the deferred mode's replay: their summed
    /// AdamW time, when the last ends, when the forward ends (the loss
    /// starts), and the largest block's update against that block's
    /// forward compute time.
    double updateSeconds = 0, updatesEnd = 0, forwardEnd = 0;
    double blockUpdateSeconds = 0, blockForwardSeconds = 0;
    int64_t block = -1; ///< the block with the most update time
    /// Host passes per optimizer step, estimated at host_memory_bandwidth
    /// and not overlapped: (grad-accum - 1) accumulation adds (read the
    /// gradient and the fp32 accumulator, write the accumulator) and the
    /// EMA (read master and EMA, write EMA).
    double accumulateSeconds = 0, emaSeconds = 0;
    /// grad-accum x the replayed step + accumulateSeconds + emaSeconds.
    double optimizerStepSeconds = 0;
    /// Accumulating every gradient on the device instead (fp32, 4 B/param)
    /// next to the planned device peak.
    uint64_t deviceAccumulationBytes = 0;
    bool deviceAccumulationFits = false;
    std::vector<std::string> advice; ///< what to change when it does not fit
  };
  Recipe recipe;

  /// A job of several ranks (megaslide-plan --gpus-per-node, --nodes;
  /// docs/Distributed.md, "Planning a job"). Every other figure of the
  /// report is one rank's, but the host memory, which is one node's
  /// (hostMemoryByCategory).
  struct Job {
    int64_t gpusPerNode = 1, nodes = 1;
    int64_t ranks() const { return gpusPerNode * nodes; }
    /// The comm stream's busy time: the step's all-gathers and
    /// reduce-scatters, ring-priced (sim::ringCollectiveSeconds).
    double collectiveSeconds = 0;
    uint64_t collectiveBytes = 0; ///< bytes each rank sends over its links
    /// The all-reduce of the global gradient norm, once per optimizer step
    /// (sim::allReduceScalarSeconds).
    double normAllReduceSeconds = 0;
    /// One rank's optimizer step: the recipe's optimizer step and the norm
    /// all-reduce.
    double stepSeconds = 0;
    /// Samples of the whole job per second: ranks x batch x grad-accum per
    /// step.
    double samplesPerSecond = 0;
    /// The same model and options planned for one GPU (one rank, the
    /// job's update mode) and replayed the same way (planModel); 0 when
    /// not planned.
    double oneGpuStepSeconds = 0, oneGpuSamplesPerSecond = 0;
    /// samplesPerSecond / (ranks x oneGpuSamplesPerSecond).
    double scalingEfficiency = 0;
    uint64_t hostPerRankBytes = 0; ///< without the node's OS allowance
    uint64_t hostPerNodeBytes = 0; ///< hostTotal
    /// The fewest nodes (with gpus-per-node each) whose host-mem holds the
    /// sharded state; 0 when no number of nodes does.
    int64_t nodesToFitHost = 0;
    std::vector<std::string> advice; ///< what to change when it does not fit
  };
  Job job;

  /// The NVMe tier (megaslide-check-budget: kHostTierAttr): the roles of
  /// host state one node keeps on its drives instead of in host memory,
  /// and what moving them costs in the replay (docs/CostModel.md, "The
  /// NVMe tier"). Empty `roles`: no tier.
  struct Tier {
    std::vector<std::string> roles;
    int64_t drives = 0;
    uint64_t windowBytes = 0; ///< of one rank, counted in hostByCategory
    /// What one node keeps on the drives, by category (as hostByCategory).
    std::vector<std::pair<std::string, uint64_t>> onNvme;
    /// One rank's tier bytes, each read once and written once per step.
    uint64_t bytesPerStep = 0;
    /// Busy time of the replay's I/O lane (reads and writes), and what it
    /// adds to the replayed step: the replay less the one without the I/O.
    double ioSeconds = 0, stepGrowthSeconds = 0;
    /// Whether the I/O hides behind the step: it adds at most 1% of
    /// `stepSeconds`.
    bool hidden(double stepSeconds) const {
      return stepGrowthSeconds <= 0.01 * stepSeconds;
    }
  };
  Tier tier;

  /// When the plan does not fit: each change that could make it fit,
  /// planned again with that change (planModel), smallest change first.
  struct FitOption {
    std::string change;      ///< the flags, "--host-state-policy bf16-moments"
    std::string what;        ///< in words
    bool fits = false;       ///< the re-plan fits every budget
    uint64_t hostBytes = 0;  ///< the re-plan's host memory of one node
    uint64_t hostBudget = 0; ///< the re-plan's host-mem
    double stepSeconds = 0;  ///< the re-plan's optimizer step
    std::string note;        ///< what it costs or why it is not enough
  };
  std::vector<FitOption> fitOptions;

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

RecipeBytes recipeBytes(mlir::ModuleOp module, int64_t gradAccum,
                        schedule::EmaPolicy ema);

/// "retained gradients 211.94 GB (2 B/param), EMA ..." for what the
/// deferred update and the EMA add.
std::string explainDeferredBytes(const RecipeBytes &bytes);
/// What would let the deferred update fit when `shortfall` more host
/// bytes of a node of `module`'s job are needed: the policies that free
/// enough there (bf16 moments, a bf16 EMA), else a larger host; then what
/// streaming gives up.
std::string deferAdvice(mlir::ModuleOp module, uint64_t shortfall,
                        const RecipeBytes &bytes,
                        schedule::HostStatePolicy policy,
                        schedule::EmaPolicy ema);

/// Host memory of one node of a planned module by category, largest
/// first: persistent state by role and every host or pinned
/// `msched.resource`, for each of the node's ranks (hostMemoryPerRank),
/// and the node's OS allowance once.
std::vector<std::pair<std::string, uint64_t>>
hostMemoryByCategory(mlir::ModuleOp module);
/// Host memory of one rank by category, largest first, without the OS
/// allowance: in a job of several ranks each parameter's state is its
/// largest shard (dist::shardRange) and the recipe's buffers (retained
/// gradients, accumulator, EMA) 1/N, rounded up; staging, offloaded
/// checkpoints and the batch are every rank's own.
std::vector<std::pair<std::string, uint64_t>>
hostMemoryPerRank(mlir::ModuleOp module);

/// The NVMe tier a module's budget check chose (kHostTierAttr): the roles
/// (exec::kTierRoles) and one rank's RAM window.
struct HostTier {
  std::vector<std::string> roles;
  uint64_t windowBytes = 0;
  int64_t drives = 0;
};
std::optional<HostTier> hostTierOf(mlir::ModuleOp module);
/// One rank's host bytes of the tierable role `role` ("moment", "ema") of
/// one model (a second expert holds as much again).
uint64_t tierRoleBytesPerRank(mlir::ModuleOp module, llvm::StringRef role);
/// One rank's bytes of the largest parameter's state in `roles`: the unit
/// the host optimizer reads and writes back at once.
uint64_t largestTierParamBytes(mlir::ModuleOp module,
                               llvm::ArrayRef<std::string> roles);
/// What one node keeps on its NVMe drives, by category: its ranks' tiered
/// state (hostMemoryByCategory counts their windows instead).
std::vector<std::pair<std::string, uint64_t>>
nvmeBytesByCategory(mlir::ModuleOp module);

/// What one node holds of host buffers of `bytes` that a job shards over
/// its ranks (the recipe's): its gpus-per-node ranks' shares, 1/N each,
/// rounded up; `bytes` for one GPU.
uint64_t nodeShare(mlir::ModuleOp module, uint64_t bytes);

/// The fewest nodes of the module's gpus-per-node whose `hostBudget` each
/// holds the host state: what a node holds besides the sharded state
/// (every rank's own buffers and the OS allowance) stays, the sharded
/// state's per-node share falls as 1/nodes. 0 when even that does not fit.
int64_t nodesToFitHost(mlir::ModuleOp module, uint64_t hostBudget);

/// Builds the report of a planned module. `program` is the module's
/// training step as exported for the runtime (exportProgram), `origins` the
/// op of each of its instructions: the step time is the sim backend's
/// replay of the program (sim::buildTasks, docs/CostModel.md), so the
/// planner and the backend predict one step. `arenaBudget` is what the
/// arena may use of `gpuBudget` (megaslide::arenaBudget). `violations` are
/// the budget errors the pipeline reported (empty when it fits). Fails
/// when the replay does (sim::buildTasks: e.g. a time that is not finite).
llvm::Expected<PlanReport>
buildPlanReport(mlir::ModuleOp module, const exec::ExecPlan &program,
                llvm::ArrayRef<mlir::Operation *> origins,
                const HardwareModel &hw, uint64_t gpuBudget,
                uint64_t gpuReserve, uint64_t arenaBudget, uint64_t hostBudget,
                std::vector<std::string> violations);

/// Fills `report.recipe` (the report's other fields set) from a module
/// planned by megaslide-defer-updates; nothing for one that was not.
llvm::Error planRecipe(mlir::ModuleOp module, const exec::ExecPlan &program,
                       const HardwareModel &hw, PlanReport &report);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_PLANREPORT_H
