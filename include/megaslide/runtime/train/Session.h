//===- Session.h - A training run over an execution plan --------*- C++ -*-===//
//
// What megaslide-run and Python's megaslide.Trainer drive: a loaded plan,
// a backend, the host state and the data, stepped one training step at a
// time. Everything a step depends on (host state, optimizer step, data
// sampling state) is in checkpoints, so a resumed run continues bit-exactly.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_SESSION_H
#define MEGASLIDE_RUNTIME_TRAIN_SESSION_H

#include "megaslide/runtime/cuda/CudaOptions.h"
#include "megaslide/runtime/host/HostOptimizer.h"
#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/train/Recipe.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::train {

struct SessionOptions {
  std::string backend = "cpu"; ///< cpu | cuda | sim
  uint64_t seed = 0;
  std::string hardwarePath; ///< sim: hardware description (empty: H200)
  std::string dataDir;      ///< samples from files; empty: synthetic data
  Recipe recipe;
  /// Validation samples (the --data format); empty: no validation.
  std::string valDataDir;
  /// The job this process is a rank of (docs/Distributed.md); null: one
  /// process. Each rank takes recipe.gradAccum micro-batches of every
  /// step, the job's gradient is their sum over the ranks.
  dist::Collectives *collectives = nullptr;
  /// The cuda backend's options (tests: the fake device); a rank of a job
  /// gets the job and its local rank's GPU.
  cuda::CudaOptions cuda;
  /// The NVMe tier's directories, one per drive (megaslide-run --nvme),
  /// for a plan that keeps state there (ExecPlan::tierRoles; its window
  /// is the plan's), and whether to take ones checkTierDirectory refuses.
  std::vector<std::string> nvmeDirs;
  bool nvmeForce = false;
};

/// One shape of a bucketed run (docs/Runtime.md, "Buckets"): its name,
/// "FxHxW", and the plan compiled for it.
struct BucketPlan {
  std::string name;
  exec::ExecPlan plan;
  /// The planner's predicted step time (the plan does not carry it); 0:
  /// unknown (a --plan file).
  double predictedSeconds = 0;
};

/// One optimizer step of the recipe (docs/Training.md).
struct StepReport {
  /// loss (and a weighted loss's unweightedLoss): the mean over the
  /// micro-batches; seconds: all of them; skipped:
  /// no update (a non-finite loss or, deferred, gradient); memory and
  /// spans: the last micro-batch's.
  exec::StepResult result;
  /// The global L2 norm of the (averaged) gradients before clipping;
  /// unset where nothing computes one (sim).
  std::optional<double> gradNorm;
  double lr = 0;        ///< the learning rate the update used
  bool clipped = false; ///< clipping scaled the gradients down
  int64_t microBatches = 1;
  /// The bucket (Session::bucketName) of each micro-batch.
  std::vector<size_t> buckets;
  /// The expert that stepped (a two-expert run, Recipe::boundary): 0 high
  /// noise, 1 low; unset for one model.
  std::optional<int64_t> expert;
};

/// What changes the numbers a run computes, by name, as text: seed, data,
/// model, AdamW hyper-parameters, precision, batch and the plan's hash.
/// Checkpoints record them; a resumed run must have the same ones.
using Settings = std::vector<std::pair<std::string, std::string>>;

/// The settings recorded in a trainer state (none for format 1 states).
llvm::Expected<Settings> settingsOfTrainerState(llvm::StringRef json);
/// The optimizer steps a trainer state records.
llvm::Expected<int64_t> stepOfTrainerState(llvm::StringRef json);
/// The value of `name` in `settings`, if recorded.
std::optional<std::string> findSetting(const Settings &settings,
                                       llvm::StringRef name);
/// An error naming every setting whose value differs between the
/// checkpoint (`stored`) and this run (`current`), with both values, and
/// what to do: megaslide-run's flags, or `advice` where the caller is not
/// megaslide-run (Python's Trainer adopts no setting from a checkpoint).
llvm::Error checkResumeSettings(const Settings &stored, const Settings &current,
                                llvm::StringRef advice = "");

/// Host memory a run needs, by part (docs/Runtime.md, "Host memory").
struct HostMemoryNeed {
  std::vector<std::pair<std::string, uint64_t>> parts;
  uint64_t total() const;
};

