//===- TrainingRun.h - The training loop as a library -----------*- C++ -*-===//
//
// A run over a Session: checkpoints on a cadence into a locked folder,
// resume from the newest one, the metrics log, the HTML report and a
// Chrome trace, validation on a cadence, the non-finite limit, and a
// failure that saves the state first (docs/Runtime.md, "Long runs").
// megaslide-run, megaslide-exec and Python's megaslide.Trainer all train
// through it, so their checkpoints and logs are the same bytes.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_TRAININGRUN_H
#define MEGASLIDE_RUNTIME_TRAIN_TRAININGRUN_H

#include "megaslide/runtime/host/Checkpoint.h"
#include "megaslide/runtime/host/Weights.h"
#include "megaslide/runtime/trace/ChromeTrace.h"
#include "megaslide/runtime/train/MetricsLog.h"
#include "megaslide/runtime/train/Session.h"

#include "llvm/ADT/STLFunctionalExtras.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace megaslide::train {

/// One optimizer step of a run, as it went.
struct RunStep {
  StepReport report;
  /// The step's number in the run (a resume continues the count).
  int64_t step = 0;
  /// Steps this run has taken, this one included.
  int64_t ran = 0;
  int64_t skippedInARow = 0;
  std::optional<float> valLoss;
  /// Whether the step is one the cadence checkpoints (whichever process
  /// writes it).
  bool checkpointDue = false;
};

struct RunOptions {
  /// Checkpoints go here (empty: none); with writesCheckpoints false the
  /// folder is only read (a resume that takes no step: no lock).
  std::string checkpointDir;
  bool writesCheckpoints = true;
  /// This process locks the folder and keeps its `latest` and retention:
  /// rank 0 of a job, whose other ranks write their shards into its
  /// checkpoints (docs/Distributed.md, "Checkpoints").
  bool ownsCheckpoints = true;
  /// Steps between checkpoints (0: only after the last step of train()).
  int64_t checkpointEvery = 0;
  /// Continue the newest checkpoint: its settings are read by open() for
  /// the plan to adopt, and resume() restores it.
  bool resume = false;
  bool overwriteCheckpoints = false;
  /// Whether open() refuses a fresh run in a folder holding checkpoints
  /// (megaslide-run: before compiling); otherwise the first step does,
  /// unless resume() came first (Python's Trainer).
  bool refuseEarlierRunAtOpen = true;
  /// A resume may move the learning-rate horizon here (the option given):
  /// the one recipe setting that may differ from the checkpoint's.
  std::optional<int64_t> lrDecaySteps;
  std::string metricsPath, reportPath, tracePath;
  /// Optimizer steps between validations (0: after the last step of
  /// train() only); validation needs the session's validation samples.
  int64_t valEvery = 0;
  /// Consecutive skipped steps (a non-finite loss) before the run stops.
  int64_t maxNonFiniteSteps = 3;
  /// Names the writer in the trace ("megaslide-run").
  std::string toolName = "megaslide-run";
  OptionSpelling spell = cliSpelling;
  /// Lines worth showing as they happen: "checkpoint: DIR", "resumed at
  /// step N from DIR". Null: none shown.
  std::function<void(llvm::StringRef)> note;
};

/// What a run did, for its summary.
struct RunTotals {
  int64_t ran = 0, skipped = 0;
  std::optional<float> firstLoss, lastLoss; ///< of steps not skipped
  std::optional<exec::MemoryStats> memory;  ///< the last step not skipped
  double seconds = 0;                       ///< the steps' own time
  bool lastSkipped = false;
};

class TrainingRun {
public:
  /// Before a plan is compiled: the checkpoint folder is created and
  /// locked (stale temporaries of interrupted saves go), every output is
  /// proven writable, the metrics log checked, and a resume's checkpoint
  /// settings read (storedSettings).
  static llvm::Expected<std::unique_ptr<TrainingRun>> open(RunOptions options);
  ~TrainingRun();

  /// With resume: the settings of the newest checkpoint (without its
  /// learning-rate horizon where lrDecaySteps moves it) and its step.
  const Settings *storedSettings() const { return stored ? &*stored : nullptr; }
  llvm::Expected<int64_t> storedStep() const;
  /// Where lrDecaySteps moves the checkpoint's horizon: the sentence.
  const std::string &horizonNote() const { return horizon; }

