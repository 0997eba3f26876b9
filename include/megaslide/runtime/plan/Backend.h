//===- Backend.h - What every runtime backend provides ----------*- C++ -*-===//
//
// A backend executes one training step of an execution plan against the
// host state: cpu (reference numerics, tracking arena), cuda (the GPU) and
// sim (predicted timing only). The trainer (runtime/train) drives them all
// through this interface. The backends that compute give a step the
// meaning of plan/StepRunner.h, over their own device primitives.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_BACKEND_H
#define MEGASLIDE_RUNTIME_PLAN_BACKEND_H

#include "megaslide/runtime/host/HostOptimizer.h"
#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace megaslide::exec {

/// The step's inputs by argument name (latents, noise, timesteps,
/// condition, ...) as fp32 host arrays in the plan's shapes; integer inputs
/// hold exact small integers. The optimizer step counter ("step") is
/// supplied by the backend from HostState::step.
using StepInputs = std::map<std::string, std::vector<float>>;

/// One span of work for the trace: `start` and `seconds` are measured
/// (cpu, cuda) or predicted (sim), relative to the step's start.
struct TraceSpan {
  Stream stream;
  std::string name;
  double start = 0, seconds = 0;
  int64_t instruction = -1;
  std::optional<int64_t> layer;
  uint64_t bytes = 0, flops = 0;
};

/// The name every backend gives an instruction's span: the op, and the
/// parameter of a fetch or host_adamw ("fetch blocks.0.norm1.weight").
inline std::string spanName(const Instruction &inst) {
  std::string name = opName(inst.op);
  if (!inst.param.empty())
    name += " " + inst.param;
  return name;
}

/// The span of instruction `i` that ran from `start` for `seconds`.
inline TraceSpan instructionSpan(const Instruction &inst, int64_t i,
                                 double start, double seconds) {
  TraceSpan span;
  span.stream = inst.stream;
  span.name = spanName(inst);
  span.start = start;
  span.seconds = seconds;
  span.instruction = i;
  span.layer = inst.layer;
  span.flops =
      inst.cost.matmulFlops + inst.cost.attentionFlops + inst.cost.otherFlops;
  span.bytes = inst.cost.bytes;
  return span;
}

/// Device memory of a step: what the plan promised and what the backend
/// measured (cpu: its tracking arena; cuda: the same bookkeeping on the
/// real arena; sim: replayed).
struct MemoryStats {
  int64_t plannedArenaBytes = 0, measuredArenaBytes = 0;
  int64_t plannedLiveBytes = 0, measuredLiveBytes = 0;
};

struct StepResult {
  float loss = 0;
  /// A weighted loss's unweighted one (the plan's second output).
  std::optional<float> unweightedLoss;
  /// The squared global L2 norm of the gradients the step updated with
  /// (before StepOptions::gradScale), summed per gradient in double and
  /// over gradients in plan order; NaN or infinite when one is not finite.
  /// 0 when the step updated nothing (a deferred step: the trainer sums).
  double gradSquaredNorm = 0;
  /// The loss was NaN or infinite, so no update was applied and the state
  /// (step included) is as before (docs/Runtime.md, "Non-finite values").
  bool skipped = false;
  double seconds = 0; ///< wall time (cpu, cuda) or predicted time (sim)
  MemoryStats memory;
  std::vector<TraceSpan> spans; ///< filled when StepOptions::trace is set
};

using host::HostGradient;

