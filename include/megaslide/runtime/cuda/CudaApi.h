//===- CudaApi.h - CUDA driver and cuBLASLt loaded at run time --*- C++ -*-===//
//
// The entry points of the CUDA driver (libcuda.so.1) and of cuBLASLt that
// the cuda backend calls, held in a symbol table filled by dlopen/dlsym
// (after IREE's cuda_dynamic_symbol_table). Nothing here needs the CUDA
// headers or libraries at build time: the few ABI types, enum values and
// structs are declared below as cuda.h, library_types.h and cublasLt.h
// (CUDA 12/13) define them, so the backend always builds and a process
// without a driver gets an llvm::Error instead of a loader failure.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDAAPI_H
#define MEGASLIDE_RUNTIME_CUDA_CUDAAPI_H

#include "llvm/Support/Error.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace megaslide::cuda {

//===----------------------------------------------------------------------===//
// ABI of the driver API (cuda.h)
//===----------------------------------------------------------------------===//

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st *;
using CUmodule = struct CUmod_st *;
using CUfunction = struct CUfunc_st *;
using CUstream = struct CUstream_st *;
using CUevent = struct CUevent_st *;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned CU_EVENT_DEFAULT = 0x0;
inline constexpr unsigned CU_EVENT_BLOCKING_SYNC = 0x1;
inline constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
inline constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x1;

//===----------------------------------------------------------------------===//
// ABI of cuBLASLt (cublasLt.h, cublas_api.h, library_types.h)
//===----------------------------------------------------------------------===//

using cublasStatus_t = int;
using cublasLtHandle_t = struct cublasLtContext *;
using cublasLtMatmulDesc_t = struct cublasLtMatmulDescOpaque *;
using cublasLtMatrixLayout_t = struct cublasLtMatrixLayoutOpaque *;
using cublasLtMatmulPreference_t = struct cublasLtMatmulPreferenceOpaque *;
using cublasComputeType_t = int;
using cudaDataType_t = int;
using cublasOperation_t = int;
using cublasLtMatmulDescAttributes_t = int;
using cublasLtMatmulPreferenceAttributes_t = int;

/// cublasLtMatmulAlgo_t: opaque, 64 bytes.
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};
/// cublasLtMatmulHeuristicResult_t.
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

inline constexpr cublasStatus_t CUBLAS_STATUS_SUCCESS = 0;
inline constexpr cublasComputeType_t CUBLAS_COMPUTE_32F = 68;
inline constexpr cudaDataType_t CUDA_R_32F = 0;
inline constexpr cudaDataType_t CUDA_R_16F = 2;
inline constexpr cudaDataType_t CUDA_R_16BF = 14;
inline constexpr cublasOperation_t CUBLAS_OP_N = 0;
inline constexpr cublasOperation_t CUBLAS_OP_T = 1;
inline constexpr cublasLtMatmulDescAttributes_t CUBLASLT_MATMUL_DESC_TRANSA = 3;
inline constexpr cublasLtMatmulDescAttributes_t CUBLASLT_MATMUL_DESC_TRANSB = 4;
inline constexpr cublasLtMatmulDescAttributes_t CUBLASLT_MATMUL_DESC_EPILOGUE =
    7;
inline constexpr cublasLtMatmulDescAttributes_t
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8;
inline constexpr uint32_t CUBLASLT_EPILOGUE_BIAS = 4;
inline constexpr cublasLtMatmulPreferenceAttributes_t
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1;
/// uint32_t; A, B, C, D follow at 6, 7, 8.
inline constexpr cublasLtMatmulPreferenceAttributes_t
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5;

//===----------------------------------------------------------------------===//
// ABI of NCCL (nccl.h, NCCL 2.18 and later)
//===----------------------------------------------------------------------===//

using ncclResult_t = int;
using ncclComm_t = struct ncclComm *;
using ncclDataType_t = int;
using ncclRedOp_t = int;
/// ncclUniqueId: opaque, NCCL_UNIQUE_ID_BYTES (128).
struct ncclUniqueId {
  char internal[128];
};

