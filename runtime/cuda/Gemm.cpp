//===- Gemm.cpp - cuBLASLt plans of the cuda backend's GEMMs --------------===//

#include "megaslide/runtime/cuda/Gemm.h"

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;

namespace {

cudaDataType_t cudaType(DType t) {
  switch (t) {
  case DType::BF16:
    return CUDA_R_16BF;
  case DType::F16:
    return CUDA_R_16F;
  default:
    return CUDA_R_32F;
  }
}

} // namespace

llvm::Error GemmPlans::init(const CublasLtApi &api, CUdeviceptr workspace,
                            int64_t workspaceBytes) {
  lt = &api;
  this->workspace = workspace;
  this->workspaceBytes = static_cast<uint64_t>(workspaceBytes);
  return checkCublas(*lt, lt->cublasLtCreate(&handle), "cublasLtCreate");
}

llvm::Expected<size_t> GemmPlans::add(const GemmCall &g, CUdeviceptr A,
                                      CUdeviceptr B, CUdeviceptr D,
                                      CUdeviceptr bias) {
  Plan gp;
  gp.A = A;
  gp.B = B;
  gp.D = D;
  auto ok = [&](cublasStatus_t s, const char *what) {
    return checkCublas(*lt, s, what);
  };
  if (auto e = ok(lt->cublasLtMatmulDescCreate(&gp.desc, CUBLAS_COMPUTE_32F,
                                               CUDA_R_32F),
                  "cublasLtMatmulDescCreate"))
    return e;
  plans.push_back(gp); // owned from here on, destroyed with the rest
  Plan &p = plans.back();
  int32_t ta = g.transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  int32_t tb = g.transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (auto e = ok(lt->cublasLtMatmulDescSetAttribute(
                      p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
                  "cublasLtMatmulDescSetAttribute (transa)"))
    return e;
  if (auto e = ok(lt->cublasLtMatmulDescSetAttribute(
                      p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
                  "cublasLtMatmulDescSetAttribute (transb)"))
    return e;
  if (g.hasBias) {
    uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void *biasPtr = reinterpret_cast<const void *>(bias);
    if (auto e = ok(lt->cublasLtMatmulDescSetAttribute(
                        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                        sizeof(epilogue)),
                    "cublasLtMatmulDescSetAttribute (epilogue)"))
      return e;
    if (auto e = ok(lt->cublasLtMatmulDescSetAttribute(
                        p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &biasPtr,
                        sizeof(biasPtr)),
                    "cublasLtMatmulDescSetAttribute (bias)"))
      return e;
  }
  cudaDataType_t ab = cudaType(g.abType), dt = cudaType(g.dType);
  if (auto e = ok(lt->cublasLtMatrixLayoutCreate(&p.a, ab, g.transA ? g.k : g.m,
                                                 g.transA ? g.m : g.k, g.lda),
                  "cublasLtMatrixLayoutCreate (A)"))
    return e;
  if (auto e = ok(lt->cublasLtMatrixLayoutCreate(&p.b, ab, g.transB ? g.n : g.k,
                                                 g.transB ? g.k : g.n, g.ldb),
                  "cublasLtMatrixLayoutCreate (B)"))
    return e;
  if (auto e = ok(lt->cublasLtMatrixLayoutCreate(&p.d, dt, g.m, g.n, g.ldd),
                  "cublasLtMatrixLayoutCreate (D)"))
    return e;
  cublasLtMatmulPreference_t pref = nullptr;
  if (auto e = ok(lt->cublasLtMatmulPreferenceCreate(&pref),
                  "cublasLtMatmulPreferenceCreate"))
    return e;
  uint64_t ws = workspaceBytes;
  cublasStatus_t st = lt->cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  // Algorithms may assume 256-byte aligned matrices unless told otherwise;
  // arena offsets are only as aligned as the plan's alignment.
  auto alignmentOf = [](CUdeviceptr p) {
    uint32_t a = 256;
    while (a > 1 && p % a)
      a /= 2;
    return a;
  };
  uint32_t aligns[4] = {alignmentOf(A), alignmentOf(B), alignmentOf(D),
                        alignmentOf(D)};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i)
    st = lt->cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i, &aligns[i],
        sizeof(aligns[i]));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt->cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d,
                                            pref, 1, &result, &found);
  lt->cublasLtMatmulPreferenceDestroy(pref);
  if (auto e = ok(st, "cublasLtMatmulAlgoGetHeuristic"))
    return e;
  if (found == 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "cuBLASLt has no algorithm for a %s x %s -> %s GEMM m=%lld n=%lld "
        "k=%lld%s",
        exec::dtypeName(g.abType), exec::dtypeName(g.abType),
        exec::dtypeName(g.dType), static_cast<long long>(g.m),
        static_cast<long long>(g.n), static_cast<long long>(g.k),
        g.hasBias ? " with bias" : "");
  p.algo = result.algo;
  p.workspaceBytes = result.workspaceSize;
  return plans.size() - 1;
}

llvm::Error GemmPlans::run(size_t index, CUstream stream) const {
  const Plan &p = plans[index];
  float alpha = 1.0f, beta = 0.0f;
  return checkCublas(
      *lt,
      lt->cublasLtMatmul(
          handle, p.desc, &alpha, reinterpret_cast<const void *>(p.A), p.a,
          reinterpret_cast<const void *>(p.B), p.b, &beta,
          reinterpret_cast<const void *>(p.D), p.d,
          reinterpret_cast<void *>(p.D), p.d, &p.algo,
          reinterpret_cast<void *>(workspace), p.workspaceBytes, stream),
      "cublasLtMatmul");
}

void GemmPlans::destroy() {
  for (Plan &g : plans) {
    if (g.desc)
      lt->cublasLtMatmulDescDestroy(g.desc);
    for (cublasLtMatrixLayout_t l : {g.a, g.b, g.d})
      if (l)
        lt->cublasLtMatrixLayoutDestroy(l);
  }
  plans.clear();
  if (handle)
    lt->cublasLtDestroy(handle);
  handle = nullptr;
}