struct StepOptions {
  /// Apply the host AdamW updates; without, the step only computes the
  /// gradients (parity tests, gradient inspection, the deferred update).
  bool applyUpdates = true;
  bool trace = false;
  /// The learning rate of this step's updates (a schedule's); unset: the
  /// host_adamw's own.
  std::optional<double> lr;
  /// Multiplies every gradient before its update (clipping by the
  /// previous step's norm).
  float gradScale = 1;
  /// Called as each run of the plan (a micro-batch) begins, before
  /// anything of it is issued: tests start a fake device's per-run checks.
  std::function<void()> onRunStart;
  /// Called with each parameter's gradient (fp32) as it reaches the host.
  std::function<void(llvm::StringRef, llvm::ArrayRef<float>)> onGradient;
  /// The trainer's deferred update (docs/Training.md): receives each
  /// host_adamw's gradient as it reaches the host, in its planned dtype,
  /// instead of an update (set applyUpdates false;
  /// host::HostOptimizer::retain). Called once per host_adamw, possibly
  /// from another thread and concurrently for distinct parameters.
  std::function<void(const Instruction &, const HostGradient &)> retainGradient;
  /// Called before a fetch reads its parameter's fp32 master, on the
  /// thread that reads it, so that a pending deferred update lands first
  /// (host::HostOptimizer::applyPending).
  std::function<void(llvm::StringRef param)> beforeFetch;
  /// Writes the whole of a master sharded over a job's ranks, in the
  /// fetch's dtype, into its device buffer (host::gatherWhole); then
  /// called, after beforeFetch, instead of a cast. A collective: a device
  /// that fetches on the issuing thread, in plan order, only.
  std::function<llvm::Error(const host::HostTensor &, DType, void *dst)>
      gatherFetch;
  /// Called with the model's prediction, the `prediction` operand of the
  /// flow_matching_loss op ([B, C, T, H, W], widened to fp32), when the
  /// step computes it: the forward of Trainer.predict, checked against
  /// other implementations (diffusers). The cpu backend only; the cuda
  /// backend refuses a step that sets it.
  std::function<void(llvm::ArrayRef<int64_t> shape, llvm::ArrayRef<float>)>
      onPrediction;
};

/// Where the step's loss is computed: the value and the instruction
/// defining it. The plan's output is often a device-to-host copy placed
/// at the end of the step; the device value it copies exists as soon as
/// the forward pass ends, before any gradient reaches the host optimizer,
/// so the step runner reads that one to skip a step with a non-finite loss
/// before anything is updated. {-1, -1} when the plan returns nothing.
inline std::pair<int64_t, int64_t> lossSource(const ExecPlan &plan) {
  if (plan.outputs.empty())
    return {-1, -1};
  int64_t id = plan.outputs[0], def = -1;
  for (int64_t i = static_cast<int64_t>(plan.instructions.size()) - 1; i >= 0;
       --i) {
    const Instruction &inst = plan.instructions[i];
    if (std::find(inst.results.begin(), inst.results.end(), id) ==
        inst.results.end())
      continue;
    def = i;
    if ((inst.op != OpCode::DeviceToHost && inst.op != OpCode::HostToDevice) ||
        inst.operands.size() != 1)
      break;
    id = inst.operands[0]; // a copy: look for where its source is made
  }
  return {id, def};
}

/// Where a step can skip on a non-finite loss before anything is
/// updated: the loss (lossSource) and the instruction defining it, made
/// before the first host_adamw, whose index is given too (-1: none). `def`
/// is -1 when there is no such point (no update, or one before the loss:
/// the loss is then checked after the step).
struct LossGuard {
  int64_t value = -1, def = -1, firstUpdate = -1;
};
inline LossGuard lossGuard(const ExecPlan &plan) {
  LossGuard g;
  for (size_t i = 0; i < plan.instructions.size() && g.firstUpdate < 0; ++i)
    if (plan.instructions[i].op == OpCode::HostAdamW)
      g.firstUpdate = static_cast<int64_t>(i);
  std::tie(g.value, g.def) = lossSource(plan);
  if (g.def < 0 || g.def > g.firstUpdate)
    g.def = -1;
  return g;
}

class Backend {
public:
  virtual ~Backend() = default;
  virtual const char *name() const = 0;
  /// Whether steps compute numbers (cpu, cuda) or only timing (sim).
  virtual bool computesLoss() const { return true; }
  virtual llvm::Expected<StepResult> step(const StepInputs &inputs,
                                          host::HostState &state,
                                          const StepOptions &options) = 0;
};

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_BACKEND_H
