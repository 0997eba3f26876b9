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

  /// One training step on the next batch. A batch that cannot be made (a
  /// sample file unreadable or non-finite) is an error with the state,
  /// data position included, unchanged.
  llvm::Expected<exec::StepResult> trainStep(const exec::StepOptions &options);
  /// One step on `inputs` with the given options (no data drawn). Refused
  /// while the host state is incomplete (a step failed part-way).
  llvm::Expected<exec::StepResult> runStep(const exec::StepInputs &inputs,
                                           const exec::StepOptions &options);

  /// The trainer's own state besides the host tensors, as JSON text:
  /// format version, seed, data sampling state, settings.
  std::string trainerState() const;
  llvm::Error restoreTrainerState(llvm::StringRef json);
  const Settings &settings() const { return runSettings; }

  const exec::ExecPlan &plan() const { return *planStorage; }
  host::HostState &state() { return hostState; }
  exec::Backend &backend() { return *executor; }
  const InputShapes &inputShapes() const { return shapes; }
  const HostMemoryNeed &hostMemory() const { return memoryNeed; }

private:
  Session(std::unique_ptr<exec::ExecPlan> plan, InputShapes shapes,
          uint64_t seed, std::unique_ptr<DataSource> data);
  std::unique_ptr<exec::ExecPlan> planStorage; ///< stable address
  InputShapes shapes;
  uint64_t seed;
  host::HostState hostState;
  std::unique_ptr<DataSource> data;
  std::unique_ptr<exec::Backend> executor;
  Settings runSettings;
  HostMemoryNeed memoryNeed;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SESSION_H
