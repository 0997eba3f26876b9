//===- HostOptimizer.h - The optimizer that runs on the host ----*- C++ -*-===//
//
// One component for every AdamW update of the host state (docs/Training.md,
// "Deferred and streaming updates"): the hyper-parameters a host_adamw
// carries, the streaming update the step runner (plan/StepRunner.h) applies
// as each gradient arrives, and the trainer's deferred update: gradients
// retained per micro-batch, one global decision (non-finite skip, clipping
// by the global norm), each parameter's update applied before its next
// fetch, and the EMA of the weights. Backends do no optimizer arithmetic of
// their own; the trainer (train::Session) only orchestrates.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_HOSTOPTIMIZER_H
#define MEGASLIDE_RUNTIME_HOST_HOSTOPTIMIZER_H

#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::host {

/// A gradient as it reached the host, in its planned dtype; valid only
/// during the call it is passed to.
struct HostGradient {
  const void *data = nullptr;
  exec::DType dtype = exec::DType::F32;
  int64_t count = 0;
};

/// The AdamW settings of host_adamw `inst` for optimizer step `step`,
/// plan/HyperParameters.h's defaults where the plan leaves an attribute
/// out: the one reading of a plan's hyper-parameters.
cpu::AdamWHyper adamwHyperOf(const exec::Instruction &inst, int64_t step);

/// torch.nn.utils.clip_grad_norm_'s factor for a global norm: min(1,
/// maxGradNorm / (norm + 1e-6)); 1 without clipping (maxGradNorm 0). A
/// non-finite norm gives NaN (the step is skipped before it is used).
double clipFactor(double maxGradNorm, double norm);

/// The EMA decay of the k-th update (0-based): `decay`, or with diffusers'
/// EMAModel warmup min(decay, (1 + k) / (10 + k)), and 0 at k = 0.
double emaDecayAt(double decay, bool warmup, int64_t k);

/// The tensors one host_adamw updates.
struct AdamWTensors {
  HostTensor *master = nullptr, *m = nullptr, *v = nullptr;
};

/// The master of `param` and its moments; an error when the state lacks
/// one.
llvm::Expected<AdamWTensors> adamwTensors(HostState &state,
                                          llvm::StringRef param);

/// One AdamW update of `t` with gradient `g` in its planned dtype (bf16
/// and f32 read as they are, f16 widened first: the same values); moments
/// in the NVMe tier stream through it. An error only from the tier.
llvm::Error adamwUpdate(const cpu::AdamWHyper &hyper, const AdamWTensors &t,
                        const HostGradient &g);

/// What a streaming update uses besides the host_adamw's attributes
/// (exec::StepOptions).
struct StreamingSettings {
  int64_t step = 1; ///< the optimizer step the update makes (1-based)
  std::optional<double> lr;
  float gradScale = 1;
};

/// The streaming update of host_adamw `inst` as its gradient reaches the
/// host: the gradient is checked (a non-finite element is an error naming
/// the parameter and step, cpu::nonFiniteGradientMessage, with nothing
/// changed), `state.incomplete` is set, then `t` is updated. Returns the
/// gradient's squared L2 norm, before `gradScale`.
llvm::Expected<double> streamingUpdate(HostState &state, const AdamWTensors &t,
                                       const exec::Instruction &inst,
                                       const HostGradient &g,
                                       const StreamingSettings &settings);

/// The trainer's optimizer over one host state: the streaming update's
/// clipping and EMA around the steps, or the deferred update whole.
class HostOptimizer {
public:
  struct Options {
    /// Retain gradients and decide once the backward ends (the plan's
    /// host_adamw are deferred), rather than update as they arrive.
    bool deferred = false;
    int64_t gradAccum = 1;  ///< micro-batches per optimizer step
    double maxGradNorm = 0; ///< clipping; 0: none
    double emaDecay = 0;    ///< EMA of the masters; 0: none
    bool emaWarmup = false, emaBf16 = false;
    /// The job's ranks (docs/Distributed.md), each with gradAccum
    /// micro-batches of a step: the deferred update sums the retained
    /// gradients over them first, so every rank decides and updates alike.
    dist::Collectives *collectives = nullptr;
    /// A job's gradients arrive summed over the ranks already, each rank
    /// getting its shard (the cuda backend's reduce-scatter on the device,
    /// ExecPlan::jobRanks > 1): kept and summed over micro-batches as
    /// shards, without the host's reduce-scatter.
    bool deviceReduces = false;
    bool hasEma() const { return emaDecay > 0; }
    int64_t ranks() const;
  };

  /// The host memory prepare() allocates for `plan` besides the state's
  /// masters and moments: the one home of its sizes, which the trainer's
  /// host-memory check counts (docs/Runtime.md, "Host memory").
  struct Footprint {
    uint64_t retainedBytes = 0; ///< deferred: one micro-batch's gradients
    uint64_t accumBytes = 0;    ///< several micro-batches: their fp32 sums
    uint64_t emaBytes = 0;      ///< the EMA tensors
  };
  static Footprint footprint(const exec::ExecPlan &plan,
                             const Options &options);

