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

#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/train/Recipe.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace megaslide::train {

struct SessionOptions {
  std::string backend = "cpu"; ///< cpu | cuda | sim
  uint64_t seed = 0;
  std::string hardwarePath; ///< sim: hardware description (empty: H200)
  std::string dataDir;      ///< samples from files; empty: synthetic data
  Recipe recipe;
  /// Validation samples (the --data format); empty: no validation.
  std::string valDataDir;
};

/// One optimizer step of the recipe (docs/Training.md).
struct StepReport {
  /// loss: the mean over the micro-batches; seconds: all of them; skipped:
  /// no update (a non-finite loss or, deferred, gradient); memory and
  /// spans: the last micro-batch's.
  exec::StepResult result;
  /// The global L2 norm of the (averaged) gradients before clipping;
  /// unset where nothing computes one (sim).
  std::optional<double> gradNorm;
  double lr = 0;        ///< the learning rate the update used
  bool clipped = false; ///< clipping scaled the gradients down
  int64_t microBatches = 1;
};

/// What changes the numbers a run computes, by name, as text: seed, data,
/// model, AdamW hyper-parameters, precision, batch and the plan's hash.
/// Checkpoints record them; a resumed run must have the same ones.
using Settings = std::vector<std::pair<std::string, std::string>>;

/// The settings recorded in a trainer state (none for format 1 states).
llvm::Expected<Settings> settingsOfTrainerState(llvm::StringRef json);
/// The value of `name` in `settings`, if recorded.
std::optional<std::string> findSetting(const Settings &settings,
                                       llvm::StringRef name);
/// An error naming every setting whose value differs between the
/// checkpoint (`stored`) and this run (`current`), with both values.
llvm::Error checkResumeSettings(const Settings &stored,
                                const Settings &current);

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

  /// One optimizer step on the next recipe.gradAccum batches. A batch that
  /// cannot be made (a sample file unreadable or non-finite) is an error
  /// with the state, data position included, unchanged.
  llvm::Expected<StepReport> trainStep(const exec::StepOptions &options);
  /// One optimizer step on the given micro-batches (recipe.gradAccum of
  /// them), no data drawn; a micro-batch without "timesteps" gets the
  /// recipe's (sampleSigmas).
  llvm::Expected<StepReport> trainStep(std::vector<exec::StepInputs> inputs,
                                       const exec::StepOptions &options);
  /// One backend step on `inputs` with the given options, outside the
  /// recipe (no data drawn, no optimizer decisions: gradient inspection).
  /// Refused while the host state is incomplete (a step failed part-way).
  llvm::Expected<exec::StepResult> runStep(const exec::StepInputs &inputs,
                                           const exec::StepOptions &options);
  /// The mean loss over the validation samples, each with the noise and
  /// timestep drawn for it once (the same at every call); no update, and
  /// neither the training data nor the optimizer state moves.
  llvm::Expected<float> validationLoss();
  bool hasValidation() const { return static_cast<bool>(valData); }

  /// Applies the deferred updates still pending (each lands before its
  /// parameter's next fetch anyway): state() does it first, so whatever
  /// reads or saves the state sees every decided update.
  void flushUpdates();
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

  const exec::ExecPlan &plan() const { return *planStorage; }
  host::HostState &state() {
    flushUpdates();
    return hostState;
  }
  exec::Backend &backend() { return *executor; }
  const InputShapes &inputShapes() const { return shapes; }
  const HostMemoryNeed &hostMemory() const { return memoryNeed; }

  ~Session();

private:
  struct Update;
  Session(std::unique_ptr<exec::ExecPlan> plan, InputShapes shapes,
          SessionOptions options, std::unique_ptr<DataSource> data);
  void prepareUpdates();
  void retain(const exec::Instruction &inst, const exec::HostGradient &g);
  void applyPending(llvm::StringRef param);
  void apply(Update &u);
  void updateEma(Update &u);
  llvm::Expected<StepReport> optimizerStep(std::vector<exec::StepInputs> in,
                                           const exec::StepOptions &options);

  std::unique_ptr<exec::ExecPlan> planStorage; ///< stable address
  InputShapes shapes;
  SessionOptions options;
  uint64_t seed;
  host::HostState hostState;
  std::unique_ptr<DataSource> data, valData;
  std::unique_ptr<exec::Backend> executor;
  Settings runSettings;
  HostMemoryNeed memoryNeed;

  // The optimizer side of the recipe.
  bool deferred = false;
  double baseLr = 0;
  std::vector<Update> updates;         ///< one per host_adamw, plan order
  llvm::StringMap<size_t> updateIndex; ///< by parameter name
  int64_t pendingCount = 0;
  /// Applied with the pending updates: the step, lr and gradient scale
  /// they were decided with.
  int64_t pendingStep = 0;
  double pendingLr = 0;
  float pendingScale = 1;
  double pendingEmaDecay = 0;
  int64_t emaUpdates = 0; ///< EMA updates so far (its warmup's k)
  /// The previous step's gradient norm: streaming clips with it.
  std::optional<double> previousNorm;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SESSION_H
