//===- StepRunner.h - One step's semantics over device primitives -*- C++
//-*-===//
//
// A training step, written once for every backend that computes
// (docs/Runtime.md, "The step runner and device primitives"): the
// StepRunner walks the plan in program order and owns what the step means
// (staging the inputs, the "step" input, the host_adamw semantics, the
// loss guard that skips a step with a non-finite loss, the commit of the
// host state, the trace), and a backend implements only exec::Device: bind
// values at their planned places, copy, launch a graph op, record and wait
// for events, run host work on its host stream, read values back and
// synchronise. The cpu backend's device does each primitive before it
// returns; the cuda backend's issues them on streams and a host worker
// thread, so the same walk overlaps as its streams allow.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_STEPRUNNER_H
#define MEGASLIDE_RUNTIME_PLAN_STEPRUNNER_H

#include "megaslide/runtime/plan/Backend.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace megaslide::exec {

/// "instruction #i ('op'): msg".
llvm::Error instError(size_t i, const Instruction &inst,
                      const llvm::Twine &msg);

/// The first failure of a step's host stream, shared by the runner and the
/// device: once set, host work still queued does nothing and the runner
/// issues nothing more. Thread-safe.
class StepStatus {
public:
  /// Records `message` unless a failure is recorded already.
  void fail(const std::string &message);
  bool failed() const { return failedFlag.load(); }
  std::string message() const;
  void reset();

private:
  mutable std::mutex mu;
  std::string first;
  std::atomic<bool> failedFlag{false};
};

/// What the k-th fetch of a step casts: the fp32 master, and work to run
/// right before the cast, on whatever thread casts (a deferred update of
/// that master landing: StepOptions::beforeFetch). `master` holds the
/// fetch result's elements [begin, begin + count): all of them, or in a
/// job's plan (a fetch marked `ranks`) the rank's shard, which the
/// fetch's all_gather completes on the device. A master sharded over a
/// job's ranks fetched by a plan of one rank has `gather` instead, which
/// writes the fetch's result whole on the host.
struct FetchSource {
  const float *master = nullptr;
  int64_t begin = 0, count = 0;
  std::function<void()> before;
  std::function<llvm::Error(void *dst)> gather;
};

/// What the runner tells a device as a step begins.
struct StepSetup {
  std::vector<FetchSource> fetches; ///< the plan's fetches, program order
  bool trace = false;               ///< the runner will ask for timeOf()
  StepStatus *status = nullptr;     ///< valid until endStep() returns
};

/// The primitives a backend implements for the StepRunner; no semantics.
/// Instruction primitives are called in program order from one thread
/// and may return before their work is done (an asynchronous device);
/// they honour the plan's streams and events and whatever other ordering
/// the device needs to run the plan as if in program order.
class Device {
public:
  virtual ~Device();
  virtual const char *name() const = 0;
  /// Every primitive's work is done when it returns (cpu, the test
  /// backend): the runner may read values between instructions and times
  /// each instruction with its own clock. An asynchronous device times
  /// its instructions itself (timeOf).
  virtual bool synchronous() const = 0;

  /// The host bytes of input or host value `id` (home Input or Host):
  /// the runner writes the step's inputs there and reads gradients there
  /// once the host_adamw reading them runs.
  virtual uint8_t *hostData(int64_t id) = 0;

  /// A step begins: nothing of an earlier step is in flight.
  virtual llvm::Error beginStep(StepSetup setup) = 0;
  /// Instruction `i`'s results and workspace become live at their planned
  /// places, before it is issued.
  virtual llvm::Error allocate(size_t i) = 0;
  /// After instruction `i`: its workspace and the values in `dead` (their
  /// last use was `i`) are free.
  virtual void release(size_t i, llvm::ArrayRef<int64_t> dead) = 0;

  /// Fetch `i`, the k-th of the step: StepSetup::fetches[k] cast to the
  /// result's dtype and copied into it (after `before`).
  virtual llvm::Error fetch(size_t i, size_t k) = 0;
  /// A host_to_device or device_to_host copy; a device_to_host marked
  /// `ranks` copies the rank's shard (dist::shardRange) to the start of its
  /// result (exec::hostValueBytes).
  virtual llvm::Error copy(size_t i) = 0;
  /// A job's collective (all_gather, reduce_scatter) in place on its
  /// operand's bytes. Only a device with device collectives runs a job's
  /// plan; the default is that refusal.
  virtual llvm::Error collective(size_t i);
  /// A graph op: its kernels (nothing for a view).
  virtual llvm::Error launch(size_t i) = 0;
  /// A record of a plan event on the instruction's stream.
  virtual llvm::Error record(size_t i) = 0;
  /// A wait of the instruction's stream for a plan event.
  virtual llvm::Error wait(size_t i) = 0;
  /// Host-stream instruction `i` (a host_adamw): `work` runs once what `i`
  /// waits for is done, in program order with the host stream's other
  /// instructions, possibly on another thread; not at all once the step's
  /// status has failed.
  virtual llvm::Error runOnHost(size_t i, std::function<void()> work) = 0;

  /// Issued right after the instruction defining scalar value `id`, on
  /// its `stream`: makes the value readable by awaitValue while the step
  /// goes on. One value at a time.
  virtual llvm::Error captureValue(int64_t id, Stream stream) = 0;
  /// The bytes of the captured value, once computed; from host work.
  virtual llvm::Error awaitValue(int64_t id, void *dst) = 0;

  /// Waits until nothing of the step is in flight (host work included),
  /// whatever happened; an error of the device's own.
  virtual llvm::Error endStep() = 0;
  /// The bytes of value `id`: a scalar after endStep(), or on a
  /// synchronous device any value its last writer has written.
  virtual llvm::Error readValue(int64_t id, void *dst) = 0;
  /// After endStep(), on an asynchronous device tracing the step: when
  /// device-stream instruction `i` ran, {start, seconds} from the step's
  /// start; nullopt when unknown.
  virtual std::optional<std::pair<double, double>> timeOf(size_t i);
  /// The step's measured device memory (MemoryStats::measured*).
  virtual void measureMemory(MemoryStats &stats) = 0;
};

/// The refusal of a plan for a job of several ranks by a backend without
/// device collectives (cpu: it does a job's collectives on the host, over
/// one rank's plan), naming its first collective.
llvm::Error checkOneRank(const ExecPlan &plan, llvm::StringRef backend);

/// Runs steps of one plan on one device: the semantics of
/// exec::Backend::step (StepOptions, StepResult) for every device.
class StepRunner {
public:
  StepRunner(const ExecPlan &plan, Device &device);

  llvm::Expected<StepResult> run(const StepInputs &inputs,
                                 host::HostState &state,
                                 const StepOptions &options);

private:
  struct Step;
  llvm::Error stageInputs(const StepInputs &inputs, int64_t optimizerStep);
  llvm::Error issueAll(Step &step);
  llvm::Error issue(Step &step, size_t i, size_t &fetchIndex);
  void hostUpdate(Step &step, size_t i);
  llvm::Expected<StepResult> finish(Step &step);

  const ExecPlan &plan;
  Device &device;
  LossGuard guard;
  int64_t jobRanks; ///< ExecPlan::jobRanks
  /// Per instruction: the values whose last use it is.
  std::vector<std::vector<int64_t>> releasedAfter;
  /// Per host_adamw: its gradient is the rank's shard of the sum over a
  /// job's ranks (copied by a device_to_host marked `ranks`).
  std::vector<bool> shardGradient;
  std::vector<size_t> fetches; ///< instruction indices, program order
  StepStatus status;
};

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_STEPRUNNER_H
