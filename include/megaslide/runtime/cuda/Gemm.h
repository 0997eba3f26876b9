//===- Gemm.h - cuBLASLt plans of the cuda backend's GEMMs ------*- C++ -*-===//
//
// Every GemmCall of a plan's lowered ops is planned once, when the backend
// is created: a matmul descriptor, the three matrix layouts and the
// heuristic's algorithm for its addresses (their alignment restricts the
// algorithms). A step only runs them.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_GEMM_H
#define MEGASLIDE_RUNTIME_CUDA_GEMM_H

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/cuda/GraphOpLowering.h"

#include "llvm/Support/Error.h"

#include <vector>

namespace megaslide::cuda {

class GemmPlans {
public:
  GemmPlans() = default;
  GemmPlans(const GemmPlans &) = delete;
  GemmPlans &operator=(const GemmPlans &) = delete;
  ~GemmPlans() { destroy(); }

  /// Creates the cuBLASLt handle; every GEMM may use `workspaceBytes` at
  /// `workspace`.
  llvm::Error init(const CublasLtApi &api, CUdeviceptr workspace,
                   int64_t workspaceBytes);
  /// Plans `g` with A, B, D (and the bias) at these addresses; returns its
  /// index for run(). Errors name the GEMM cuBLASLt has no algorithm for.
  llvm::Expected<size_t> add(const GemmCall &g, CUdeviceptr A, CUdeviceptr B,
                             CUdeviceptr D, CUdeviceptr bias);
  /// Enqueues GEMM `index` on `stream`.
  llvm::Error run(size_t index, CUstream stream) const;
  /// Destroys the plans and the handle (the backend does so before it
  /// releases the context).
  void destroy();

private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    size_t workspaceBytes = 0;
    CUdeviceptr A = 0, B = 0, D = 0;
  };
  const CublasLtApi *lt = nullptr;
  cublasLtHandle_t handle = nullptr;
  CUdeviceptr workspace = 0;
  uint64_t workspaceBytes = 0;
  std::vector<Plan> plans;
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_GEMM_H
