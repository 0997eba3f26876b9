//===- DeviceCollectives.cpp - NCCL collectives of a job ------------------===//

#include "megaslide/runtime/cuda/DeviceCollectives.h"

#include "llvm/Support/FormatVariadic.h"

#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using namespace megaslide;
using namespace megaslide::cuda;

static std::optional<ncclDataType_t> ncclTypeOf(exec::DType dtype) {
  switch (dtype) {
  case exec::DType::BF16:
    return ncclBfloat16;
  case exec::DType::F16:
    return ncclFloat16;
  case exec::DType::F32:
    return ncclFloat32;
  default:
    return std::nullopt;
  }
}

llvm::Expected<std::unique_ptr<DeviceCollectives>>
DeviceCollectives::create(const CudaDriverApi &cu, const NcclApi &nccl,
                          dist::Collectives &job,
                          std::optional<CUdevice> device) {
  std::unique_ptr<DeviceCollectives> self(new DeviceCollectives(cu, nccl, job));
  CUcontext ctx = nullptr;
  if (device && cu.cuDevicePrimaryCtxRetain(&ctx, *device) == CUDA_SUCCESS)
    self->device = device;
  self->myRank = job.rank();
  self->ranks = job.size();
  // What a rank does alone comes first: one that fails must not leave the
  // others waiting in ncclCommInitRank.
  llvm::Error failed =
      checkCu(cu, cu.cuStreamCreate(&self->commStream, CU_STREAM_NON_BLOCKING),
              "cuStreamCreate (the NCCL stream)");
  for (CUevent *event : {&self->before, &self->after})
    if (!failed)
      failed = checkCu(cu, cu.cuEventCreate(event, CU_EVENT_DISABLE_TIMING),
                       "cuEventCreate (the NCCL stream's)");
  ncclUniqueId id{};
  if (!failed && self->myRank == 0)
    failed = checkNccl(nccl, nccl.ncclGetUniqueId(&id), "ncclGetUniqueId");
  // Rank 0 sends the id, the others a byte, a rank that failed nothing.
  std::string mine;
  if (!failed)
    mine =
        self->myRank == 0 ? std::string(id.internal, sizeof(id.internal)) : "1";
  llvm::Expected<std::vector<std::string>> all = job.allGather(mine);
  if (failed) {
    if (!all)
      llvm::consumeError(all.takeError());
    return std::move(failed);
  }
  if (!all)
    return all.takeError();
  std::string others;
  for (size_t r = 0; r < all->size(); ++r)
    if ((*all)[r].empty())
      others += " " + std::to_string(r);
  if (!others.empty())
    return llvm::createStringError(
        "the NCCL communicator was not made: rank(s)" + others +
        " failed to set up (their own errors say why)");
  if ((*all)[0].size() != sizeof(id.internal))
    return llvm::createStringError(
        llvm::formatv("NCCL's unique id from rank 0 has {0} bytes, not {1}",
                      (*all)[0].size(), sizeof(id.internal))
            .str());
  std::memcpy(id.internal, (*all)[0].data(), sizeof(id.internal));
  // Watched from here: ncclCommInitRank waits for every rank.
  {
    std::lock_guard<std::mutex> lock(self->stateMu);
    self->markPending();
  }
  self->watchdog = std::thread([p = self.get()] { p->watch(); });
  ncclComm_t comm = nullptr;
  if (llvm::Error e = checkNccl(
          nccl, nccl.ncclCommInitRank(&comm, self->ranks, id, self->myRank),
          "ncclCommInitRank"))
    return std::move(e);
  std::lock_guard<std::mutex> lock(self->stateMu);
  self->comm = comm;
  self->pendingSince = 0;
  return self;
}

void DeviceCollectives::markPending() {
  ++issued;
  if (!pendingSince)
    pendingSince = std::chrono::steady_clock::now().time_since_epoch().count();
}

void DeviceCollectives::watch() {
  std::unique_lock<std::mutex> lock(stateMu);
  while (!stopping) {
    wake.wait_for(lock, std::chrono::milliseconds(200));
    if (stopping)
      return;
    std::string why;
    ncclResult_t async = ncclSuccess;
    if (comm && nccl.ncclCommGetAsyncError(comm, &async) == ncclSuccess &&
        async != ncclSuccess && async != ncclInProgress)
      why = llvm::formatv("NCCL reports {0} ({1}): a rank died or its "
                          "connection failed",
                          nccl.ncclGetErrorString(async), async);
    if (why.empty() && pendingSince) {
      // `after` follows the last collective issued: when it is done, so
      // are all of them (unless another was issued meanwhile).
      int64_t seen = issued;
      lock.unlock();
      bool done = cu.cuEventQuery(after) == CUDA_SUCCESS;
      lock.lock();
      if (comm && done && issued == seen) {
        pendingSince = 0;
        continue;
      }
      double waited = std::chrono::duration<double>(
                          std::chrono::steady_clock::now().time_since_epoch() -
                          std::chrono::steady_clock::duration(pendingSince))
                          .count();
      if (job.timeout() > 0 && waited >= job.timeout())
        why = llvm::formatv(
            "its device collectives have waited {0:F0} s for the other ranks "
            "{1}(--collective-timeout {2}): a rank has hung or died",
            waited, comm ? "" : "in ncclCommInitRank ",
            llvm::format("%g", job.timeout()));
    }
    if (why.empty() || stopping)
      continue;
    lock.unlock();
    job.endJob(llvm::formatv("megaslide: error: rank {0} on {1}: {2}; the job "
                             "stops, and the last complete checkpoint resumes "
                             "it\n",
                             myRank, job.host(), why));
    // Only where the ranks are not processes (tests): what waits for the
    // collectives fails instead.
    abort();
    return;
  }
}

