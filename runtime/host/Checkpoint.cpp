//===- Checkpoint.cpp - Training checkpoints of the host state ------------===//

#include "megaslide/runtime/host/Checkpoint.h"

#include "megaslide/runtime/host/NvmeTier.h"

#include "megaslide/runtime/cpu/Finite.h"
#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/host/Files.h"
#include "megaslide/runtime/host/Safetensors.h"
#include "megaslide/runtime/host/Weights.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/WithColor.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;
using llvm::Error;
using llvm::StringRef;

namespace {

constexpr llvm::StringLiteral kStateFile = "state.safetensors";
constexpr llvm::StringLiteral kTrainerFile = "trainer.json";
constexpr llvm::StringLiteral kManifestFile = "manifest.json";
constexpr llvm::StringLiteral kLatestFile = "latest";
constexpr llvm::StringLiteral kFormat = "megaslide-checkpoint";
constexpr llvm::StringLiteral kManifestFormat = "megaslide-checkpoint-manifest";

std::string hex32(uint32_t v) { return llvm::formatv("{0:x-8}", v).str(); }

/// The step of a directory name "step-<digits>".
std::optional<int64_t> parseStepDirName(StringRef name) {
  if (!name.consume_front("step-") || name.empty() ||
      !llvm::all_of(name, llvm::isDigit))
    return std::nullopt;
  int64_t step;
  if (name.getAsInteger(10, step))
    return std::nullopt;
  return step;
}

/// The type of `path` itself: a symlink is a symlink, never its target.
llvm::sys::fs::file_type typeOf(StringRef path) {
  llvm::sys::fs::file_status st;
  if (std::error_code ec = llvm::sys::fs::status(path, st, /*Follow=*/false))
    return ec == std::errc::no_such_file_or_directory
               ? llvm::sys::fs::file_type::file_not_found
               : llvm::sys::fs::file_type::status_error;
  return st.type();
}

bool isRealDirectory(StringRef path) {
  return typeOf(path) == llvm::sys::fs::file_type::directory_file;
}

/// Every step-N directory of `dir`, complete or not. Symlinks named like
/// checkpoints are not checkpoints: saving never makes them, so pruning
/// must never follow them into a folder of the user's.
std::vector<CheckpointInfo> stepDirs(StringRef dir, bool completeOnly) {
  std::vector<CheckpointInfo> result;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec)) {
    std::optional<int64_t> step =
        parseStepDirName(llvm::sys::path::filename(it->path()));
    if (!step || !isRealDirectory(it->path()))
      continue;
    if (completeOnly &&
        !llvm::sys::fs::exists(joinPath(it->path(), kManifestFile)))
      continue;
    result.push_back({*step, it->path()});
  }
  llvm::sort(result, [](const CheckpointInfo &a, const CheckpointInfo &b) {
    return a.step < b.step;
  });
  return result;
}

/// A checkpoint's small file: regular files only (`latest` may be a
/// symlink to /dev/zero or a FIFO), at most `maxBytes` of it.
llvm::Expected<std::string>
readSmallFile(StringRef path, uint64_t maxBytes = kMaxCheckpointJsonBytes) {
  return readBoundedFile(path, maxBytes, "");
}

/// CRC-32C of a whole file, streamed.
llvm::Expected<uint32_t> crcOfFile(StringRef path) {
  llvm::Expected<llvm::sys::fs::file_t> fd =
      llvm::sys::fs::openNativeFileForRead(path);
  if (!fd)
    return fd.takeError();
  std::vector<char> buf(8u << 20);
  uint32_t crc = 0;
  for (;;) {
    llvm::Expected<size_t> n = llvm::sys::fs::readNativeFile(*fd, buf);
    if (!n) {
      llvm::sys::fs::closeFile(*fd);
      return n.takeError();
    }
    if (*n == 0)
      break;
    crc = crc32c(crc, llvm::ArrayRef<uint8_t>(
                          reinterpret_cast<const uint8_t *>(buf.data()), *n));
  }
  llvm::sys::fs::closeFile(*fd);
  return crc;
}

bool processAlive(int64_t pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH);
}

struct FileRecord {
  std::string name;
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

/// The files a checkpoint's manifest lists, its step, and the number of
/// ranks that wrote it (1: one process, state.safetensors).
llvm::Expected<std::vector<FileRecord>>
readManifest(StringRef stepDir, int64_t &step, int64_t *ranks = nullptr);

/// Whether `path` is a checkpoint this code wrote: a real directory with a
/// valid manifest. Only such directories are ever replaced or deleted.
bool isOwnCheckpoint(StringRef path) {
  if (!isRealDirectory(path))
    return false;
  int64_t step;
  llvm::Expected<std::vector<FileRecord>> records = readManifest(path, step);
  if (!records) {
    llvm::consumeError(records.takeError());
    return false;
  }
  return true;
}

/// Renames `path` (a checkpoint of ours) aside, then deletes it, so that
/// an interrupted deletion never leaves a half-deleted directory that
/// still looks like a checkpoint.
std::error_code deleteCheckpointDir(StringRef dir, StringRef path) {
  std::string doomed =
      joinPath(dir, llvm::formatv(".old-{0}-{1}",
                                  llvm::sys::path::filename(path), ::getpid())
                        .str());
  if (std::error_code ec = llvm::sys::fs::rename(path, doomed))
    return ec;
  return llvm::sys::fs::remove_directories(doomed, /*IgnoreErrors=*/false);
}

} // namespace

void host::removeStaleTemporaries(StringRef dir) {
  std::error_code ec;
  std::vector<std::pair<std::string, llvm::sys::fs::file_type>> stale;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec)) {
    StringRef name = llvm::sys::path::filename(it->path());
    if (!name.starts_with(".tmp-step-") && !name.starts_with(".old-step-") &&
        !name.starts_with(".latest.tmp-"))
      continue;
    int64_t pid;
    if (name.rsplit('-').second.getAsInteger(10, pid) || processAlive(pid))
      continue;
    stale.push_back({it->path(), typeOf(it->path())});
  }
  // Only what a save makes: real directories and regular files. Anything
  // else under such a name (a symlink) is the user's and stays.
  for (const auto &[path, type] : stale) {
    if (type == llvm::sys::fs::file_type::directory_file)
      llvm::sys::fs::remove_directories(path, /*IgnoreErrors=*/true);
    else if (type == llvm::sys::fs::file_type::regular_file)
      llvm::sys::fs::remove(path);
  }
}