class Session {
public:
  /// Takes ownership of a validated plan. Before anything large is
  /// allocated, the host memory the run needs (state, the cpu backend's
  /// arena, the plan's host buffers, data) is checked against this
  /// machine's; the error lists the parts.
  static llvm::Expected<std::unique_ptr<Session>>
  create(exec::ExecPlan plan, const SessionOptions &options);
  /// A run over several shapes (docs/Runtime.md, "Buckets"): one plan per
  /// bucket, all with the same parameters, trained over one host state and
  /// one optimizer state; each micro-batch runs on its bucket's plan. Only
  /// the backend of the bucket being stepped is alive (the host-memory
  /// check counts the largest). Needs options.dataDir.
  static llvm::Expected<std::unique_ptr<Session>>
  create(std::vector<BucketPlan> plans, const SessionOptions &options);

  /// One optimizer step on the next recipe.gradAccum batches. A batch that
  /// cannot be made (a sample file unreadable or non-finite) is an error
  /// with the state, data position included, unchanged.
  llvm::Expected<StepReport> trainStep(const exec::StepOptions &options);
  /// One optimizer step on the given micro-batches (recipe.gradAccum of
  /// them), no data drawn; a micro-batch without "timesteps" gets the
  /// recipe's (sampleSigmas).
  llvm::Expected<StepReport> trainStep(std::vector<exec::StepInputs> inputs,
                                       const exec::StepOptions &options);
  /// Training steps run so far, skipped ones (a non-finite loss) included,
  /// across resumes: the step count the cadences of validation and
  /// checkpoints follow, so a resumed run validates and saves where an
  /// uninterrupted one does.
  int64_t stepsRun() const { return stepsRunSoFar; }
  /// Completed optimizer steps of the run: the state's, or of two experts
  /// the sum of theirs (each expert's own count drives its AdamW bias
  /// correction; the lr schedule, the times drawn and checkpoint names
  /// follow this one).
  int64_t step() const;
  /// One backend step on `inputs` with the given options, outside the
  /// recipe (no data drawn, no optimizer decisions: gradient inspection).
  /// Refused while the host state is incomplete (a step failed part-way).
  llvm::Expected<exec::StepResult> runStep(const exec::StepInputs &inputs,
                                           const exec::StepOptions &options);
  /// The mean loss over the validation samples, each with the noise and
  /// timestep drawn for it once (the same at every call); no update, and
  /// neither the training data nor the optimizer state moves. Unweighted
  /// under any --weighting-scheme.
  llvm::Expected<float> validationLoss();
  bool hasValidation() const { return static_cast<bool>(valData); }

  /// Applies the deferred updates still pending (each lands before its
  /// parameter's next fetch anyway): state() does it first, so whatever
  /// reads or saves the state sees every decided update.
  void flushUpdates();
  /// The first failed update of any expert's optimizer, if one failed.
  llvm::Error updatesFailed() const;
  /// Whether the state is sharded over a job's ranks (docs/Distributed.md,
  /// "Memory"): what saves or loads it is then a collective of the job.
  bool sharded() const { return current().optimizer.sharded(); }
  /// The job's collectives, if the run is a rank of one.
  dist::Collectives *job() const { return options.collectives; }
  /// Whether the plan defers its updates to after the backward
  /// (docs/Training.md, "Deferred update").
  bool deferredUpdates() const { return deferred; }
  const Recipe &recipe() const { return options.recipe; }
  /// The EMA tensor of trainable parameter `name`, if the recipe keeps one.
  host::HostTensor *ema(llvm::StringRef name);

  /// The trainer's own state besides the host tensors, as JSON text:
  /// format version, seed, data sampling state, settings.
  std::string trainerState() const;
  llvm::Error restoreTrainerState(llvm::StringRef json);
  const Settings &settings() const { return runSettings; }

