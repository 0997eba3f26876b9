//===- CudaOptions.h - Options of the cuda backend --------------*- C++ -*-===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDAOPTIONS_H
#define MEGASLIDE_RUNTIME_CUDA_CUDAOPTIONS_H

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/plan/HostPool.h"

#include <cstdint>
#include <memory>
#include <string>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::cuda {

class DeviceCollectives;

struct CudaOptions {
  /// CUDA device ordinal; -1: device 0, or a job's rank's: its local rank
  /// among the devices it sees, or device 0 where it sees one (a launcher
  /// that gives each rank its own GPU, srun --gpus-per-task 1).
  int device = -1;
  /// NVRTC target; empty: the device's own (sm_90a on H100/H200).
  std::string arch;
  /// Bytes of the pinned ring fetches are cast into; 0: two blocks' fetches
  /// (weightStagingBytes in CudaPlan.h). Tests give less to make the
  /// staging thread wait for copies.
  int64_t stagingBytes = 0;
  /// Host values (d2h results) get pinned bytes of their own while all of
  /// them fit this; beyond, they share bytes (exec::layoutHostPool). The
  /// sim prices the default.
  int64_t hostPoolNoReuseBytes = exec::kHostPoolNoReuseBytes;
  int64_t gemmWorkspaceBytes = int64_t(32) << 20;
  /// The job this process is a rank of (docs/Distributed.md): a plan for a
  /// job of several ranks (ExecPlan::jobRanks) needs it, and its host
  /// collectives set up the NCCL communicator.
  dist::Collectives *job = nullptr;
  /// The job's device collectives, made by an earlier backend of the run
  /// (CudaBackend::deviceCollectives): reused, so that the ranks, which
  /// switch buckets at different moments, make the NCCL communicator once
  /// and together. Null: the backend makes them (a collective call).
  std::shared_ptr<DeviceCollectives> collectives;
  /// Symbol tables to use instead of the loaded driver, cuBLASLt and NCCL:
  /// tests run the backend on a fake device (host memory, emulated
  /// kernels) and the fake NCCL.
  const CudaDriverApi *driver = nullptr;
  const CublasLtApi *cublasLt = nullptr;
  const NcclApi *nccl = nullptr;
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDAOPTIONS_H