namespace {
/// One tensor of a state file that holds part of a moment kept as
/// HostState::hostState says: "<moment>.codes" (U8) and "<moment>.absmax"
/// under int8-moments, "<moment>.row_stat" and "<moment>.col_stat" for a
/// factored exp_avg_sq.
struct LeanPart {
  std::string name;
  StDType dtype;
  uint8_t *u8 = nullptr;
  std::vector<float> *f32 = nullptr;
  int64_t count = 0;
  /// Elements of the moment it accounts for when loaded (codes and
  /// row_stat: all of them; absmax and col_stat: none).
  int64_t covers = 0;
};

std::vector<LeanPart> leanParts(HostTensor &t) {
  const std::string &name = t.param->name;
  if (!t.codes.empty())
    return {{name + ".codes", StDType::U8, t.codes.data(), nullptr,
             static_cast<int64_t>(t.codes.size()), t.held()},
            {name + ".absmax", StDType::F32, nullptr, &t.absmax,
             static_cast<int64_t>(t.absmax.size()), 0}};
  if (!t.rowStat.empty())
    return {{name + ".row_stat", StDType::F32, nullptr, &t.rowStat,
             static_cast<int64_t>(t.rowStat.size()), t.held()},
            {name + ".col_stat", StDType::F32, nullptr, &t.colStat,
             static_cast<int64_t>(t.colStat.size()), 0}};
  return {};
}

/// The state's name of how it keeps its moments, as checkpoints record it.
std::string hostStateName(llvm::StringRef hostState) {
  return hostState.empty() ? "fp32 (or bf16) moments" : hostState.str();
}
} // namespace

uint64_t host::checkpointBytes(const HostState &state) {
  uint64_t bytes = 0;
  for (const HostTensor &t : state.tensors)
    if (t.param && isCheckpointParam(*t.param))
      bytes +=
          t.lean() || !t.bf16.empty()
              ? (t.codes.size() + 4 * t.absmax.size() + 4 * t.rowStat.size() +
                 4 * t.colStat.size() + 2 * t.bf16.size())
              : t.held() * sizeof(float); // this rank's, in a job
  // Headers, trainer state and manifest: names and offsets per tensor.
  return bytes + 256 * state.tensors.size() + (1u << 20);
}

Error host::checkCheckpointSpace(StringRef dir, const HostState &state) {
  llvm::ErrorOr<llvm::sys::fs::space_info> space =
      llvm::sys::fs::disk_space(dir);
  if (!space)
    return error("cannot query free space in '" + dir +
                 "': " + space.getError().message());
  // A new checkpoint is complete before the oldest kept one is deleted, so
  // the folder briefly holds one more than it keeps.
  uint64_t need = checkpointBytes(state);
  if (space->available < need)
    return error(llvm::formatv(
        "not enough space for a checkpoint in '{0}': it needs {1} MiB, {2} "
        "MiB are free (the new checkpoint is complete before the oldest kept "
        "one is deleted); free space or give another --checkpoint-dir",
        dir, (need + (1 << 20) - 1) >> 20, space->available >> 20));
  return Error::success();
}

std::string host::checkpointDirName(int64_t step) {
  return llvm::formatv("step-{0:d6}", step).str();
}

bool host::isCheckpointParam(const exec::Param &param) {
  return param.role == "master" || param.role == "moment" ||
         param.role == "frozen" || param.role == "ema";
}

llvm::Expected<std::vector<CheckpointInfo>>
host::listCheckpoints(StringRef dir) {
  if (!llvm::sys::fs::exists(dir))
    return std::vector<CheckpointInfo>();
  if (!llvm::sys::fs::is_directory(dir))
    return error("checkpoint directory '" + dir + "' is not a directory");
  return stepDirs(dir, /*completeOnly=*/true);
}

//===----------------------------------------------------------------------===//
// Saving
//===----------------------------------------------------------------------===//

