//===- SimBackend.h - Predicted timing of an execution plan -----*- C++ -*-===//
//
// The sim backend: replays one step of an execution plan on a hardware
// description, with no device and no numerics (docs/CostModel.md, "The
// replay"). megaslide-plan's predicted step is the same replay of the
// planned module exported in memory (buildPlanReport), so for a plan
// compiled from a module this backend predicts what `megaslide-plan`
// predicts for that module.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SIM_SIMBACKEND_H
#define MEGASLIDE_RUNTIME_SIM_SIMBACKEND_H

#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/HostPool.h"
#include "megaslide/runtime/sim/HardwareModel.h"
#include "megaslide/runtime/sim/Timeline.h"
#include "megaslide/runtime/trace/ChromeTrace.h"

#include "llvm/Support/Error.h"

#include <memory>
#include <vector>

namespace megaslide::sim {

/// The replay's tasks, one per instruction, in program order:
///  * an instruction runs on its stream for secondsFor(plan, inst, hw);
///  * it depends on the instructions defining the values it reads;
///  * it writes the arena bytes of its device results and of its workspace
///    (a reshape, a view, writes nothing);
///  * each device buffer (a value with its views) is released by its last
///    reader in program order, once the buffer's producer and all its
///    readers have ended; a buffer the step returns is never released, and
///    a workspace is released by its instruction;
///  * `record` is a zero-length task on its stream (it is reached when the
///    work issued before it there has ended) and `wait` a zero-length task
///    on its stream that depends on the record of its event, so later work
///    on that stream starts after the event.
/// In a plan with deferred updates (exec::kDeferredAttr) a deferred
/// host_adamw retains its gradient (secondsFor), and one more task, on the
/// host stream and timed as that host_adamw, precedes the fetch that
/// applies its update; the fetch depends on it. The step's replay stands
/// for a step in a run: the updates are those of the step before. A plan
/// with an NVMe tier (host_tier) adds the tier's reads and writes around
/// those updates on an I/O lane (StepTasks::tierBytes).
/// Errors name the instruction when ids, views or events are out of range;
/// everything else is for exec::validate to check.
struct StepTasks {
  std::vector<Task> tasks;
  /// Per instruction, the index of its task; empty when they are the same
  /// (no deferred updates).
  std::vector<int64_t> taskOf;
  /// The deferred updates' tasks, in program order, with the fetch that
  /// applies each and the host_adamw it defers (instruction indices).
  struct Update {
    int64_t task, fetch, hostAdamW;
  };
  std::vector<Update> updates;
  /// The gradient ring the cuda backend lays out (exec::HostPoolLayout; 0
  /// slots: host values have bytes of their own), whose waits the tasks
  /// carry.
  int64_t ringSlots = 0, ringSlotBytes = 0;
  /// The NVMe tier's bytes the step reads (and writes again) on its I/O
  /// lane (Task::io): in a plan with a host_tier, each update of a
  /// parameter with tiered state reads it before and writes it after
  /// (insertTierIo in SimBackend.cpp).
  uint64_t tierBytes = 0;
};
/// `hostPoolNoReuseBytes` is the cuda backend's (CudaOptions): host values
/// laid out as it lays them out (exec::layoutHostPool).
llvm::Expected<StepTasks>
buildTasks(const exec::ExecPlan &plan, const HardwareModel &hw,
           int64_t hostPoolNoReuseBytes = exec::kHostPoolNoReuseBytes);
/// What the issuing thread's waits for the host stream cost in `step`
/// (IssueWaits).
/// `makespan`: the replay of `step` as it is (already made by the caller).
IssueWaits issueWaits(const StepTasks &step, double hostBandwidth,
                      double makespan);

/// The makespan of `step` replayed with the NVMe tier's transfers taking
/// no time: what the step would take were the tier's I/O free.
double withoutTierIo(const StepTasks &step, double hostBandwidth);

/// The replay of `step`'s tasks per instruction: each instruction's start
/// and end are its task's; busy times and the makespan are all tasks'.
Timeline perInstruction(const Timeline &timeline, const StepTasks &step);

struct SimResult {
  double makespan = 0;   ///< predicted step time, seconds
  double lowerBound = 0; ///< busy time of the busiest stream
  double busy[exec::kNumStreams] = {};
  exec::Stream boundBy = exec::Stream::Compute; ///< the busiest stream
  /// Per instruction, seconds from the start of the step.
  std::vector<double> start, end;
  uint64_t deviceFlops = 0;            ///< of compute-stream instructions
  uint64_t h2dBytes = 0, d2hBytes = 0; ///< copied over PCIe
  int64_t arenaHighWater = 0; ///< one past the highest arena byte written
  /// Most device bytes occupied at one time: a buffer holds its bytes from
  /// its producer's start until its release, a workspace during its
  /// instruction.
  int64_t peakLiveBytes = 0;
  /// The replayed deferred updates: the fetch that applies each, the
  /// host_adamw it defers, and when it runs.
  struct Update {
    int64_t fetch, hostAdamW;
    double start, end;
  };
  std::vector<Update> updates;
  IssueWaits issueWaits;
  /// The NVMe tier (StepTasks::tierBytes): bytes read and again written,
  /// the I/O lane's busy time, and the step time it adds (the makespan
  /// less withoutTierIo's).
  uint64_t tierBytes = 0;
  double ioBusy = 0, tierGrowth = 0;
};

/// Replays one step of `plan` on `hw`. With `trace`, adds a complete event
/// per instruction but record and wait (named like the cpu backend's:
/// the op, and the parameter of a fetch or host_adamw), a "device memory"
/// counter, and otherData (backend, hardware, prediction); the caller
/// finishes the trace.
llvm::Expected<SimResult>
simulateStep(const exec::ExecPlan &plan, const HardwareModel &hw,
             trace::ChromeTrace *trace = nullptr,
             int64_t hostPoolNoReuseBytes = exec::kHostPoolNoReuseBytes);

/// The trace spans of a replayed step, in program order.
std::vector<exec::TraceSpan> traceSpans(const exec::ExecPlan &plan,
                                        const SimResult &result);

/// exec::Backend over simulateStep: every step takes the predicted time and
/// leaves the host state untouched; the loss is not computed.
class SimBackend final : public exec::Backend {
public:
  /// Replays the plan once (the timing does not depend on the data).
  static llvm::Expected<std::unique_ptr<SimBackend>>
  create(const exec::ExecPlan &plan, HardwareModel hw);

  const char *name() const override { return "sim"; }
  bool computesLoss() const override { return false; }
  /// `seconds` is the predicted step, `memory` the replayed arena high-water
  /// mark and peak of occupied bytes, `spans` the predicted instructions.
  llvm::Expected<exec::StepResult>
  step(const exec::StepInputs &inputs, host::HostState &state,
       const exec::StepOptions &options) override;

  const SimResult &result() const { return sim; }
  const HardwareModel &hardware() const { return hw; }

private:
  SimBackend(const exec::ExecPlan &plan, HardwareModel hw, SimResult sim)
      : plan(plan), hw(std::move(hw)), sim(std::move(sim)) {}
  const exec::ExecPlan &plan;
  HardwareModel hw;
  SimResult sim;
};

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_SIMBACKEND_H
