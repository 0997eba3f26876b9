//===- SessionParts.h - A session's parts in files of their own -*- C++ -*-===//
//
// Private to runtime/train: what Session.cpp calls of the session's other
// files, one concern each: the backends (SessionBackends.cpp), the
// host-memory check (SessionHostMemory.cpp), the settings and the trainer
// state (SessionState.cpp) and validation (SessionValidation.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_SESSIONPARTS_H
#define MEGASLIDE_RUNTIME_TRAIN_SESSIONPARTS_H

#include "megaslide/runtime/train/Session.h"

#include "llvm/ADT/ArrayRef.h"

#include <memory>
#include <string>
#include <vector>

namespace megaslide::train {

/// The backend options.backend names, running `plan`.
llvm::Expected<std::unique_ptr<exec::Backend>>
createBackend(const exec::ExecPlan &plan, const SessionOptions &options);

/// What the host optimizer does of the recipe, over the steps of `plan`.
host::HostOptimizer::Options optimizerOptions(const Recipe &r,
                                              const exec::ExecPlan &plan,
                                              bool deferred,
                                              dist::Collectives *collectives);

/// The host memory a computing backend needs for a run over `plans`, one
/// bucket's backend alive at a time: each part as large as the largest
/// bucket's.
HostMemoryNeed
hostMemoryNeed(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
               const SessionOptions &options, const DataSource &data,
               bool deferred);
/// An error listing the parts when `need` exceeds the memory this process
/// may use, with `plan`'s model named.
llvm::Error checkHostMemory(const HostMemoryNeed &need,
                            const exec::ExecPlan &plan, llvm::StringRef backend,
                            dist::Collectives *job);

/// The settings a run records in its checkpoints (Settings).
Settings computeSettings(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
                         llvm::ArrayRef<std::string> names,
                         const SessionOptions &options, bool deferred,
                         const DataSource &samples);

/// The validation samples of options.valDataDir: an error when they make
/// no whole batch (of one bucket).
llvm::Expected<std::unique_ptr<DataSource>>
openValidationData(const SessionOptions &options,
                   llvm::ArrayRef<InputShapes> shapesOf,
                   llvm::ArrayRef<std::string> names);

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SESSIONPARTS_H