namespace {

/// "state-rank-00001-of-00004.safetensors": rank 1's file of a
/// checkpoint of a job of 4 ranks.
std::string shardFileName(int rank, int ranks) {
  return llvm::formatv("state-rank-{0:d5}-of-{1:d5}.safetensors", rank, ranks)
      .str();
}

/// Writes this process's state file of a checkpoint to `path`: every
/// checkpoint tensor whole (one process), or in a job of several ranks
/// this rank's shard of each sharded tensor (flat) and, in rank 0's file,
/// the tensors every rank holds whole (docs/Distributed.md,
/// "Checkpoints"). `record` gets the file's size and CRC-32C.
Error writeStateFile(StringRef path, const HostState &state, int rank,
                     std::map<std::string, std::string> metadata,
                     FileRecord &record) {
  std::vector<StTensorToWrite> tensors;
  for (const HostTensor &t : state.tensors) {
    if (!t.param || !isCheckpointParam(*t.param))
      continue;
    if (t.sharded ? t.held() == 0 : rank != 0)
      continue; // nothing of it here (safetensors has no empty tensors)
    std::vector<int64_t> shape =
        t.sharded ? std::vector<int64_t>{t.held()} : t.param->type.shape;
    if (t.tier) { // read from the NVMe tier a chunk at a time
      bool bf16 = t.param->type.dtype == exec::DType::BF16;
      StTensorToWrite out{t.param->name, shape, nullptr,
                          bf16 ? StDType::BF16 : StDType::F32};
      int64_t step = state.step;
      out.source = [&t, bf16, step](int64_t begin, int64_t end,
                                    float *dst) -> Error {
        std::vector<uint16_t> narrow(bf16 ? end - begin : 0);
        void *into = bf16 ? static_cast<void *>(narrow.data()) : dst;
        if (Error e = t.tier->read(t.tierId, begin, end, into))
          return e;
        for (size_t k = 0; k < narrow.size(); ++k)
          dst[k] = cpu::bf16ToFloat(narrow[k]);
        if (std::optional<int64_t> bad = cpu::firstNonFinite(dst, end - begin))
          return error(llvm::formatv("cannot save checkpoint of step {0}: "
                                     "tensor '{1}' holds {2} at element {3}",
                                     step, t.param->name, dst[*bad],
                                     t.shardBegin + begin + *bad));
        return Error::success();
      };
      tensors.push_back(std::move(out));
      continue;
    }
    if (t.lean()) { // a moment in parts, saved as they are kept
      for (const LeanPart &part : leanParts(const_cast<HostTensor &>(t))) {
        if (part.f32)
          if (std::optional<int64_t> bad =
                  cpu::firstNonFinite(part.f32->data(), part.count))
            return error(llvm::formatv("cannot save checkpoint of step {0}: "
                                       "tensor '{1}' holds {2} at element {3}",
                                       state.step, part.name, (*part.f32)[*bad],
                                       *bad));
        StTensorToWrite w{part.name,
                          {part.count},
                          part.f32 ? part.f32->data() : nullptr,
                          part.dtype};
        w.u8 = part.u8;
        tensors.push_back(std::move(w));
      }
      continue;
    }
    if (!t.bf16.empty()) { // a bf16 EMA or m: saved as it is kept
      if (std::optional<int64_t> bad =
              cpu::firstNonFiniteBf16(t.bf16.data(), t.bf16.size()))
        return error(llvm::formatv("cannot save checkpoint of step {0}: "
                                   "tensor '{1}' holds a non-finite value at "
                                   "element {2}",
                                   state.step, t.param->name,
                                   t.shardBegin + *bad));
      tensors.push_back(
          {t.param->name, shape, nullptr, StDType::BF16, t.bf16.data()});
      continue;
    }
    if (static_cast<int64_t>(t.data.size()) != t.held())
      return error(llvm::formatv("cannot save checkpoint: tensor '{0}' holds "
                                 "{1} values, its type needs {2}",
                                 t.param->name, t.data.size(), t.held()));
    // A checkpoint is what a run falls back to: it never holds NaN or Inf.
    if (std::optional<int64_t> bad =
            cpu::firstNonFinite(t.data.data(), t.data.size()))
      return error(llvm::formatv("cannot save checkpoint of step {0}: tensor "
                                 "'{1}' holds {2} at element {3}",
                                 state.step, t.param->name, t.data[*bad],
                                 t.shardBegin + *bad));
    tensors.push_back({t.param->name, shape, t.data.data(), StDType::F32});
  }
  SafetensorsWriteOptions options;
  options.metadata = std::move(metadata);
  // Only with int8 or factored moments: other checkpoints stay as they were.
  if (!state.hostState.empty())
    options.metadata["host_state"] = state.hostState;
  options.metadata["format"] = kFormat.str();
  options.metadata["step"] = std::to_string(state.step);
  options.sync = true;
  options.crc32c = &record.crc;
  if (Error e = writeSafetensors(path, tensors, options))
    return e;
  if (std::error_code ec = llvm::sys::fs::file_size(path, record.bytes))
    return error("cannot stat '" + path + "': " + ec.message());
  return Error::success();
}

/// Writes trainer.json and, last, the manifest of `records` (and
/// trainer.json) into `tmp`. A checkpoint of a job of several ranks is
/// format version 2, which records them.
Error writeTrainerAndManifest(StringRef tmp, int64_t step,
                              StringRef trainerState,
                              std::vector<FileRecord> records, int ranks) {
  int64_t version = ranks > 1 ? kCheckpointFormatVersion : 1;
  llvm::json::Object trainer{{"format", kFormat},
                             {"version", version},
                             {"step", step},
                             {"trainer_state", trainerState.str()}};
  std::string trainerText =
      llvm::formatv("{0:2}\n", llvm::json::Value(std::move(trainer))).str();
  if (Error e = writeFile(joinPath(tmp, kTrainerFile), trainerText, true))
    return e;
  records.push_back(
      {kTrainerFile.str(), trainerText.size(),
       crc32c(0, llvm::ArrayRef<uint8_t>(
                     reinterpret_cast<const uint8_t *>(trainerText.data()),
                     trainerText.size()))});

  llvm::json::Array files;
  for (const FileRecord &r : records)
    files.push_back(llvm::json::Object{{"name", r.name},
                                       {"bytes", static_cast<int64_t>(r.bytes)},
                                       {"crc32c", hex32(r.crc)}});
  llvm::json::Object manifest{{"format", kManifestFormat},
                              {"version", version},
                              {"step", step},
                              {"checksum", "crc32c"},
                              {"files", std::move(files)}};
  if (ranks > 1)
    manifest["ranks"] = ranks;
  std::string manifestText =
      llvm::formatv("{0:2}\n", llvm::json::Value(std::move(manifest))).str();
  // Written last: its presence marks the files complete.
  if (Error e = writeFile(joinPath(tmp, kManifestFile), manifestText, true))
    return e;
  return syncDirectory(tmp);
}

/// Where a checkpoint of `state` is written: the temporary folder (created
/// empty) and its final name.
struct SaveTarget {
  std::string name, tmp, final;
};

/// The checks before a checkpoint of `state` is written into `dir`, and
/// its temporary folder, named after process `pid`.
llvm::Expected<SaveTarget> prepareSave(StringRef dir, const HostState &state,
                                       StringRef trainerState, int pid) {
  if (state.step < 0)
    return error(
        llvm::formatv("cannot save a checkpoint of step {0}", state.step));
  if (!llvm::json::isUTF8(trainerState))
    return error("cannot save checkpoint: the trainer state is not UTF-8");
  if (std::error_code ec = llvm::sys::fs::create_directories(
          dir, /*IgnoreExisting=*/true, llvm::sys::fs::all_all))
    return error("cannot create checkpoint directory '" + dir +
                 "': " + ec.message());

  if (Error e = checkCheckpointSpace(dir, state))
    return std::move(e);

  SaveTarget target;
  target.name = checkpointDirName(state.step);
  target.tmp =
      joinPath(dir, llvm::formatv(".tmp-{0}-{1}", target.name, pid).str());
  target.final = joinPath(dir, target.name);
  // Replaced below only if it is a checkpoint of ours: a symlink or a
  // folder of the user's under that name is refused, never emptied.
  if (typeOf(target.final) != llvm::sys::fs::file_type::file_not_found &&
      !isOwnCheckpoint(target.final))
    return error("cannot save checkpoint: '" + target.final +
                 "' exists and is not a checkpoint directory this program "
                 "wrote (a symlink or a folder of yours?); move it away");
  llvm::sys::fs::remove_directories(target.tmp, /*IgnoreErrors=*/true);
  if (std::error_code ec = llvm::sys::fs::create_directory(
          target.tmp, /*IgnoreExisting=*/false, llvm::sys::fs::all_all))
    return error("cannot create '" + target.tmp + "': " + ec.message());
  return target;
}

/// Puts the complete checkpoint in `target.tmp` in place under its final
/// name, points `latest` at it and applies the retention.
llvm::Expected<std::string> commitSave(StringRef dir, const SaveTarget &target,
                                       int64_t step,
                                       const CheckpointOptions &options) {
  const std::string &name = target.name, &tmp = target.tmp,
                    &final = target.final;
  int pid = ::getpid();
  // A checkpoint of the same step (a rerun from an earlier one) is moved
  // aside, not deleted, until the new one is in place.
  std::string old;
  if (isRealDirectory(final)) {
    old = joinPath(dir, llvm::formatv(".old-{0}-{1}", name, pid).str());
    llvm::sys::fs::remove_directories(old, /*IgnoreErrors=*/true);
    if (std::error_code ec = llvm::sys::fs::rename(final, old)) {
      llvm::sys::fs::remove_directories(tmp, /*IgnoreErrors=*/true);
      return error("cannot move aside '" + final + "': " + ec.message());
    }
  }
  if (std::error_code ec = llvm::sys::fs::rename(tmp, final)) {
    if (!old.empty())
      llvm::sys::fs::rename(old, final);
    llvm::sys::fs::remove_directories(tmp, /*IgnoreErrors=*/true);
    return error("cannot rename '" + tmp + "' to '" + final +
                 "': " + ec.message());
  }
  if (Error e = syncDirectory(dir))
    return std::move(e);
  if (!old.empty())
    llvm::sys::fs::remove_directories(old, /*IgnoreErrors=*/true);

  std::string latestTmp =
      joinPath(dir, llvm::formatv(".latest.tmp-{0}", pid).str());
  if (Error e = writeFile(latestTmp, name + "\n", /*sync=*/true))
    return std::move(e);
  std::string latest = joinPath(dir, kLatestFile);
  if (std::error_code ec = llvm::sys::fs::rename(latestTmp, latest)) {
    llvm::sys::fs::remove(latestTmp);
    return error("cannot rename '" + latestTmp + "' to '" + latest +
                 "': " + ec.message());
  }
  if (Error e = syncDirectory(dir))
    return std::move(e);

  // Retention, now that the new checkpoint is complete and named by
  // `latest`. Checkpoints of later steps (a run restarted from an earlier
  // one) are not ours to judge and stay, unless this run replaces them all.
  // Only real directories with a valid manifest are deleted.
  std::vector<CheckpointInfo> doomed;
  std::vector<CheckpointInfo> older;
  for (const CheckpointInfo &c : stepDirs(dir, /*completeOnly=*/true)) {
    if (c.step == step || !isOwnCheckpoint(c.path))
      continue;
    if (options.replaceOthers)
      doomed.push_back(c);
    else if (c.step < step)
      older.push_back(c);
  }
  if (options.keep > 0)
    for (size_t i = 0; i + (options.keep - 1) < older.size(); ++i)
      doomed.push_back(older[i]);
  for (const CheckpointInfo &c : doomed)
    if (std::error_code ec = deleteCheckpointDir(dir, c.path))
      return error("checkpoint '" + final + "' saved, but deleting '" + c.path +
                   "' failed: " + ec.message());
  removeStaleTemporaries(dir);
  return final;
}

/// One phase of a job's checkpoint: every rank's outcome (and `payload`)
/// goes to every rank, so that all fail together, with the failing rank's
/// message, or all go on. Untimed: a rank may wait for the others' writes.
llvm::Expected<std::vector<std::string>>
agree(dist::Collectives &job, Error mine, StringRef payload = "") {
  std::string message =
      mine ? "!" + llvm::toString(std::move(mine)) : "=" + payload.str();
  llvm::Expected<std::vector<std::string>> all = job.untimedAllGather(message);
  if (!all)
    return all.takeError();
  for (size_t r = 0; r < all->size(); ++r) {
    StringRef m = (*all)[r];
    if (m.starts_with("!"))
      return error(
          r == static_cast<size_t>(job.rank())
              ? m.drop_front().str()
              : llvm::formatv("rank {0}: {1}", r, m.drop_front()).str());
  }
  for (std::string &m : *all)
    m.erase(0, 1);
  return all;
}

/// A job's checkpoint: rank 0 prepares the folder, every rank writes its
/// file, rank 0 writes the manifest after all of them and commits.
llvm::Expected<std::string>
saveJobCheckpoint(StringRef dir, const HostState &state, StringRef trainerState,
                  const CheckpointOptions &options, dist::Collectives &job) {
  bool root = job.rank() == 0;
  int ranks = job.size();
  llvm::Expected<SaveTarget> prepared =
      root ? prepareSave(dir, state, trainerState, ::getpid())
           : llvm::Expected<SaveTarget>(SaveTarget());
  Error mine = prepared ? Error::success() : prepared.takeError();
  llvm::Expected<std::vector<std::string>> folder =
      agree(job, std::move(mine), prepared ? prepared->tmp : "");
  if (!folder)
    return folder.takeError();
  std::string tmp = (*folder)[0];

  FileRecord record{shardFileName(job.rank(), ranks)};
  Error wrote = Error::success();
  if (!root) // the folder is rank 0's; this rank's room is checked here
    wrote = checkCheckpointSpace(dir, state);
  if (!wrote)
    wrote = writeStateFile(joinPath(tmp, record.name), state, job.rank(),
                           {{"rank", std::to_string(job.rank())},
                            {"ranks", std::to_string(ranks)}},
                           record);
  llvm::Expected<std::vector<std::string>> written =
      agree(job, std::move(wrote),
            llvm::formatv("{0} {1}", record.bytes, hex32(record.crc)).str());
  if (!written) {
    if (root)
      llvm::sys::fs::remove_directories(tmp, /*IgnoreErrors=*/true);
    return written.takeError();
  }

  llvm::Expected<std::string> committed = std::string();
  if (root) {
    std::vector<FileRecord> records;
    for (int r = 0; r < ranks; ++r) {
      FileRecord one{shardFileName(r, ranks)};
      StringRef bytes, crc;
      std::tie(bytes, crc) = StringRef((*written)[r]).split(' ');
      bytes.getAsInteger(10, one.bytes);
      crc.getAsInteger(16, one.crc);
      records.push_back(std::move(one));
    }
    if (Error e = writeTrainerAndManifest(tmp, state.step, trainerState,
                                          std::move(records), ranks)) {
      llvm::sys::fs::remove_directories(tmp, /*IgnoreErrors=*/true);
      committed = std::move(e);
    } else {
      committed = commitSave(dir, *prepared, state.step, options);
    }
  }
  Error outcome = committed ? Error::success() : committed.takeError();
  if (llvm::Expected<std::vector<std::string>> done =
          agree(job, std::move(outcome));
      !done)
    return done.takeError();
  return joinPath(dir, checkpointDirName(state.step));
}

} // namespace