  /// The plan of the bucket stepped last (the first before any step):
  /// every bucket's has the same parameters.
  const exec::ExecPlan &plan() const { return *plans[live]; }
  const exec::ExecPlan &plan(size_t bucket) const { return *plans[bucket]; }
  size_t numBuckets() const { return plans.size(); }
  /// "FxHxW"; empty for a run of one shape given by --frames etc.
  const std::string &bucketName(size_t bucket) const { return names[bucket]; }
  double predictedSeconds(size_t bucket) const { return predicted[bucket]; }
  /// Whether the session was made from named buckets.
  bool bucketed() const { return !names.front().empty(); }
  /// Training samples per bucket (empty for synthetic data).
  std::vector<size_t> bucketSamples() const;
  /// The state of the expert stepped last (the only one of a run of one
  /// model).
  host::HostState &state() {
    flushUpdates();
    return current().state;
  }
  /// 1, or 2 for Wan 2.2's two experts (Recipe::boundary).
  int64_t numExperts() const { return static_cast<int64_t>(experts.size()); }
  /// Expert `e`'s state (0: high noise, diffusers' `transformer`; 1: low
  /// noise, `transformer_2`), its pending updates applied.
  host::HostState &expertState(int64_t e);
  /// Calls `fn` with the state a checkpoint holds: of one model the state
  /// itself; of two experts one state holding both, the low-noise
  /// expert's tensors named kSecondExpertPrefix + name, its step the
  /// run's (step()). Its tensors' values are the experts' own (moved in
  /// and back, never copied): what `fn` loads lands in the experts.
  llvm::Error
  withCheckpointState(llvm::function_ref<llvm::Error(host::HostState &)> fn);
  /// Where a two-expert checkpoint keeps the low-noise expert's tensors.
  static constexpr llvm::StringLiteral kSecondExpertPrefix = "transformer_2.";
  /// The backend of the bucket stepped last.
  exec::Backend &backend() { return *executor; }
  const InputShapes &inputShapes() const { return shapesOf[0]; }
  const HostMemoryNeed &hostMemory() const { return memoryNeed; }

  ~Session();

private:
  Session(std::vector<std::unique_ptr<exec::ExecPlan>> plans,
          std::vector<std::string> names, std::vector<InputShapes> shapes,
          SessionOptions options, std::unique_ptr<DataSource> data);
  /// Makes the backend of `bucket` the live one.
  llvm::Error useBucket(size_t bucket);
  /// Keeps the live cuda backend's device collectives of a job for the
  /// run's next backends (cuda::CudaOptions::collectives).
  void keepDeviceCollectives();
  /// In a sharded job: what a step does together with the other ranks
  /// (the gathers of its fetches; a job's plan: the whole step on zeros),
  /// results dropped, for a rank with no batch where the others run one
  /// (validation).
  llvm::Error gatherLikeAStep();
  /// Adds a weighted loss's weights (exec::kLossWeightsInput) from the
  /// inputs' timesteps.
  llvm::Expected<exec::StepResult> runStepOn(size_t bucket,
                                             exec::StepInputs inputs,
                                             const exec::StepOptions &options);
  /// Micro-batch k of the step (and its bucket), made when the step gets
  /// to it: recipe.gradAccum of them are never held at once.
  using MicroBatches = llvm::function_ref<llvm::Expected<exec::StepInputs>(
      int64_t k, size_t &bucket)>;
  llvm::Expected<StepReport> optimizerStep(MicroBatches next,
                                           const exec::StepOptions &options);
  /// optimizerStep's three kinds, each running report.microBatches drawn
  /// by `draw` (their timesteps added) into `report`: no update (timing,
  /// or gradients only), the streaming update, the deferred update.
  llvm::Error stepWithoutUpdate(MicroBatches draw,
                                const exec::StepOptions &options,
                                StepReport &report);
  llvm::Error streamingStep(MicroBatches draw, exec::StepOptions options,
                            StepReport &report);
  llvm::Error deferredStep(MicroBatches draw, exec::StepOptions options,
                           StepReport &report);

  std::vector<std::unique_ptr<exec::ExecPlan>> plans; ///< stable addresses
  std::vector<std::string> names;
  std::vector<double> predicted;
  std::vector<InputShapes> shapesOf;
  size_t live = 0; ///< the bucket whose backend `executor` is
  SessionOptions options;
  uint64_t seed;
  /// One model's state and optimizer, or one of Wan 2.2's experts'.
  struct Expert {
    host::HostState state;
    host::HostOptimizer optimizer;
  };
  std::deque<Expert> experts; ///< stable addresses (the optimizers')
  size_t liveExpert = 0;      ///< the one stepped last
  Expert &current() { return experts[liveExpert]; }
  const Expert &current() const { return experts[liveExpert]; }
  /// Makes `e` the live expert, applying the other's pending updates.
  void useExpert(size_t e);
  std::unique_ptr<DataSource> data, valData;
  std::unique_ptr<exec::Backend> executor;
  Settings runSettings;
  HostMemoryNeed memoryNeed;

  // The optimizer side of the recipe.
  bool deferred = false;
  double baseLr = 0;
  int64_t stepsRunSoFar = 0; ///< stepsRun()
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SESSION_H