inline constexpr ncclResult_t ncclSuccess = 0;
inline constexpr ncclResult_t ncclInProgress = 7;
inline constexpr ncclDataType_t ncclFloat16 = 6;
inline constexpr ncclDataType_t ncclFloat32 = 7;
inline constexpr ncclDataType_t ncclBfloat16 = 9;
inline constexpr ncclRedOp_t ncclSum = 0;

//===----------------------------------------------------------------------===//
// Symbol tables
//===----------------------------------------------------------------------===//

// X(name, return type, parameter types...): the driver entry points. Names
// are the versioned symbols cuda.h's macros select (cuMemAlloc is
// cuMemAlloc_v2, ...), so any driver of the CUDA 12/13 era exports them.
#define MEGASLIDE_CUDA_DRIVER_SYMBOLS(X)                                       \
  X(cuGetErrorString, CUresult, CUresult, const char **)                       \
  X(cuGetErrorName, CUresult, CUresult, const char **)                         \
  X(cuInit, CUresult, unsigned)                                                \
  X(cuDriverGetVersion, CUresult, int *)                                       \
  X(cuDeviceGetCount, CUresult, int *)                                         \
  X(cuDeviceGet, CUresult, CUdevice *, int)                                    \
  X(cuDeviceGetAttribute, CUresult, int *, int, CUdevice)                      \
  X(cuDeviceGetName, CUresult, char *, int, CUdevice)                          \
  X(cuDevicePrimaryCtxRetain, CUresult, CUcontext *, CUdevice)                 \
  X(cuDevicePrimaryCtxRelease_v2, CUresult, CUdevice)                          \
  X(cuCtxSetCurrent, CUresult, CUcontext)                                      \
  X(cuMemGetInfo_v2, CUresult, size_t *, size_t *)                             \
  X(cuMemAlloc_v2, CUresult, CUdeviceptr *, size_t)                            \
  X(cuMemFree_v2, CUresult, CUdeviceptr)                                       \
  X(cuMemHostAlloc, CUresult, void **, size_t, unsigned)                       \
  X(cuMemFreeHost, CUresult, void *)                                           \
  X(cuMemcpyHtoDAsync_v2, CUresult, CUdeviceptr, const void *, size_t,         \
    CUstream)                                                                  \
  X(cuMemcpyDtoHAsync_v2, CUresult, void *, CUdeviceptr, size_t, CUstream)     \
  X(cuMemcpyDtoDAsync_v2, CUresult, CUdeviceptr, CUdeviceptr, size_t,          \
    CUstream)                                                                  \
  X(cuMemsetD8Async, CUresult, CUdeviceptr, unsigned char, size_t, CUstream)   \
  X(cuStreamCreate, CUresult, CUstream *, unsigned)                            \
  X(cuStreamDestroy_v2, CUresult, CUstream)                                    \
  X(cuStreamSynchronize, CUresult, CUstream)                                   \
  X(cuStreamWaitEvent, CUresult, CUstream, CUevent, unsigned)                  \
  X(cuEventCreate, CUresult, CUevent *, unsigned)                              \
  X(cuEventDestroy_v2, CUresult, CUevent)                                      \
  X(cuEventRecord, CUresult, CUevent, CUstream)                                \
  X(cuEventSynchronize, CUresult, CUevent)                                     \
  X(cuEventQuery, CUresult, CUevent)                                           \
  X(cuEventElapsedTime, CUresult, float *, CUevent, CUevent)                   \
  X(cuModuleLoadData, CUresult, CUmodule *, const void *)                      \
  X(cuModuleUnload, CUresult, CUmodule)                                        \
  X(cuModuleGetFunction, CUresult, CUfunction *, CUmodule, const char *)       \
  X(cuFuncSetAttribute, CUresult, CUfunction, int, int)                        \
  X(cuLaunchKernel, CUresult, CUfunction, unsigned, unsigned, unsigned,        \
    unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)

