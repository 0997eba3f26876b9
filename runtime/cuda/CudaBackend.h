//===- CudaBackend.h - Executes execution plans on an NVIDIA GPU -*- C++
//-*-===//
//
// The cuda backend: one device arena (every device tensor at its planned
// offset), one compute and two copy streams (h2d, d2h), one CUevent per plan
// event, pinned host pools for weight staging, step inputs and host values
// (gradients, offloaded checkpoints, the loss), cuBLASLt GEMMs, the dense
// kernels of ElementwiseKernels.h and the plan's generated 3D-DSA modules,
// both compiled with NVRTC (on-disk cache), and the host AdamW on a worker
// thread as gradients arrive.
//
// The plan's events order producers before consumers (read after write).
// Reuse of arena and host-pool bytes across streams (write after read or
// write) is not in the plan: the backend derives those waits itself from
// program order (prepareCudaPlan), so the copy streams may run ahead of
// compute exactly as far as the memory plan allows.
//
// Everything GPU-free (lowering, module matching, hazards, pool layout) is
// in prepareCudaPlan so that it can be tested without a GPU. The driver,
// cuBLASLt and NVRTC are loaded at run time (CudaApi.h): this builds
// everywhere, and create() says clearly why there is no GPU.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H
#define MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H

#include "cuda/CudaApi.h"
#include "cuda/ElementwiseKernels.h"
#include "plan/Backend.h"

#include <array>
#include <map>
#include <memory>
#include <optional>