  /// The session the run trains; resume() and the steps act on it.
  void attach(Session &session);
  /// Restores the newest checkpoint of the folder into the session (its
  /// settings must be the session's); the next step continues it.
  llvm::Error resume();
  bool resumed() const { return isResumed; }
  /// Opens the outputs (checks the checkpoint folder's space, opens the
  /// metrics log and the trace); the first step does it where not done.
  llvm::Error start();

  /// One optimizer step, written to the log, validated and checkpointed on
  /// their cadences; `last` (of train()) validates and checkpoints. On the
  /// given micro-batches (Session::trainStep), or the data's next ones.
  /// `afterStep` sees the step once it is logged, before the non-finite
  /// limit and the checkpoint (progress, messages). An error has saved the
  /// state first where it could and says so.
  llvm::Expected<RunStep>
  step(const exec::StepOptions &options, bool last,
       llvm::function_ref<void(const RunStep &)> afterStep = nullptr,
       std::optional<std::vector<exec::StepInputs>> inputs = std::nullopt);

  struct Hooks {
    /// Asked before each step: whether to stop there (a signal).
    llvm::function_ref<bool()> stopRequested;
    /// Before each step: its options (`last`: the final one).
    llvm::function_ref<void(exec::StepOptions &, bool last)> beforeStep;
    llvm::function_ref<void(const RunStep &)> afterStep;
  };
  /// `steps` steps, the last one checkpointed, and the run stops after
  /// maxNonFiniteSteps skipped steps in a row; returns the steps taken (a
  /// stop asked for ends the loop early, without a checkpoint: the caller
  /// takes it, as checkpoint(), and says how to continue).
  llvm::Expected<int64_t> train(int64_t steps, const Hooks &hooks);

  /// Saves a checkpoint of the current step unless one is written already.
  llvm::Error checkpoint();
  /// Ends the run's outputs: the trace (`whole`: also when no step ran,
  /// else an empty trace never replaces an old one) and the report.
  llvm::Error finish(bool whole);
  /// The error of a failed run: the state, if whole and newer than the
  /// last checkpoint, is saved first and the message says so; the trace
  /// and report are written.
  llvm::Error failAfterSaving(const llvm::Twine &message);

  bool writesCheckpoints() const;
  const RunTotals &totals() const { return sums; }
  /// The first step's number minus one (the count this run continues).
  int64_t firstStep() const { return first; }
  const RunOptions &runOptions() const { return options; }

private:
  explicit TrainingRun(RunOptions options) : options(std::move(options)) {}
  llvm::Error writeReport();
  /// A resume's checkpoint settings (stored, storedState, horizon).
  llvm::Error readStoredSettings();
  llvm::Error refuseEarlierRun();

  RunOptions options;
  Session *session = nullptr;
  std::vector<std::string> createdDirs;
  std::unique_ptr<host::CheckpointLock> lock;
  std::optional<Settings> stored;
  std::string storedState, horizon;
  bool isResumed = false, started = false, metricsCheckedForResume = false;
  std::unique_ptr<MetricsLog> metrics;
  std::unique_ptr<trace::ChromeTrace> trace;
  int64_t first = 0, lastCheckpoint = -1;
  bool replaceOthers = false;
  RunTotals sums;
  int64_t skippedInARow = 0;
  bool inTrain = false; ///< step() called by train(): the limit applies
};

/// Writes the session's weights as a diffusers transformer folder; `ema`:
/// the EMA of the weights stands in for them (a bf16 EMA widened, exactly).
/// Of Wan 2.2's two experts, a pipeline's two: `dir`/transformer (high
/// noise) and `dir`/transformer_2 (low noise), each written atomically.
llvm::Error saveSessionWeights(Session &session, llvm::StringRef dir,
                               host::SaveWeightsOptions options, bool ema);
/// Loads the session's weights (host::loadWeights, checked against its
/// plan): one model's from `path`; two experts' from a pipeline folder's
/// transformer and transformer_2.
llvm::Error loadSessionWeights(Session &session, llvm::StringRef path);

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_TRAININGRUN_H