#define MEGASLIDE_CUBLASLT_SYMBOLS(X)                                          \
  X(cublasLtCreate, cublasStatus_t, cublasLtHandle_t *)                        \
  X(cublasLtDestroy, cublasStatus_t, cublasLtHandle_t)                         \
  X(cublasLtGetVersion, size_t)                                                \
  X(cublasLtGetStatusName, const char *, cublasStatus_t)                       \
  X(cublasLtMatmulDescCreate, cublasStatus_t, cublasLtMatmulDesc_t *,          \
    cublasComputeType_t, cudaDataType_t)                                       \
  X(cublasLtMatmulDescDestroy, cublasStatus_t, cublasLtMatmulDesc_t)           \
  X(cublasLtMatmulDescSetAttribute, cublasStatus_t, cublasLtMatmulDesc_t,      \
    cublasLtMatmulDescAttributes_t, const void *, size_t)                      \
  X(cublasLtMatrixLayoutCreate, cublasStatus_t, cublasLtMatrixLayout_t *,      \
    cudaDataType_t, uint64_t, uint64_t, int64_t)                               \
  X(cublasLtMatrixLayoutDestroy, cublasStatus_t, cublasLtMatrixLayout_t)       \
  X(cublasLtMatmulPreferenceCreate, cublasStatus_t,                            \
    cublasLtMatmulPreference_t *)                                              \
  X(cublasLtMatmulPreferenceDestroy, cublasStatus_t,                           \
    cublasLtMatmulPreference_t)                                                \
  X(cublasLtMatmulPreferenceSetAttribute, cublasStatus_t,                      \
    cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,          \
    const void *, size_t)                                                      \
  X(cublasLtMatmulAlgoGetHeuristic, cublasStatus_t, cublasLtHandle_t,          \
    cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,      \
    cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,                            \
    cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t *, int *) \
  X(cublasLtMatmul, cublasStatus_t, cublasLtHandle_t, cublasLtMatmulDesc_t,    \
    const void *, const void *, cublasLtMatrixLayout_t, const void *,          \
    cublasLtMatrixLayout_t, const void *, const void *,                        \
    cublasLtMatrixLayout_t, void *, cublasLtMatrixLayout_t,                    \
    const cublasLtMatmulAlgo_t *, void *, size_t, CUstream)

// The NCCL entry points of the device collectives (docs/Distributed.md).
#define MEGASLIDE_NCCL_SYMBOLS(X)                                              \
  X(ncclGetVersion, ncclResult_t, int *)                                       \
  X(ncclGetErrorString, const char *, ncclResult_t)                            \
  X(ncclGetUniqueId, ncclResult_t, ncclUniqueId *)                             \
  X(ncclCommInitRank, ncclResult_t, ncclComm_t *, int, ncclUniqueId, int)      \
  X(ncclCommDestroy, ncclResult_t, ncclComm_t)                                 \
  X(ncclCommAbort, ncclResult_t, ncclComm_t)                                   \
  X(ncclCommGetAsyncError, ncclResult_t, ncclComm_t, ncclResult_t *)           \
  X(ncclGroupStart, ncclResult_t)                                              \
  X(ncclGroupEnd, ncclResult_t)                                                \
  X(ncclBroadcast, ncclResult_t, const void *, void *, size_t, ncclDataType_t, \
    int, ncclComm_t, CUstream)                                                 \
  X(ncclReduce, ncclResult_t, const void *, void *, size_t, ncclDataType_t,    \
    ncclRedOp_t, int, ncclComm_t, CUstream)                                    \
  X(ncclAllReduce, ncclResult_t, const void *, void *, size_t, ncclDataType_t, \
    ncclRedOp_t, ncclComm_t, CUstream)

/// The driver's entry points. Members are null until loaded; a table handed
/// out by loadCudaDriver has every member set. Tests may fill one by hand.
struct CudaDriverApi {
#define MEGASLIDE_DECLARE(name, ret, ...) ret (*name)(__VA_ARGS__) = nullptr;
  MEGASLIDE_CUDA_DRIVER_SYMBOLS(MEGASLIDE_DECLARE)
#undef MEGASLIDE_DECLARE
  std::string library; ///< the path or name that was loaded
};