  /// Adds the EMA tensors ("<param>.ema", role "ema") to `state` and keeps
  /// one record per host_adamw of `plan`, in plan order. `plan` and
  /// `state` must outlive the optimizer, and no tensor may be added to
  /// `state` afterwards. Every plan the optimizer's steps run must have
  /// the same parameters as `plan`.
  void prepare(const exec::ExecPlan &plan, HostState &state,
               const Options &options);
  /// After prepare(): moves the tensors of the plan's tier roles into an
  /// NVMe tier on `tierOptions`' drives (host::attachTier) and tells it
  /// the order the updates visit them; nothing for a plan without.
  llvm::Error useTier(const NvmeTierOptions &tierOptions);

  /// Streaming: the gradient scale of the next step, clipping by the
  /// previous step's norm (the first step is not clipped); the EMA starts
  /// at the weights before their first update.
  double beginStreamingStep();
  /// Streaming: after a step that updated, with its squared gradient norm
  /// (exec::StepResult::gradSquaredNorm): the norm is kept for the next
  /// step's clipping and the EMA follows the new weights. Returns the norm.
  double endStreamingStep(double gradSquaredNorm);

  /// Deferred: keeps one micro-batch's gradient of `inst`'s parameter (its
  /// bytes, or their fp32 sum over the micro-batches) and its squared
  /// norm (exec::StepOptions::retainGradient). Called concurrently for
  /// distinct parameters.
  void retain(const exec::Instruction &inst, const HostGradient &g);
  /// Deferred: applies the pending update of the master a fetch of
  /// `fetched` reads (ExecPlan::updatedParam), if one is pending
  /// (exec::StepOptions::beforeFetch).
  void applyPending(llvm::StringRef fetched);
  /// Applies every pending update: whatever reads or saves the state.
  void flush();
  /// Deferred, after the last micro-batch: the global L2 norm of the
  /// averaged gradients (squared norms summed in plan order, in double);
  /// NaN or infinite when a gradient is. An error when a parameter did not
  /// get one gradient per micro-batch, or a collective failed. The
  /// retained micro-batches are counted afresh from here.
  llvm::Expected<double> retainedNorm();
  /// Deferred: forgets the micro-batches retained in a failed step.
  void dropRetained();
  /// Deferred: decides the step's update from its finite global norm with
  /// learning rate `lr`: every parameter's update pending (clipped, the
  /// micro-batches' mean), the EMA's decay, state.step advanced. Returns
  /// the clipping factor.
  double decide(double norm, double lr);
  /// In a job of several ranks, after decide(): each rank updates its shard
  /// of every parameter's master, moments and EMA (host::shardedRole);
  /// the next fetch gathers the masters' shards (host::gatherWhole).
  /// Nothing is left pending.
  llvm::Error applySharded();
  /// Whether the state is sharded over a job's ranks.
  bool sharded() const { return options.ranks() > 1; }

  /// EMA updates so far (its warmup's k) and the previous step's norm:
  /// what a checkpoint's trainer state keeps of the optimizer.
  int64_t emaUpdates() const { return emaCount; }
  std::optional<double> previousNorm() const { return lastNorm; }
  /// Restores them from a checkpoint, which holds no pending update.
  void restore(int64_t emaUpdates, std::optional<double> previousNorm);
  /// An error once an update failed (only the NVMe tier's I/O can fail
  /// one: retained updates apply inside callbacks that cannot return it):
  /// the state is then incomplete for good.
  llvm::Error failed() const;

private:
  /// One trainable parameter's update: a host_adamw of the plan, and what
  /// the deferred update keeps of its gradient until it is applied.
  struct Update {
    const exec::Instruction *inst = nullptr;
    AdamWTensors tensors;
    HostTensor *ema = nullptr;
    exec::DType dtype = exec::DType::F32; ///< of the gradient
    int64_t count = 0;
    std::vector<uint8_t> retained; ///< one micro-batch: its bytes
    /// Several (or a job's): their fp32 sum, of the whole parameter or,
    /// when the device reduces, of this rank's shard.
    std::vector<float> accum;
    double squaredNorm = 0;
    int64_t received = 0; ///< micro-batches retained this step
    bool pending = false; ///< decided, applied before the next fetch
    /// The first element of the parameter this rank updates: its
    /// master's shard's.
    int64_t shardBegin() const { return tensors.master->heldBegin(); }
    /// This rank's shard of the gradients' sum (after retainedNorm()).
    const float *shardSum(const Options &o) const {
      return accum.data() + (o.deviceReduces ? 0 : shardBegin());
    }
  };
  void apply(Update &u);
  void fail(llvm::Error e);
  void updateEma(Update &u);
  void startEma();

  const exec::ExecPlan *plan = nullptr;
  HostState *state = nullptr;
  std::string failure; ///< the first failed update's error
  Options options;
  std::vector<Update> updates;         ///< one per host_adamw, plan order
  llvm::StringMap<size_t> updateIndex; ///< by parameter name
  /// The step, lr and gradient scale the pending updates were decided with,
  /// and the EMA decay they apply.
  int64_t pendingStep = 0;
  double pendingLr = 0;
  float pendingScale = 1;
  double pendingEmaDecay = 0;
  int64_t emaCount = 0;
  std::optional<double> lastNorm;
};

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_HOSTOPTIMIZER_H