void DeviceCollectives::stopWatching() {
  {
    std::lock_guard<std::mutex> lock(stateMu);
    stopping = true;
  }
  wake.notify_all();
  if (watchdog.joinable())
    watchdog.join();
}

void DeviceCollectives::settled() {
  std::lock_guard<std::mutex> lock(stateMu);
  pendingSince = 0;
}

DeviceCollectives::~DeviceCollectives() {
  stopWatching();
  // Errors have nowhere to go here: a failed device is reported by the
  // step's own synchronisations.
  if (commStream)
    cu.cuStreamSynchronize(commStream);
  if (comm)
    nccl.ncclCommDestroy(comm);
  for (CUevent event : {before, after})
    if (event)
      cu.cuEventDestroy_v2(event);
  if (commStream)
    cu.cuStreamDestroy_v2(commStream);
  if (device)
    cu.cuDevicePrimaryCtxRelease_v2(*device);
}

void DeviceCollectives::abort() {
  std::lock_guard<std::mutex> issuing(issueMu);
  std::lock_guard<std::mutex> lock(stateMu);
  if (comm)
    nccl.ncclCommAbort(comm);
  comm = nullptr;
  pendingSince = 0;
}

llvm::Error DeviceCollectives::allGatherShards(CUdeviceptr data, int64_t count,
                                               exec::DType dtype,
                                               CUstream stream) {
  return runGroup(/*reduce=*/false, data, count, dtype, stream);
}

llvm::Error DeviceCollectives::reduceScatterShards(CUdeviceptr data,
                                                   int64_t count,
                                                   exec::DType dtype,
                                                   CUstream stream) {
  return runGroup(/*reduce=*/true, data, count, dtype, stream);
}

llvm::Error DeviceCollectives::runGroup(bool reduce, CUdeviceptr data,
                                        int64_t count, exec::DType dtype,
                                        CUstream stream) {
  const char *call = reduce ? "ncclReduce" : "ncclBroadcast";
  // The communicator is only freed by abort(), which waits for this.
  std::lock_guard<std::mutex> issuing(issueMu);
  if (!comm)
    return llvm::createStringError(
        llvm::formatv("{0}: the NCCL communicator was aborted", call).str());
  std::optional<ncclDataType_t> type = ncclTypeOf(dtype);
  if (!type)
    return llvm::createStringError(
        llvm::formatv("{0}: the device collectives take bf16, f16 or f32, "
                      "not {1}",
                      call, exec::dtypeName(dtype))
            .str());
  if (llvm::Error e = checkCu(cu, cu.cuEventRecord(before, stream),
                              "cuEventRecord (before a collective)"))
    return e;
  if (llvm::Error e = checkCu(cu, cu.cuStreamWaitEvent(commStream, before, 0),
                              "cuStreamWaitEvent (the NCCL stream)"))
    return e;
  if (llvm::Error e = checkNccl(nccl, nccl.ncclGroupStart(), "ncclGroupStart"))
    return e;
  // The group is closed whatever fails inside it.
  llvm::Error failed = llvm::Error::success();
  int64_t elementBytes = exec::dtypeBytes(dtype);
  for (int root = 0; root < ranks && !failed; ++root) {
    dist::ShardRange shard = dist::shardRange(count, root, ranks);
    if (shard.size() == 0)
      continue;
    void *p = reinterpret_cast<void *>(data + shard.begin * elementBytes);
    size_t n = static_cast<size_t>(shard.size());
    ncclResult_t result =
        reduce
            ? nccl.ncclReduce(p, p, n, *type, ncclSum, root, comm, commStream)
            : nccl.ncclBroadcast(p, p, n, *type, root, comm, commStream);
    failed = checkNccl(
        nccl, result,
        llvm::formatv("{0} (root {1}, {2} elements)", call, root, n).str());
  }
  llvm::Error ended = checkNccl(nccl, nccl.ncclGroupEnd(), "ncclGroupEnd");
  if (failed) {
    llvm::consumeError(std::move(ended));
    return failed;
  }
  if (ended)
    return ended;
  if (llvm::Error e = checkCu(cu, cu.cuEventRecord(after, commStream),
                              "cuEventRecord (after a collective)"))
    return e;
  {
    std::lock_guard<std::mutex> lock(stateMu);
    markPending();
  }
  return checkCu(cu, cu.cuStreamWaitEvent(stream, after, 0),
                 "cuStreamWaitEvent (after a collective)");
}
