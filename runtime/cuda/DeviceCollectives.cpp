//===- DeviceCollectives.cpp - NCCL collectives of a job ------------------===//

#include "megaslide/runtime/cuda/DeviceCollectives.h"

#include "llvm/Support/FormatVariadic.h"

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
                          dist::Collectives &job) {
  std::unique_ptr<DeviceCollectives> self(new DeviceCollectives(cu, nccl));
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
  if (llvm::Error e = checkNccl(
          nccl,
          nccl.ncclCommInitRank(&self->comm, self->ranks, id, self->myRank),
          "ncclCommInitRank"))
    return std::move(e);
  return self;
}

DeviceCollectives::~DeviceCollectives() {
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
}

void DeviceCollectives::abort() {
  if (comm)
    nccl.ncclCommAbort(comm);
  comm = nullptr;
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
  return checkCu(cu, cu.cuStreamWaitEvent(stream, after, 0),
                 "cuStreamWaitEvent (after a collective)");
}