namespace megaslide::cuda {

struct CudaOptions {
  int device = 0; ///< CUDA device ordinal
  /// NVRTC target; empty: the device's own (sm_90a on H100/H200).
  std::string arch;
  /// Pinned buffers fetches are staged through, each as large as the
  /// largest fetch (2: one filling while one copies).
  int stagingSlots = 2;
  /// Host values (d2h results) get pinned bytes of their own while all of
  /// them fit this; beyond, they share bytes by liveness.
  int64_t hostPoolNoReuseBytes = int64_t(8) << 30;
  int64_t gemmWorkspaceBytes = int64_t(32) << 20;
  /// Symbol tables to use instead of the loaded driver and cuBLASLt: tests
  /// run the backend on a fake device (host memory, emulated kernels).
  const CudaDriverApi *driver = nullptr;
  const CublasLtApi *cublasLt = nullptr;
};

//===----------------------------------------------------------------------===//
// GPU-free preparation
//===----------------------------------------------------------------------===//

/// Launch shape of one kernel of a generated 3D-DSA module (from its
/// manifest; grids for batch 1).
struct DsaKernelSpec {
  std::string name;
  std::array<int64_t, 3> grid{};
  int threads = 0;
  int64_t dynamicSharedBytes = 0;
};

/// One of the plan's kernel modules with its configuration.
struct DsaModuleSpec {
  std::string name;
  std::array<int64_t, 3> grid{}, window{}, tile{};
  int64_t heads = 0, headDim = 0, radius = 0;
  std::string elementType;
  /// forward, backward, backward_finalize, offsets.
  std::map<std::string, DsaKernelSpec, std::less<>> kernels;
};

/// Parses a module's manifest (writeDsaManifest's JSON, one configuration).
llvm::Expected<DsaModuleSpec> parseDsaManifest(const exec::KernelModule &m);

/// An earlier instruction that must have completed first.
struct Dependency {
  exec::Stream stream;
  int64_t instruction;
};

struct PreparedInstruction {
  /// Graph ops with a dense lowering.
  std::optional<LoweredOp> lowered;
  /// dsa3d, dsa3d_grad, dsa3d_offsets: the module (index into dsaModules).
  int64_t dsaModule = -1;
  /// dsa3d_grad: arena offsets of the fp32 dK/dV accumulators, or -1 when
  /// the plan's workspace is too small (then the backend's own scratch).
  int64_t dk32Offset = -1, dv32Offset = -1;
  /// Write-after-read/write waits on other streams (filtered: none implied
  /// by an earlier wait of the same stream).
  std::vector<Dependency> waits;
  /// The stream that recorded a plan event (record instructions).
  std::optional<exec::Stream> recordedOn;
};

struct PreparedPlan {
  std::vector<PreparedInstruction> instructions;
  std::vector<DsaModuleSpec> dsaModules;
  /// Distinct dense kernels the plan launches, and their CUDA C++.
  std::vector<KernelInstance> kernels;
  std::string elementwiseSource;
  /// Device bytes beside the arena: the largest op scratch, and the
  /// 3D-DSA accumulators when the plan gives no workspace for them.
  int64_t scratchBytes = 0, dsaFallbackBytes = 0;
  /// Pinned pools: step inputs and host values, offsets per value (-1 for
  /// device values); the staging slot size (largest fetch).
  std::vector<int64_t> hostOffset;
  int64_t inputPoolBytes = 0, hostPoolBytes = 0, stagingSlotBytes = 0;
  bool hostPoolShared = false; ///< host values share bytes by liveness
  /// Instructions whose completion another stream waits for.
  std::vector<bool> needsDoneEvent;
  /// Per plan event: the instruction recording it (-1: none).
  std::vector<int64_t> eventRecorder;
  /// The loss where it is computed (exec::lossSource), the instruction
  /// defining it and the first host_adamw (-1: none): the loss is copied
  /// to the host as soon as it exists, and the
  /// first update reads it, so a non-finite loss skips the step before any
  /// state changes.
  int64_t lossValue = -1, lossDef = -1, firstUpdate = -1;
  /// Measured like the cpu backend: arena high-water mark, live peak.
  int64_t arenaHighWater = 0, peakLiveBytes = 0;
};

/// Lowers every graph op, matches the 3D-DSA ops to the plan's modules,
/// lays out the pinned pools and derives the cross-stream waits. Errors
/// name the instruction (an op without a cuda lowering, a 3D-DSA
/// configuration without a module, a graph op reading a host value).
llvm::Expected<PreparedPlan> prepareCudaPlan(const exec::ExecPlan &plan,
                                             const CudaOptions &options = {});

//===----------------------------------------------------------------------===//
// The backend
//===----------------------------------------------------------------------===//

class CudaBackend : public exec::Backend {
public:
  /// Prepares the plan, then loads the driver, cuBLASLt and NVRTC, opens
  /// the device, allocates the arena and pools and compiles the kernels.
  /// Errors: "no CUDA driver: libcuda.so.1 not found ...", "CUDA driver
  /// reports no device (CUDA_ERROR_NO_DEVICE ...)", NVRTC or cuBLASLt
  /// missing, not enough device memory for the plan (with both figures),
  /// a kernel that does not compile (with NVRTC's log).
  static llvm::Expected<std::unique_ptr<CudaBackend>>
  create(const exec::ExecPlan &plan, const CudaOptions &options = {});
  ~CudaBackend() override;

  const char *name() const override { return "cuda"; }
  /// Issues the step's instructions in program order on their streams,
  /// waits for all of them, returns the loss. The optimizer step passed to
  /// AdamW is state.step + 1 (state.step advances with applyUpdates);
  /// onGradient is called on the host worker thread, in program order. A
  /// step that fails leaves no work in flight and applies none of the
  /// updates still queued (state.incomplete is set only if one was).
  llvm::Expected<exec::StepResult>
  step(const exec::StepInputs &inputs, host::HostState &state,
       const exec::StepOptions &options) override;

  const CudaDeviceInfo &deviceInfo() const;
  const PreparedPlan &prepared() const;

  struct Impl;

private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl;
};

/// True when a CUDA device can be opened here; otherwise `whyNot` holds the
/// reason (what create() would say). For tests that skip without a GPU.
bool cudaDeviceAvailable(std::string *whyNot = nullptr);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H