llvm::Expected<std::string>
host::saveCheckpoint(StringRef dir, const HostState &state,
                     StringRef trainerState, const CheckpointOptions &options,
                     dist::Collectives *job) {
  if (job && job->size() > 1)
    return saveJobCheckpoint(dir, state, trainerState, options, *job);
  llvm::Expected<SaveTarget> target =
      prepareSave(dir, state, trainerState, ::getpid());
  if (!target)
    return target.takeError();
  FileRecord stateRecord{kStateFile.str()};
  Error written = writeStateFile(joinPath(target->tmp, kStateFile), state, 0,
                                 {}, stateRecord);
  if (!written)
    written = writeTrainerAndManifest(target->tmp, state.step, trainerState,
                                      {stateRecord}, 1);
  if (written) {
    llvm::sys::fs::remove_directories(target->tmp, /*IgnoreErrors=*/true);
    return std::move(written);
  }
  return commitSave(dir, *target, state.step, options);
}

//===----------------------------------------------------------------------===//
// Loading
//===----------------------------------------------------------------------===//

namespace {

llvm::Expected<std::vector<FileRecord>>
readManifest(StringRef stepDir, int64_t &step, int64_t *ranksOut) {
  std::string path = joinPath(stepDir, kManifestFile);
  if (!llvm::sys::fs::exists(path))
    return error("'" + stepDir +
                 "' is not a complete checkpoint: " + kManifestFile +
                 (llvm::sys::fs::is_directory(stepDir) ? " is missing"
                                                       : " is missing (no such "
                                                         "directory)"));
  llvm::Expected<std::string> text =
      readSmallFile(path, kMaxCheckpointJsonBytes);
  if (!text)
    return text.takeError();
  auto bad = [&](const llvm::Twine &what) {
    return error("'" + path + "' is corrupt: " + what);
  };
  llvm::Expected<llvm::json::Value> json = parseJson(*text);
  if (!json)
    return bad("not valid JSON: " + llvm::toString(json.takeError()));
  const llvm::json::Object *root = json->getAsObject();
  if (!root || root->getString("format") != kManifestFormat)
    return bad("not a MegaSlide checkpoint manifest");
  std::optional<int64_t> version = root->getInteger("version");
  if (!version || *version < 1 || *version > kCheckpointFormatVersion)
    return bad(llvm::formatv("unsupported version (this build reads up to "
                             "{0})",
                             kCheckpointFormatVersion));
  std::optional<int64_t> manifestStep = root->getInteger("step");
  if (!manifestStep || *manifestStep < 0)
    return bad("no valid 'step'");
  step = *manifestStep;
  if (root->getString("checksum") != "crc32c")
    return bad("unknown 'checksum' (expected \"crc32c\")");
  const llvm::json::Array *files = root->getArray("files");
  if (!files)
    return bad("no 'files' array");
  std::vector<FileRecord> records;
  for (const llvm::json::Value &v : *files) {
    const llvm::json::Object *f = v.getAsObject();
    std::optional<StringRef> name = f ? f->getString("name") : std::nullopt;
    std::optional<int64_t> bytes = f ? f->getInteger("bytes") : std::nullopt;
    std::optional<StringRef> crc = f ? f->getString("crc32c") : std::nullopt;
    uint32_t crcValue;
    if (!name || !bytes || *bytes < 0 || !crc || crc->size() != 8 ||
        crc->getAsInteger(16, crcValue))
      return bad("a 'files' entry lacks a valid name, bytes or crc32c");
    // A name read from the file stays in the checkpoint's folder.
    if (name->empty() || *name == "." || *name == ".." ||
        name->contains('/') || name->contains('\0'))
      return bad("the 'files' entry '" + *name +
                 "' is not a file name in the checkpoint's folder");
    records.push_back({name->str(), static_cast<uint64_t>(*bytes), crcValue});
  }
  // Version 2: a job's, one state file per rank.
  int64_t ranks = *version >= 2 ? root->getInteger("ranks").value_or(0) : 1;
  if (ranks < 1 || ranks > (1 << 20))
    return bad("no valid 'ranks'");
  std::vector<std::string> required{kTrainerFile.str()};
  for (int64_t r = 0; r < ranks; ++r)
    required.push_back(ranks == 1 ? kStateFile.str() : shardFileName(r, ranks));
  for (StringRef name : required)
    if (llvm::none_of(records,
                      [&](const FileRecord &r) { return r.name == name; }))
      return bad("'" + name + "' is not listed");
  if (ranksOut)
    *ranksOut = ranks;
  return records;
}

Error checksumError(StringRef path, uint32_t actual, uint32_t expected) {
  return error("'" + path + "' is corrupt: its CRC-32C is " + hex32(actual) +
               ", the manifest records " + hex32(expected));
}

/// The step and opaque trainer state of trainer.json in `stepDir`, checked
/// against the manifest's `records` and `manifestStep`.
llvm::Expected<std::pair<int64_t, std::string>>
readTrainerFile(StringRef stepDir, llvm::ArrayRef<FileRecord> records,
                int64_t manifestStep) {
  std::string trainerPath = joinPath(stepDir, kTrainerFile);
  llvm::Expected<std::string> trainerText =
      readSmallFile(trainerPath, kMaxCheckpointJsonBytes);
  if (!trainerText)
    return trainerText.takeError();
  for (const FileRecord &r : records) {
    if (r.name != kTrainerFile)
      continue;
    uint32_t crc =
        crc32c(0, llvm::ArrayRef<uint8_t>(
                      reinterpret_cast<const uint8_t *>(trainerText->data()),
                      trainerText->size()));
    if (crc != r.crc)
      return checksumError(trainerPath, crc, r.crc);
  }
  auto badTrainer = [&](const llvm::Twine &what) {
    return error("'" + trainerPath + "' is corrupt: " + what);
  };
  llvm::Expected<llvm::json::Value> trainerJson = parseJson(*trainerText);
  if (!trainerJson)
    return badTrainer("not valid JSON: " +
                      llvm::toString(trainerJson.takeError()));
  const llvm::json::Object *trainer = trainerJson->getAsObject();
  if (!trainer || trainer->getString("format") != kFormat)
    return badTrainer("not a MegaSlide checkpoint trainer file");
  std::optional<int64_t> version = trainer->getInteger("version");
  if (!version || *version < 1 || *version > kCheckpointFormatVersion)
    return badTrainer("unsupported version");
  std::optional<int64_t> step = trainer->getInteger("step");
  std::optional<StringRef> opaque = trainer->getString("trainer_state");
  if (!step || !opaque)
    return badTrainer("'step' or 'trainer_state' missing");
  if (*step != manifestStep)
    return badTrainer(
        llvm::formatv("step {0}, the manifest says {1}", *step, manifestStep));

  return std::make_pair(*step, opaque->str());
}

} // namespace