/// cuBLASLt's entry points.
struct CublasLtApi {
#define MEGASLIDE_DECLARE(name, ret, ...) ret (*name)(__VA_ARGS__) = nullptr;
  MEGASLIDE_CUBLASLT_SYMBOLS(MEGASLIDE_DECLARE)
#undef MEGASLIDE_DECLARE
  std::string library;
};

/// Loads the CUDA driver once per process and resolves every symbol of
/// CudaDriverApi (cuInit is not called). Tries $MEGASLIDE_CUDA_DRIVER_LIBRARY
/// alone when set, else libcuda.so.1 then libcuda.so. Errors: "no CUDA
/// driver: libcuda.so.1 not found (...)", or the missing symbol.
llvm::Expected<const CudaDriverApi *> loadCudaDriver();

/// Loads the driver library at `path` into a fresh table (not cached, never
/// unloaded): for tests, e.g. with the toolkit's stub libcuda.so.
llvm::Expected<std::unique_ptr<CudaDriverApi>>
openCudaDriver(const std::string &path);

/// NCCL's entry points.
struct NcclApi {
#define MEGASLIDE_DECLARE(name, ret, ...) ret (*name)(__VA_ARGS__) = nullptr;
  MEGASLIDE_NCCL_SYMBOLS(MEGASLIDE_DECLARE)
#undef MEGASLIDE_DECLARE
  std::string library;
};

/// Loads NCCL once per process: $MEGASLIDE_NCCL_LIBRARY alone when set,
/// else the cudaLibraryCandidates of libnccl.so.2 and libnccl.so (the
/// pinned PyPI wheel nvidia-nccl-cu13 installs it in nvidia/nccl/lib).
/// Versions before 2.18 are refused by name.
llvm::Expected<const NcclApi *> loadNccl();
/// "ncclSystemError (...)": NCCL's text for `result` in `what`'s error,
/// or success.
llvm::Error checkNccl(const NcclApi &api, ncclResult_t result,
                      llvm::StringRef what);

/// Loads cuBLASLt once per process: $MEGASLIDE_CUBLASLT_LIBRARY alone when
/// set, else the cudaLibraryCandidates of libcublasLt.so.13, .so.12, .so.
llvm::Expected<const CublasLtApi *> loadCublasLt();

/// "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected" for a driver
/// result, or "CUresult N" when the driver cannot name it. A sticky error
/// (isStickyCudaError) adds that the process must restart.
std::string cuResultString(const CudaDriverApi &api, CUresult result);

/// The results after which the context is unusable and every later call
/// fails the same way (a kernel's illegal address, a failed launch, a
/// device-side assert...; cuda.h: "the process must be terminated and
/// relaunched"). The driver reports them at the next call that
/// synchronises, not necessarily at the launch that caused them.
bool isStickyCudaError(CUresult result);

/// Success, or an error "`what`: <cuResultString>".
llvm::Error checkCu(const CudaDriverApi &api, CUresult result,
                    const llvm::Twine &what);

/// Success, or an error "`what`: cuBLASLt <status name>".
llvm::Error checkCublas(const CublasLtApi &api, cublasStatus_t status,
                        const llvm::Twine &what);

/// What initialising the driver found.
struct CudaDeviceInfo {
  CUdevice device = 0;
  std::string name;
  int ccMajor = 0, ccMinor = 0;
  int multiprocessors = 0;
  int maxThreadsPerMultiprocessor = 0;  ///< resident threads (2048 on sm_90)
  int driverVersion = 0;                ///< e.g. 13000
  size_t freeBytes = 0, totalBytes = 0; ///< filled once a context is current
};

/// cuInit, then device `ordinal`: errors "CUDA driver reports no device
/// (CUDA_ERROR_NO_DEVICE)" when cuInit fails or finds none, "CUDA device N
/// does not exist (M devices)" for a bad ordinal.
llvm::Expected<CudaDeviceInfo> initCudaDevice(const CudaDriverApi &api,
                                              int ordinal);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDAAPI_H
