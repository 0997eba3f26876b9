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

#include "host/HostState.h"
#include "plan/Backend.h"
#include "train/SyntheticData.h"

#include <memory>

namespace megaslide::train {

struct SessionOptions {
  std::string backend = "cpu"; ///< cpu | cuda | sim
  uint64_t seed = 0;
  std::string hardwarePath; ///< sim: hardware description (empty: H200)
  std::string dataDir;      ///< samples from files; empty: synthetic data
};

class Session {
public:
  /// Takes ownership of a validated plan.
  static llvm::Expected<std::unique_ptr<Session>>
  create(exec::ExecPlan plan, const SessionOptions &options);

  /// One training step on the next synthetic batch.
  llvm::Expected<exec::StepResult> trainStep(bool trace);
  /// One step on `inputs` with the given options (no data drawn).
  llvm::Expected<exec::StepResult> runStep(const exec::StepInputs &inputs,
                                           const exec::StepOptions &options);

  /// The trainer's own state besides the host tensors, as JSON text:
  /// format version, seed, data sampling state.
  std::string trainerState() const;
  llvm::Error restoreTrainerState(llvm::StringRef json);

  const exec::ExecPlan &plan() const { return *planStorage; }
  host::HostState &state() { return hostState; }
  exec::Backend &backend() { return *executor; }
  const InputShapes &inputShapes() const { return shapes; }

private:
  Session(std::unique_ptr<exec::ExecPlan> plan, InputShapes shapes,
          uint64_t seed, std::unique_ptr<DataSource> data);
  std::unique_ptr<exec::ExecPlan> planStorage; ///< stable address
  InputShapes shapes;
  uint64_t seed;
  host::HostState hostState;
  std::unique_ptr<DataSource> data;
  std::unique_ptr<exec::Backend> executor;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SESSION_H
