//===- Checkpoint.h - Training checkpoints of the host state ----*- C++ -*-===//
//
// A checkpoint is a directory per saved step under a user directory D:
//
//   D/step-000123/state.safetensors  masters, AdamW moments, frozen (fp32)
//   D/step-000123/trainer.json       step, the trainer's opaque state
//   D/step-000123/manifest.json      file names, sizes, CRC-32C checksums
//   D/latest                         "step-000123": the newest complete one
//
// Saving is atomic: a step directory exists under its final name only once
// all its files are written and fsynced, and `latest` is replaced by a
// rename after that, so a crash or a full disk never leaves a half
// checkpoint where a loader looks and never damages earlier ones. Loading
// verifies the manifest (sizes and checksums) and the tensor set against
// the plan, and says which file is wrong and how.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_CHECKPOINT_H
#define MEGASLIDE_RUNTIME_HOST_CHECKPOINT_H

#include "megaslide/runtime/host/HostState.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::host {

/// Bump on any change a reader of the previous version would misread.
/// Version 2: a job's checkpoint, one state file per rank (one process
/// still writes version 1).
inline constexpr int64_t kCheckpointFormatVersion = 2;

struct CheckpointOptions {
  /// Checkpoints kept, the new one included; 0 keeps all. Older ones are
  /// deleted only after the new one is complete.
  unsigned keep = 2;
  /// Delete every other checkpoint in the directory once the new one is
  /// complete, later steps included (a fresh run over an old one's folder,
  /// `--overwrite-checkpoints`).
  bool replaceOthers = false;
};

/// A complete checkpoint directory (one with a manifest).
struct CheckpointInfo {
  int64_t step = 0;
  std::string path;
};

/// "step-000123": the directory name of the checkpoint of `step`.
std::string checkpointDirName(int64_t step);

/// Whether `param` is saved in checkpoints (masters, moments, frozen, EMA;
/// bf16 working copies and gradients are derived or transient).
bool isCheckpointParam(const exec::Param &param);

/// Bytes a checkpoint of `state` takes on disk (an upper bound).
uint64_t checkpointBytes(const HostState &state);

/// An error unless the filesystem of `dir` has room for one more
/// checkpoint of `state`; it says how much is needed and free.
llvm::Error checkCheckpointSpace(llvm::StringRef dir, const HostState &state);

/// Removes what interrupted saves left in `dir` (".tmp-step-*",
/// ".old-step-*" directories and ".latest.tmp-*" files of processes no
/// longer alive); never follows or removes a symlink.
void removeStaleTemporaries(llvm::StringRef dir);

/// Saves `state` at step `state.step` with `trainerState` (opaque to
/// MegaSlide, e.g. JSON of the data position and RNG state; UTF-8) into
/// `dir` (created if needed), then points `dir`/latest at it and deletes
/// checkpoints beyond `options.keep`; only checkpoints of earlier steps are
/// deleted. A checkpoint of the same step is replaced. Returns the new
/// step directory. On error nothing already in `dir` is changed.
///
/// In a job of several ranks (`job`), every rank calls it with its shards
/// of the state: each writes its own state file
/// (state-rank-R-of-N.safetensors) and rank 0, once every file is complete,
/// the trainer state and the manifest, then commits as above; a failure of
/// any rank is every rank's error (docs/Distributed.md, "Checkpoints").
llvm::Expected<std::string> saveCheckpoint(
    llvm::StringRef dir, const HostState &state, llvm::StringRef trainerState,
    const CheckpointOptions &options = {}, dist::Collectives *job = nullptr);

/// Loads the checkpoint in `stepDir` into `state` (whose plan decides the
/// expected tensors; of a sharded state, the elements this rank holds, from
/// the files of whatever number of ranks wrote the checkpoint) and sets
/// `state.step` and `trainerState`. Sizes and
/// checksums are verified against the manifest; tensor names and shapes
/// against the plan. On error `state.step` and `trainerState` are
/// unchanged but tensor data may be partly overwritten.
llvm::Error loadCheckpoint(llvm::StringRef stepDir, HostState &state,
                           std::string &trainerState);

/// Loads the checkpoint `dir`/latest names. If that fails, or `latest` is
/// missing or corrupt, the error names the previous complete checkpoint,
/// which loadCheckpoint then loads explicitly.
llvm::Error loadLatestCheckpoint(llvm::StringRef dir, HostState &state,
                                 std::string &trainerState);

/// The trainer state (as given to saveCheckpoint) of the checkpoint
/// `dir`/latest names, verified against its manifest; reads no tensors, so
/// a run can check its settings against the checkpoint before compiling.
llvm::Expected<std::string> readLatestTrainerState(llvm::StringRef dir);

/// An exclusive lock on a checkpoint directory for the life of a run
/// (flock on `dir`/.lock, which holds the owner's pid): two runs never
/// write one directory. Released, and the file removed, by the destructor;
/// the lock also ends with the process, however it ends (a stale file is
/// taken over).
class CheckpointLock {
public:
  /// Creates `dir` if needed and locks it; if another process holds the
  /// lock, the error names its pid.
  static llvm::Expected<std::unique_ptr<CheckpointLock>>
  acquire(llvm::StringRef dir);
  ~CheckpointLock();
  CheckpointLock(const CheckpointLock &) = delete;
  CheckpointLock &operator=(const CheckpointLock &) = delete;

private:
  CheckpointLock(int fd, std::string path) : fd(fd), path(std::move(path)) {}
  int fd;
  std::string path;
};

/// The complete checkpoints in `dir`, ascending step; none if `dir` does
/// not exist.
llvm::Expected<std::vector<CheckpointInfo>>
listCheckpoints(llvm::StringRef dir);

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_CHECKPOINT_H
