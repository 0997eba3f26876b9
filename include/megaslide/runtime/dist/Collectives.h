//===- Collectives.h - A job of several processes ---------------*- C++ -*-===//
//
// Data parallelism's process model (docs/Distributed.md): one process per
// GPU, launched by mpirun or srun, each a rank of the job. Where this
// process sits comes from the launcher's environment; the host-side
// collectives run on MPI, loaded at run time from a plugin built against
// it (libMegaSlideMpi.so), so a process of one rank runs without MPI
// installed, as the runtime-only bundle does.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_DIST_COLLECTIVES_H
#define MEGASLIDE_RUNTIME_DIST_COLLECTIVES_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megaslide::dist {

/// Where this process sits in its job.
struct World {
  int rank = 0, size = 1;
  /// Among the ranks on this node (a rank's GPU is its local rank).
  int localRank = 0, localSize = 1;
  /// What started the job: "mpirun" (Open MPI), "mpiexec" (MPICH's
  /// Hydra), "srun"; empty for a process started by itself.
  std::string launcher;
};

/// The elements [begin, end) of a tensor that one rank holds of a sharded
/// host tensor (docs/Distributed.md, "Memory").
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
/// Rank `rank`'s shard of a tensor of `count` elements over `ranks` ranks:
/// balanced, every boundary on a multiple of kShardAlign elements (a
/// 64-byte line of floats, as the host AdamW splits its work), rank 0's
/// the largest.
ShardRange shardRange(int64_t count, int rank, int ranks);
inline constexpr int64_t kShardAlign = 16;

/// The job this process belongs to, from the launcher's environment:
/// Open MPI's OMPI_COMM_WORLD_*, Hydra's PMI_RANK/PMI_SIZE, Slurm's
/// SLURM_PROCID/SLURM_STEP_NUM_TASKS (set for an srun step, not for the
/// batch script itself). A malformed value is an error naming it.
llvm::Expected<World> worldFromEnvironment();

/// The host-side collectives of a job. Every rank calls the same ones in
/// the same order; a call returns when the collective is complete on this
/// rank. Results are the same bits on every rank.
class Collectives {
public:
  virtual ~Collectives();
  const World &world() const { return where; }
  int rank() const { return where.rank; }
  int size() const { return where.size; }
  /// This rank's host name.
  const std::string &host() const { return hostName; }
  /// Every rank's host name, in rank order: gathered by the first call
  /// (a collective), kept after.
  llvm::Expected<const std::vector<std::string> &> hosts();

  /// In place: the element-wise sum over the ranks.
  virtual llvm::Error allReduceSum(llvm::MutableArrayRef<float> data) = 0;
  virtual llvm::Error allReduceSum(llvm::MutableArrayRef<double> data) = 0;
  /// Every rank's `mine` (of any length), in rank order.
  llvm::Expected<std::vector<std::string>> allGather(llvm::StringRef mine) {
    return gatherStrings(mine, /*timed=*/true);
  }
  /// The same without the watchdog's limit: the ranks of a checkpoint wait
  /// for each other's writes, however long they take.
  llvm::Expected<std::vector<std::string>>
  untimedAllGather(llvm::StringRef mine) {
    return gatherStrings(mine, /*timed=*/false);
  }
  virtual llvm::Error barrier() = 0;
  /// In place: each rank's shardRange of a tensor of `count` elements of
  /// `elementBytes` (1, 2 or 4) bytes at `data` goes to every rank, which
  /// then holds all of it.
  virtual llvm::Error allGatherShards(void *data, int64_t count,
                                      int elementBytes) = 0;
  /// In place: this rank's shardRange of `data` becomes the sum over the
  /// ranks of theirs; the rest of `data` is left undefined.
  virtual llvm::Error
  reduceScatterShards(llvm::MutableArrayRef<float> data) = 0;
  /// Each rank's shardRange of a tensor of `count` elements (`mine`, its
  /// shard's values) into `all` on rank 0, which has room for `count`;
  /// `all` is not read on the other ranks.
  virtual llvm::Error gatherShardsToRank0(llvm::ArrayRef<float> mine,
                                          int64_t count, float *all) = 0;
  /// Ends every rank of the job with exit code `code`: a rank that fails
  /// alone must not leave the others waiting in their next collective (or
  /// its own MPI_Finalize waiting for them). Returns only in a job of one.
  virtual void abort(int code) {}

  /// A collective that waits longer than `seconds` for the other ranks (one
  /// of them hung or died unnoticed) ends this process through endJob()
  /// with a message naming the rank, host and collective; the launcher then
  /// ends the job (docs/Distributed.md, "Stopping and faults"). The device
  /// collectives' watchdog holds NCCL to the same limit
  /// (cuda::DeviceCollectives). 0: no limit.
  void setTimeout(double seconds) {
    timeoutSeconds = seconds;
    timeoutChanged();
  }
  double timeout() const { return timeoutSeconds; }
  /// Ends this process because the job cannot go on (a collective past the
  /// timeout, NCCL's report of a failed peer): `message` printed as is,
  /// exit code 5. Returns only where the ranks are not processes (tests).
  virtual void endJob(const std::string &message);

  /// Fails with `message` unless every rank's `mine` is the same: the
  /// error names the ranks and hosts that differ (ranks that disagree on
  /// the plan, the backend or the checkpoint).
  llvm::Error checkSame(llvm::StringRef what, llvm::StringRef mine);

protected:
  virtual llvm::Expected<std::vector<std::string>>
  gatherStrings(llvm::StringRef mine, bool timed) = 0;
  /// After setTimeout: an implementation's watchdog takes the new limit.
  virtual void timeoutChanged() {}
  Collectives(World where, std::string host)
      : where(std::move(where)), hostName(std::move(host)) {}
  World where;
  std::string hostName;
  std::vector<std::string> hostNames; ///< hosts(), once gathered
  double timeoutSeconds = 0;
};

/// The collectives of this process's job: of one rank without MPI, or
/// the MPI plugin's (found beside the executable's lib/ folder, or at
/// $MEGASLIDE_MPI_PLUGIN). An error says what is missing.
llvm::Expected<std::unique_ptr<Collectives>> openCollectives();

} // namespace megaslide::dist

#endif // MEGASLIDE_RUNTIME_DIST_COLLECTIVES_H