namespace {

/// The elements of a tensor of `count` elements that file `r` of a
/// checkpoint written by `ranks` ranks holds: its shard of a sharded
/// tensor, or all of it (rank 0's file; one process's).
dist::ShardRange heldInFile(const exec::Param &param, int64_t r,
                            int64_t ranks) {
  int64_t count = param.type.numElements();
  return shardedRole(param.role, static_cast<int>(ranks))
             ? dist::shardRange(count, static_cast<int>(r),
                                static_cast<int>(ranks))
             : dist::ShardRange{0, r == 0 ? count : 0};
}

/// Reads the state file `path` of a checkpoint (file `r` of `ranks`),
/// checksumming every byte, into the elements of `state` it overlaps;
/// `copied` counts each tensor's elements taken.
Error readStateFile(StringRef path, uint32_t expectedCrc, int64_t r,
                    int64_t ranks, HostState &state,
                    llvm::StringMap<int64_t> &copied) {
  llvm::Expected<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::open(path);
  if (!reader) {
    // Say whether the bytes changed since saving or the save was wrong.
    std::string why = llvm::toString(reader.takeError());
    llvm::Expected<uint32_t> crc = crcOfFile(path);
    if (crc && *crc != expectedCrc)
      return error(why + " (its CRC-32C is " + hex32(*crc) +
                   ", the manifest records " + hex32(expectedCrc) +
                   ": the file is corrupt)");
    if (!crc)
      llvm::consumeError(crc.takeError());
    return error(why);
  }
  const SafetensorsReader &file = **reader;
  // A checkpoint's moments load only into a state that keeps them alike.
  auto saved = file.metadata().find("host_state");
  std::string savedState =
      saved == file.metadata().end() ? std::string() : saved->second;
  if (savedState != state.hostState)
    return error("'" + path + "' keeps the AdamW moments as " +
                 hostStateName(savedState) + ", this run's plan as " +
                 hostStateName(state.hostState) +
                 ": resume with the --host-state-policy it was saved with");
  // The parts of moments kept in parts, by name.
  llvm::StringMap<std::pair<HostTensor *, LeanPart>> parts;
  for (HostTensor &t : state.tensors)
    if (t.param && t.lean())
      for (LeanPart &part : leanParts(t))
        parts[part.name] = {&t, part};
  auto isWhole = [&](const exec::Param &p) {
    const HostTensor *t = state.find(p.name);
    return isCheckpointParam(p) && !(t && t->lean());
  };
  if (ranks == 1) { // one process's file: every tensor, whole
    llvm::StringMap<FoundTensor> found;
    for (const StTensorInfo &info : file.tensors())
      if (!parts.count(info.name))
        found[info.name] = {&file, &info};
    if (Error e = checkTensorSet(path, found, state, isWhole))
      return e;
    for (const auto &entry : parts) {
      const StTensorInfo *info = file.find(entry.first());
      const LeanPart &part = entry.second.second;
      if (!info || info->dtype != part.dtype ||
          info->shape != std::vector<int64_t>{part.count})
        return error(
            llvm::formatv("'{0}' does not match the model: {1} {2} [{3}] {4}",
                          path, part.name, stDTypeName(part.dtype), part.count,
                          info ? "is stored otherwise" : "is missing"));
    }
  }
  for (const StTensorInfo &info : file.tensors()) {
    if (parts.count(info.name))
      continue;
    HostTensor *t = state.find(info.name);
    if (!t || !t->param || !isCheckpointParam(*t->param))
      return error("'" + path + "' holds tensor '" + info.name +
                   "', which this run's state does not");
    dist::ShardRange in = heldInFile(*t->param, r, ranks);
    bool shard = shardedRole(t->param->role, static_cast<int>(ranks));
    if (ranks > 1 &&
        (info.numElements() != in.size() ||
         (shard ? info.shape.size() != 1 : info.shape != t->param->type.shape)))
      return error(llvm::formatv("'{0}': tensor '{1}' has {2} elements; this "
                                 "file of a checkpoint of {3} ranks holds {4}",
                                 path, info.name, info.numElements(), ranks,
                                 in.size()));
  }

  // Read in file order, checksumming every byte on the way, so that the
  // file is read once; each tensor's part this rank holds is kept.
  uint32_t crc = 0;
  auto onRaw = [&](llvm::ArrayRef<uint8_t> bytes) { crc = crc32c(crc, bytes); };
  if (Error e = file.readRaw(0, file.dataStart(), onRaw))
    return e;
  uint64_t pos = file.dataStart();
  std::vector<float> values;
  for (const StTensorInfo &info : file.tensors()) {
    uint64_t begin = file.dataStart() + info.begin;
    if (begin > pos)
      if (Error e = file.readRaw(pos, begin - pos, onRaw))
        return e;
    if (auto it = parts.find(info.name); it != parts.end()) {
      // As kept: codes byte for byte, statistics in fp32.
      auto &[t, part] = it->second;
      if (part.u8) {
        uint8_t *dst = part.u8;
        if (Error e = file.readRaw(begin, info.end - info.begin,
                                   [&](llvm::ArrayRef<uint8_t> bytes) {
                                     onRaw(bytes);
                                     dst = std::copy(bytes.begin(), bytes.end(),
                                                     dst);
                                   }))
          return e;
      } else if (Error e = file.readF32(info, *part.f32, onRaw)) {
        return e;
      }
      copied[t->param->name] += part.covers;
      pos = file.dataStart() + info.end;
      continue;
    }
    HostTensor &t = *state.find(info.name);
    dist::ShardRange in = heldInFile(*t.param, r, ranks);
    values.resize(static_cast<size_t>(info.numElements()));
    if (Error e = file.readF32(info, values, onRaw))
      return e;
    int64_t lo = std::max(in.begin, t.heldBegin()),
            hi = std::min(in.end, t.heldEnd());
    if (t.tier) {
      if (lo < hi) {
        const float *from = values.data() + (lo - in.begin);
        int64_t at = lo - t.heldBegin();
        if (t.param->type.dtype == exec::DType::BF16) {
          std::vector<uint16_t> narrow(hi - lo);
          for (int64_t k = 0; k < hi - lo; ++k)
            narrow[k] = cpu::floatToBf16(from[k]);
          if (Error e =
                  t.tier->write(t.tierId, at, at + (hi - lo), narrow.data()))
            return e;
        } else if (Error e =
                       t.tier->write(t.tierId, at, at + (hi - lo), from)) {
          return e;
        }
      }
    } else if (t.param->type.dtype == exec::DType::BF16 || !t.bf16.empty()) {
      // Widened exactly, then rounded back to the same bits.
      t.bf16.resize(t.held());
      for (int64_t k = lo; k < hi; ++k)
        t.bf16[k - t.heldBegin()] = cpu::floatToBf16(values[k - in.begin]);
    } else {
      t.data.resize(t.held());
      std::copy(values.begin() + (lo - in.begin),
                values.begin() + (hi - in.begin),
                t.data.begin() + (lo - t.heldBegin()));
    }
    copied[info.name] += std::max<int64_t>(hi - lo, 0);
    pos = file.dataStart() + info.end;
  }
  if (file.fileSize() > pos)
    if (Error e = file.readRaw(pos, file.fileSize() - pos, onRaw))
      return e;
  if (crc != expectedCrc)
    return checksumError(path, crc, expectedCrc);
  return Error::success();
}

} // namespace

