//===- CudaBackend.h - Runs execution plans on an NVIDIA GPU ----*- C++ -*-===//
//
// The cuda backend: one device arena (every device tensor at its planned
// offset), one compute and two copy streams (h2d, d2h) and, for a job's
// plan, a comm stream its NCCL collectives (DeviceCollectives.h, on a
// stream of their own) are ordered on by events, one
// CUevent per plan event, pinned host pools for weight staging, step inputs and
// host values (gradients, offloaded checkpoints, the loss), cuBLASLt GEMMs
// (Gemm.h), the dense kernels of ElementwiseKernels.h and the plan's generated
// 3D-DSA modules, both compiled with NVRTC (on-disk cache), and the host AdamW
// on a worker thread as gradients arrive (HostWorker.h).
//
// Everything GPU-free (lowering, module matching, hazards, pool layout) is
// in prepareCudaPlan (CudaPlan.h) so that it can be tested without a GPU.
// The driver, cuBLASLt and NVRTC are loaded at run time (CudaApi.h): this
// builds everywhere, and create() says clearly why there is no GPU.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H
#define MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H

#include "megaslide/runtime/cuda/CudaPlan.h"
#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/plan/StepRunner.h"

#include <memory>

namespace megaslide::cuda {

class CudaBackend : public exec::Backend {
public:
  /// Prepares the plan, then loads the driver, cuBLASLt and NVRTC, opens
  /// the device, allocates the arena and pools and compiles the kernels.
  /// Errors: "no CUDA driver: libcuda.so.1 not found ...", "CUDA driver
  /// reports no device (CUDA_ERROR_NO_DEVICE ...)", NVRTC or cuBLASLt
  /// missing, not enough device memory for the plan (with both figures),
  /// a kernel that does not compile (with NVRTC's log), a bad
  /// MEGASLIDE_CUDA_SYNC.
  static llvm::Expected<std::unique_ptr<CudaBackend>>
  create(const exec::ExecPlan &plan, const CudaOptions &options = {});
  ~CudaBackend() override;

  const char *name() const override { return "cuda"; }
  /// The step runner's semantics (plan/StepRunner.h) over the backend's
  /// primitives: the instructions issued in program order on their
  /// streams, host work on the host worker thread (onGradient is called
  /// there, in program order). A step that fails leaves no work in flight
  /// and applies none of the updates still queued (state.incomplete is set
  /// only if one was).
  llvm::Expected<exec::StepResult>
  step(const exec::StepInputs &inputs, host::HostState &state,
       const exec::StepOptions &options) override;

  const CudaDeviceInfo &deviceInfo() const;
  const PreparedPlan &prepared() const;
  /// A job's device collectives (null for a plan of one rank), for the
  /// run's next backend (CudaOptions::collectives).
  std::shared_ptr<DeviceCollectives> deviceCollectives() const;

  struct Impl;

private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl;
  std::unique_ptr<exec::StepRunner> runner; ///< over *impl
};

/// Frees the pinned host memory a destroyed backend left for the next one
/// (a backend keeps its pinned pools for the next backend on its device
/// until this is called or the process exits; docs/Runtime.md, "cuda
/// backend internals"), and the device context they belong to.
void releasePinnedPools();

/// True when a CUDA device can be opened here; otherwise `whyNot` holds the
/// reason (what create() would say). For tests that skip without a GPU.
bool cudaDeviceAvailable(std::string *whyNot = nullptr);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDABACKEND_H
