//===- CudaBackendImpl.h - The cuda backend's state -------------*- C++ -*-===//
//
// Private to the backend: what CudaBackend.cpp creates (device and pinned
// memory, streams, events, modules, GEMM plans, each instruction's device
// commands), and the step primitives (exec::Device, CudaStep.cpp) that
// issue them as the step runner walks the plan.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDABACKENDIMPL_H
#define MEGASLIDE_RUNTIME_CUDA_CUDABACKENDIMPL_H

#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/DeviceCollectives.h"
#include "megaslide/runtime/cuda/Gemm.h"
#include "megaslide/runtime/cuda/HostWorker.h"
#include "megaslide/runtime/cuda/Staging.h"
#include "megaslide/runtime/plan/StepRunner.h"
#include "megaslide/runtime/support/Packing.h"

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace megaslide::cuda {

/// A kernel launch with its arguments, each in an 8-byte slot (a float
/// sits in the slot's first bytes, as cuLaunchKernel reads it).
struct LaunchCmd {
  CUfunction function = nullptr;
  std::array<uint32_t, 3> grid{1, 1, 1};
  uint32_t block = 1, sharedBytes = 0;
  std::vector<uint64_t> args;
  std::string name;
};
struct GemmCmd {
  size_t index = 0;
};
struct MemsetCmd {
  CUdeviceptr dst = 0;
  size_t bytes = 0;
};
struct CopyCmd {
  CUdeviceptr src = 0, dst = 0;
  size_t bytes = 0;
};
/// What an instruction runs on its GPU stream, resolved to device addresses
/// once (Impl::buildCommands) and issued every step.
using DeviceCmd = std::variant<LaunchCmd, GemmCmd, MemsetCmd, CopyCmd>;

struct CudaBackend::Impl final : exec::Device {
  const exec::ExecPlan &plan;
  CudaOptions options;
  PreparedPlan prep;
  const CudaDriverApi *cu = nullptr;
  const CublasLtApi *lt = nullptr;
  CudaDeviceInfo info;
  CUcontext ctx = nullptr;
  std::string arch;

  CUdeviceptr arena = 0, scratch = 0, dsaScratch = 0, gemmWorkspace = 0;
  void *inputPool = nullptr, *hostPool = nullptr, *staging = nullptr;
  /// Pinned: the loss, read by the first update and at the end of a step.
  void *lossStage = nullptr;
  /// The pinned blocks the pools above lie in, with their sizes (a block
  /// kept from an earlier backend may be larger than its pool); handed to
  /// the next backend at destruction (takePinnedBlocks in CudaBackend.cpp).
  std::vector<std::pair<void *, size_t>> pinnedBlocks;
  /// MEGASLIDE_CUDA_SYNC=1: synchronise after every device command.
  bool syncEach = false;
  /// compute, h2d, d2h and comm (streamIndex).
  static constexpr int kStreams = 4;
  CUstream streams[kStreams] = {};
  /// Recorded at the end of a stream's work to wait for it (syncStream).
  CUevent idleEvents[kStreams] = {};
  /// A job's plan (ExecPlan::jobRanks > 1): the NCCL communicator its
  /// collectives run on, and this rank's place in the job.
  std::shared_ptr<DeviceCollectives> collectives;
  int jobRank = 0, jobSize = 1;
  /// Per fetch: the first element and the count of what it copies (the
  /// rank's shard in a job's plan; StepSetup::fetches).
  std::vector<std::pair<int64_t, int64_t>> fetchShards;
  CUevent baseEvent = nullptr, lossEvent = nullptr;
  /// copyEvents[k]: recorded after the copy of the k-th fetch; its staged
  /// bytes are free once it completes.
  std::vector<CUevent> planEvents, doneEvents, startEvents, endEvents,
      copyEvents;
  CUmodule elementwiseModule = nullptr;
  std::vector<CUmodule> dsaModules;
  GemmPlans gemms;
  std::vector<std::vector<DeviceCmd>> commands; ///< per instruction
  HostWorker worker;
  WeightStager stager;
  /// The step being run: whether it is traced, and its host stream's
  /// status (StepSetup).
  bool trace = false;
  exec::StepStatus *status = nullptr;

  Impl(const exec::ExecPlan &plan, const CudaOptions &options)
      : plan(plan), options(options) {}
  ~Impl() override;

  // exec::Device (CudaStep.cpp).
  const char *name() const override { return "cuda"; }
  bool synchronous() const override { return false; }
  uint8_t *hostData(int64_t id) override { return hostAddress(id); }
  llvm::Error beginStep(exec::StepSetup setup) override;
  /// The arena is the plan's: every value already has its bytes.
  llvm::Error allocate(size_t) override { return llvm::Error::success(); }
  void release(size_t, llvm::ArrayRef<int64_t>) override {}
  llvm::Error fetch(size_t i, size_t k) override;
  llvm::Error copy(size_t i) override;
  llvm::Error collective(size_t i) override;
  llvm::Error launch(size_t i) override;
  llvm::Error record(size_t i) override;
  llvm::Error wait(size_t i) override;
  llvm::Error runOnHost(size_t i, std::function<void()> work) override;
  llvm::Error captureValue(int64_t id, exec::Stream stream) override;
  llvm::Error awaitValue(int64_t id, void *dst) override;
  llvm::Error endStep() override;
  llvm::Error readValue(int64_t id, void *dst) override;
  std::optional<std::pair<double, double>> timeOf(size_t i) override;
  void measureMemory(exec::MemoryStats &stats) override;
  /// Before instruction `i` on `stream`: its derived waits on the other
  /// streams (PreparedInstruction::waits).
  llvm::Error waitForOtherStreams(size_t i, CUstream stream);
  /// Before device instruction `i` on `stream`: its waits, then the
  /// trace's start event (a fetch records it itself, after its staging).
  llvm::Error startOnStream(size_t i, CUstream stream);
  /// After device instruction `i` on `stream`: MEGASLIDE_CUDA_SYNC's wait,
  /// the trace's end event, the event other streams wait for.
  llvm::Error finishOnStream(size_t i, CUstream stream);
  /// Host-stream instruction `i` on the worker, after the GPU work it
  /// waits for, then `work` (if any).
  llvm::Error enqueueHost(size_t i, std::function<void()> work);

  llvm::Error check(CUresult r, const llvm::Twine &what) const {
    return checkCu(*cu, r, what);
  }
  llvm::Error init();
  /// A job's plan: its NCCL communicator, made now (every rank together)
  /// or an earlier backend's (CudaOptions::collectives).
  llvm::Error joinJob();
  llvm::Error allocatePinned();
  llvm::Error
  compileKernels(std::vector<std::map<std::string, CUfunction>> &dsaFns,
                 std::map<std::string, CUfunction> &dense);
  llvm::Error
  buildCommands(const std::vector<std::map<std::string, CUfunction>> &dsaFns,
                const std::map<std::string, CUfunction> &dense);
  llvm::Error issue(const DeviceCmd &cmd, CUstream stream);
  /// Issues instruction `i`'s device commands on streams[s]; with
  /// syncEach, waits for each and names the one that fails (its kernel).
  llvm::Error issueCommands(size_t i, int s);

  CUdeviceptr deviceAddress(int64_t id) const {
    return arena + static_cast<CUdeviceptr>(deviceOffset(plan, id));
  }
  uint8_t *hostAddress(int64_t id) const {
    const exec::Value &v = plan.values[id];
    uint8_t *base = static_cast<uint8_t *>(
        v.home == exec::Home::Input ? inputPool : hostPool);
    return base + prep.hostOffset[id];
  }
  /// The GPU streams in the enum's order, comm last; the host stream's
  /// copies of the loss go on d2h.
  static int streamIndex(exec::Stream s) {
    return s == exec::Stream::Comm ? 3 : std::min(static_cast<int>(s), 2);
  }
  /// The elements of its result a fetch or device_to_host `inst` copies:
  /// all of them, or for one marked `ranks` this rank's shard
  /// (dist::shardRange; exec::copiedBytes sizes the largest).
  dist::ShardRange copiedRange(const exec::Instruction &inst) const {
    int64_t count = plan.values[inst.results[0]].type.numElements();
    return inst.hasAttr("ranks") ? dist::shardRange(count, jobRank, jobSize)
                                 : dist::ShardRange{0, count};
  }
  CUstream streamOf(exec::Stream s) const { return streams[streamIndex(s)]; }
  /// Records `event` on streams[s] and waits until the stream has run all
  /// it was given. Through an event: with the context's default
  /// scheduling, cuStreamSynchronize spins a core while the GPU works, and
  /// the host AdamW needs the cores.
  llvm::Error syncStream(int s, const llvm::Twine &what,
                         CUevent event = nullptr) {
    event = event ? event : idleEvents[s];
    llvm::Error e = check(cu->cuEventRecord(event, streams[s]),
                          "cuEventRecord (" + what + ")");
    if (!e)
      e = check(cu->cuEventSynchronize(event),
                "cuEventSynchronize (" + what + ")");
    // Even so, nothing may stay in flight: pinned buffers are reused.
    if (e)
      cu->cuStreamSynchronize(streams[s]);
    return e;
  }
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDABACKENDIMPL_H
