//===- SessionBackends.cpp - A session's backends, one bucket's at a time -===//

#include "megaslide/runtime/train/SessionParts.h"

#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/DeviceCollectives.h"
#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/sim/SimBackend.h"

using namespace megaslide;
using namespace megaslide::train;

Session::~Session() {
  // The cuda backend keeps its pinned pools for the next bucket's backend;
  // a finished session (a Python Trainer going away) gives them back.
  executor.reset();
  if (std::shared_ptr<cuda::DeviceCollectives> &device =
          options.cuda.collectives) {
    // No rank destroys its communicator while another's watchdog may take
    // that for a failed peer.
    device->stopWatching();
    if (options.collectives)
      llvm::consumeError(options.collectives->barrier());
    device.reset();
  }
  cuda::releasePinnedPools();
}

llvm::Expected<std::unique_ptr<exec::Backend>>
train::createBackend(const exec::ExecPlan &plan,
                     const SessionOptions &options) {
  if (options.backend == "sim") {
    sim::HardwareModel hw;
    if (!options.hardwarePath.empty()) {
      llvm::Expected<sim::HardwareModel> loaded =
          sim::loadHardwareModel(options.hardwarePath);
      if (!loaded)
        return loaded.takeError();
      hw = std::move(*loaded);
    }
    auto backend = sim::SimBackend::create(plan, std::move(hw));
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  if (options.backend == "cuda") {
    cuda::CudaOptions cudaOptions = options.cuda;
    if (dist::Collectives *job = options.collectives; job && job->size() > 1)
      cudaOptions.job = job; // and the rank's GPU
    auto backend = cuda::CudaBackend::create(plan, cudaOptions);
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  if (options.backend == "cpu") {
    auto backend = cpu::CpuBackend::create(plan);
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  return llvm::createStringError("unknown backend '" + options.backend +
                                 "' (use cpu, cuda or sim)");
}

void Session::keepDeviceCollectives() {
  // A job's NCCL communicator outlives the bucket's backend: the ranks
  // switch buckets at different moments, and making it is a collective.
  if (auto *cuda = dynamic_cast<cuda::CudaBackend *>(executor.get()))
    if (!options.cuda.collectives)
      options.cuda.collectives = cuda->deviceCollectives();
}

llvm::Error Session::useBucket(size_t bucket) {
  if (executor && live == bucket)
    return llvm::Error::success();
  // Every decided update lands first: the next backend starts from the
  // host state alone.
  flushUpdates();
  executor.reset(); // its device memory goes before the next one's comes
  auto backend = createBackend(*plans[bucket], options);
  if (!backend)
    return backend.takeError();
  executor = std::move(*backend);
  live = bucket;
  keepDeviceCollectives();
  return llvm::Error::success();
}