Error host::loadCheckpoint(StringRef stepDir, HostState &state,
                           std::string &trainerState) {
  int64_t manifestStep = 0, ranks = 1;
  llvm::Expected<std::vector<FileRecord>> records =
      readManifest(stepDir, manifestStep, &ranks);
  if (!records)
    return records.takeError();

  // Sizes first: truncation is found without reading gigabytes.
  for (const FileRecord &r : *records) {
    std::string path = joinPath(stepDir, r.name);
    uint64_t size;
    if (std::error_code ec = llvm::sys::fs::file_size(path, size))
      return error("checkpoint file '" + path + "': " + ec.message());
    if (size != r.bytes)
      return error(llvm::formatv("'{0}' is {1} bytes, the manifest records "
                                 "{2} ({3})",
                                 path, size, r.bytes,
                                 size < r.bytes ? "truncated" : "modified"));
  }
  llvm::Expected<std::pair<int64_t, std::string>> trainer =
      readTrainerFile(stepDir, *records, manifestStep);
  if (!trainer)
    return trainer.takeError();

  // The files that hold some of this process's elements: a job's
  // checkpoint resumes on any number of ranks (docs/Distributed.md,
  // "Checkpoints").
  llvm::StringMap<int64_t> copied;
  for (int64_t r = 0; r < ranks; ++r) {
    bool needed = false;
    for (const HostTensor &t : state.tensors)
      if (t.param && isCheckpointParam(*t.param)) {
        dist::ShardRange in = heldInFile(*t.param, r, ranks);
        needed |=
            std::max(in.begin, t.heldBegin()) < std::min(in.end, t.heldEnd());
      }
    if (!needed)
      continue;
    std::string name = ranks == 1 ? kStateFile.str() : shardFileName(r, ranks);
    auto record = llvm::find_if(
        *records, [&](const FileRecord &f) { return f.name == name; });
    if (Error e = readStateFile(joinPath(stepDir, name), record->crc, r, ranks,
                                state, copied))
      return e;
  }
  for (const HostTensor &t : state.tensors)
    if (t.param && isCheckpointParam(*t.param) &&
        copied.lookup(t.param->name) != t.held())
      return error(llvm::formatv("checkpoint '{0}' lacks {1} of the {2} "
                                 "elements of '{3}' this process holds",
                                 stepDir,
                                 t.held() - copied.lookup(t.param->name),
                                 t.held(), t.param->name));

  state.step = trainer->first;
  trainerState = std::move(trainer->second);
  return Error::success();
}

