//===- DeviceCollectives.h - NCCL collectives of a job ----------*- C++ -*-===//
//
// The device side of a job's collectives (docs/Distributed.md): one NCCL
// communicator per process, set up through the host collectives, and the
// two collectives of the sharded step on device buffers: the fetch's
// all-gather of a parameter's shards and the gradient's reduce-scatter
// before its D2H.
//
// The shards are dist::shardRange's: balanced and 16-element aligned, so
// not equal-sized (rank 0's is the largest), while ncclAllGather and
// ncclReduceScatter need equal counts. Padding every tensor to
// ranks * largest shard would need room past the tensor's end in the arena
// and a copy, so each collective is instead a group (ncclGroupStart/End)
// of one ncclBroadcast or ncclReduce per rank, root r for shard r, with
// its shard's count and offset, in place. The bytes per rank are the ring
// all-gather's and reduce-scatter's: NCCL runs broadcast and reduce as
// rings, each shard crossing every link of its ring but one, so for a
// tensor of B bytes over N ranks each rank sends and receives B less one
// shard, about (N-1)/N * B. What the group costs more is latency: N ring
// passes instead of one.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_DEVICECOLLECTIVES_H
#define MEGASLIDE_RUNTIME_CUDA_DEVICECOLLECTIVES_H

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/Support/Error.h"

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace megaslide::cuda {

/// A job's NCCL communicator and the stream its collectives run on. Every
/// rank calls the same collectives in the same order, from one host thread
/// at a time, with the CUDA context the communicator was made in current.
class DeviceCollectives {
public:
  /// Every rank of `job` together, with its device's context current: each
  /// makes its communication stream and events, rank 0 NCCL's unique id,
  /// which job.allGather gives every rank (a rank that failed so far sends
  /// nothing, and every rank returns an error naming it), then
  /// ncclCommInitRank(size, id, rank), which returns once all have joined.
  /// With `device`, the communicator keeps that device's primary context
  /// (current now) alive for as long as it lives, whatever backends come
  /// and go in it (a run's buckets).
  static llvm::Expected<std::unique_ptr<DeviceCollectives>>
  create(const CudaDriverApi &cu, const NcclApi &nccl, dist::Collectives &job,
         std::optional<CUdevice> device = std::nullopt);
  /// Waits for the communication stream and destroys the communicator
  /// (unless abort() freed it).
  ~DeviceCollectives();
  DeviceCollectives(const DeviceCollectives &) = delete;
  DeviceCollectives &operator=(const DeviceCollectives &) = delete;

  int rank() const { return myRank; }
  int size() const { return ranks; }

  /// In place on the `count` elements of `dtype` (bf16, f16 or f32) at
  /// `data`: each rank's dist::shardRange goes to every rank. Ordered after
  /// the work issued on `stream` so far and before what is issued on it
  /// next, so an event the caller records on `stream` afterwards covers it.
  llvm::Error allGatherShards(CUdeviceptr data, int64_t count,
                              exec::DType dtype, CUstream stream);
  /// In place, ordered the same way: this rank's shardRange of `data`
  /// becomes the sum over the ranks of theirs; the rest of `data` is left
  /// undefined.
  llvm::Error reduceScatterShards(CUdeviceptr data, int64_t count,
                                  exec::DType dtype, CUstream stream);

  /// For a rank that fails: ncclCommAbort ends the communicator's
  /// operations in flight here, so the process can exit; the other ranks'
  /// collectives then fail or hang until their watchdog ends them.
  void abort();
  /// The caller has synchronised with every collective issued so far (a
  /// step's end): none is pending for the watchdog.
  void settled();
  /// Stops the watchdog: before the ranks destroy their communicators,
  /// which a peer's NCCL may report as a failed connection.
  void stopWatching();

private:
  DeviceCollectives(const CudaDriverApi &cu, const NcclApi &nccl,
                    dist::Collectives &job)
      : cu(cu), nccl(nccl), job(job) {}
  /// The watchdog (docs/Distributed.md, "Stopping and faults"): NCCL has
  /// no timeout of its own, so a thread ends the job through job.endJob
  /// when ncclCommGetAsyncError reports a failure (a peer's connection
  /// lost), or when collectives have been pending for the job's timeout
  /// without all of them completing (a rank hung, or died where NCCL does
  /// not notice), ncclCommInitRank included.
  void watch();
  /// One more collective issued (under stateMu): pending from now unless
  /// others are already.
  void markPending();
  /// One group of a call per root (ncclBroadcast or ncclReduce), root r
  /// on shard r, on the communication stream between an event recorded on
  /// `stream` and `stream`'s wait for its end.
  llvm::Error runGroup(bool reduce, CUdeviceptr data, int64_t count,
                       exec::DType dtype, CUstream stream);

  const CudaDriverApi &cu;
  const NcclApi &nccl;
  dist::Collectives &job;
  int myRank = 0, ranks = 1;
  /// Held while a collective is issued, and by abort(). The watchdog takes
  /// it (through abort()) only after job.endJob returned, which ends the
  /// process but where ranks are threads of a test, whose fake NCCL never
  /// blocks in a call.
  std::mutex issueMu;
  /// Guards `comm` (freed by abort()) and the fields below.
  std::mutex stateMu;
  std::condition_variable wake;
  bool stopping = false;
  /// Collectives issued; since when some (or the communicator's setup)
  /// have been pending, in steady clock ticks (0: none).
  int64_t issued = 0, pendingSince = 0;
  std::thread watchdog;
  ncclComm_t comm = nullptr;
  /// The device whose primary context create() retained.
  std::optional<CUdevice> device;
  CUstream commStream = nullptr;
  /// Recorded on the caller's stream before a collective and on the
  /// communication stream after it.
  CUevent before = nullptr, after = nullptr;
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_DEVICECOLLECTIVES_H