namespace {

/// Where to go when the checkpoint `failed` names (a step-N directory name;
/// empty: `latest` itself) cannot be used: the newest other complete
/// checkpoint, as a suggestion a user of --resume can follow, since
/// `latest` is what selects the checkpoint.
std::string suggestOther(StringRef dir, StringRef failed) {
  std::vector<CheckpointInfo> complete = stepDirs(dir, /*completeOnly=*/true);
  for (auto it = complete.rbegin(); it != complete.rend(); ++it)
    if (llvm::sys::path::filename(it->path) != failed)
      return std::string(failed.empty() ? "; the newest complete"
                                        : "; the previous") +
             " checkpoint is '" + it->path + "': to resume from it, write '" +
             llvm::sys::path::filename(it->path).str() + "' into '" +
             joinPath(dir, kLatestFile) + "'";
  return "; no other complete checkpoint is in '" + dir.str() + "'";
}

/// The step-N directory name `dir`/latest holds.
llvm::Expected<std::string> readLatestName(StringRef dir) {
  std::string latestPath = joinPath(dir, kLatestFile);
  if (!llvm::sys::fs::exists(latestPath)) {
    std::vector<CheckpointInfo> complete =
        stepDirs(dir, /*completeOnly=*/true);
    if (complete.empty())
      return error("no checkpoint in '" + dir + "' ('" + latestPath +
                   "' does not exist)");
    // A save renames its folder into place, then writes `latest`: a run
    // killed between the two (a second Ctrl-C while the first checkpoint is
    // written) leaves a complete checkpoint that nothing names yet. It is
    // the newest state, as `latest` would have said.
    StringRef name = llvm::sys::path::filename(complete.back().path);
    llvm::WithColor::note(llvm::errs(), "megaslide")
        << "'" << latestPath << "' is missing (a save was interrupted before "
        << "it named its checkpoint); resuming from the newest complete one, '"
        << name << "'\n";
    return name.str();
  }
  llvm::Expected<std::string> text =
      readSmallFile(latestPath, kMaxCheckpointLatestBytes);
  if (!text)
    return text.takeError();
  StringRef name = StringRef(*text).trim();
  if (!parseStepDirName(name)) {
    std::string shown = StringRef(*text).take_front(40).trim().str();
    // Not echoed raw: control bytes would garble (or drive) the terminal.
    if (!llvm::json::isUTF8(shown) || llvm::any_of(shown, [](char c) {
          return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
        }))
      shown = "<binary>";
    return error("'" + latestPath +
                 "' is corrupt (it should name a step-N "
                 "directory but holds \"" +
                 shown + "\")" + suggestOther(dir, ""));
  }
  return name.str();
}

} // namespace

Error host::loadLatestCheckpoint(StringRef dir, HostState &state,
                                 std::string &trainerState) {
  llvm::Expected<std::string> name = readLatestName(dir);
  if (!name)
    return name.takeError();
  if (Error e = loadCheckpoint(joinPath(dir, *name), state, trainerState))
    return error(llvm::toString(std::move(e)) + suggestOther(dir, *name));
  return Error::success();
}

llvm::Expected<std::string> host::readLatestTrainerState(StringRef dir) {
  llvm::Expected<std::string> name = readLatestName(dir);
  if (!name)
    return name.takeError();
  std::string stepDir = joinPath(dir, *name);
  int64_t manifestStep = 0;
  llvm::Expected<std::vector<FileRecord>> records =
      readManifest(stepDir, manifestStep);
  if (!records)
    return error(llvm::toString(records.takeError()) +
                 suggestOther(dir, *name));
  llvm::Expected<std::pair<int64_t, std::string>> trainer =
      readTrainerFile(stepDir, *records, manifestStep);
  if (!trainer)
    return error(llvm::toString(trainer.takeError()) +
                 suggestOther(dir, *name));
  return std::move(trainer->second);
}

//===----------------------------------------------------------------------===//
// Locking
//===----------------------------------------------------------------------===//

llvm::Expected<std::unique_ptr<CheckpointLock>>
CheckpointLock::acquire(StringRef dir) {
  if (std::error_code ec = llvm::sys::fs::create_directories(
          dir, /*IgnoreExisting=*/true, llvm::sys::fs::all_all))
    return error("cannot create checkpoint directory '" + dir +
                 "': " + ec.message());
  std::string path = joinPath(dir, ".lock");
  // The holder removes the file when it is done; a file locked after its
  // removal is not the lock, so take it again (a few times: each retry
  // means another run came and went).
  for (int attempt = 0; attempt < 100; ++attempt) {
    // O_NOFOLLOW: a symlink planted under the name must not redirect the
    // pid write below into a file of the user's.
    int fd =
        ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
      return error("cannot create lock file '" + path +
                   "': " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      std::string holder;
      char buf[32] = {};
      ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      int64_t pid;
      if (n > 0 && !StringRef(buf, n).trim().getAsInteger(10, pid))
        holder = llvm::formatv(" (pid {0})", pid).str();
      ::close(fd);
      if (err == EWOULDBLOCK)
        return error("checkpoint directory '" + dir +
                     "' is in use by another run" + holder +
                     "; wait for it to end or give another --checkpoint-dir");
      return error("cannot lock '" + path + "': " + std::strerror(err));
    }
    struct stat held, named;
    if (::fstat(fd, &held) != 0 || ::stat(path.c_str(), &named) != 0 ||
        held.st_ino != named.st_ino || held.st_dev != named.st_dev) {
      ::close(fd);
      continue;
    }
    std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) !=
                                       static_cast<ssize_t>(pid.size())) {
      int err = errno;
      ::close(fd);
      return error("cannot write lock file '" + path +
                   "': " + std::strerror(err));
    }
    return std::unique_ptr<CheckpointLock>(new CheckpointLock(fd, path));
  }
  return error("cannot lock '" + path + "': it keeps being replaced");
}

CheckpointLock::~CheckpointLock() {
  // Removed while still held, so that no run leaves it behind; acquire()
  // tells a removed file from the lock.
  ::unlink(path.c_str());
  ::close(fd);
}
