//===- CudaApi.cpp - CUDA driver and cuBLASLt loaded at run time ----------===//

#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/cuda/Libraries.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include <dlfcn.h>

namespace megaslide::cuda {

namespace {

/// A library handle and the names tried to get it.
struct Opened {
  void *handle = nullptr;
  std::string name;
  std::string tried;
};

Opened openFirst(const std::vector<std::string> &names) {
  Opened o;
  for (const std::string &name : names) {
    o.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (o.handle) {
      o.name = name;
      return o;
    }
    o.tried += "\n  " + name;
    if (const char *e = dlerror())
      o.tried += std::string(" (") + e + ")";
  }
  return o;
}

/// Symbols whose name in the library differs from the table's member: the
/// first name the library has wins.
std::vector<const char *> symbolNames(const char *member) {
  // CUDA 12.8+ versions cuEventElapsedTime; older drivers lack the _v2.
  if (std::string(member) == "cuEventElapsedTime")
    return {"cuEventElapsedTime_v2", "cuEventElapsedTime"};
  return {member};
}

void *lookup(void *handle, const char *member) {
  for (const char *name : symbolNames(member))
    if (void *p = dlsym(handle, name))
      return p;
  return nullptr;
}

// Sets member `name` of table `t` from `handle`, or returns which symbol
// the library (`what`) lacks.
#define MEGASLIDE_RESOLVE(name, ret, ...)                                      \
  t.name = reinterpret_cast<ret (*)(__VA_ARGS__)>(lookup(handle, #name));      \
  if (!t.name)                                                                 \
    return llvm::createStringError(llvm::inconvertibleErrorCode(),             \
                                   "%s (%s) lacks the symbol " #name, what,    \
                                   t.library.c_str());

llvm::Error resolveAll(CudaDriverApi &t, void *handle, const char *what) {
  MEGASLIDE_CUDA_DRIVER_SYMBOLS(MEGASLIDE_RESOLVE)
  return llvm::Error::success();
}

llvm::Error resolveAll(CublasLtApi &t, void *handle, const char *what) {
  MEGASLIDE_CUBLASLT_SYMBOLS(MEGASLIDE_RESOLVE)
  return llvm::Error::success();
}

llvm::Error resolveAll(NcclApi &t, void *handle, const char *what) {
  MEGASLIDE_NCCL_SYMBOLS(MEGASLIDE_RESOLVE)
  return llvm::Error::success();
}

#undef MEGASLIDE_RESOLVE

/// Opens the first of `names` that loads and resolves `table` from it;
/// `notFound` turns the list of what was tried into the error when none
/// loads.
template <typename Table>
llvm::Error
openTable(Table &table, const std::vector<std::string> &names, const char *what,
          llvm::function_ref<std::string(const std::string &tried)> notFound) {
  Opened o = openFirst(names);
  if (!o.handle)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   notFound(o.tried));
  table.library = o.name;
  return resolveAll(table, o.handle, what);
}

/// A table loaded once per process by `load`, or the message of why it
/// could not be.
template <typename Table> class Loaded {
public:
  explicit Loaded(llvm::function_ref<llvm::Error(Table &)> load) {
    if (llvm::Error e = load(table))
      error = llvm::toString(std::move(e));
  }
  llvm::Expected<const Table *> get() const {
    if (!error.empty())
      return llvm::createStringError(llvm::inconvertibleErrorCode(), error);
    return &table;
  }

private:
  Table table;
  std::string error;
};

std::string envOr(const char *var) {
  const char *v = std::getenv(var);
  return v && *v ? v : "";
}

} // namespace

llvm::Expected<const CudaDriverApi *> loadCudaDriver() {
  static const Loaded<CudaDriverApi> loaded([](CudaDriverApi &table) {
    std::vector<std::string> names;
    if (std::string lib = envOr("MEGASLIDE_CUDA_DRIVER_LIBRARY"); !lib.empty())
      names = {lib};
    else
      names = {"libcuda.so.1", "libcuda.so"};
    return openTable(
        table, names, "the CUDA driver", [&](const std::string &tried) {
          return "no CUDA driver: " + names.front() +
                 " not found (the NVIDIA driver is not installed on this "
                 "machine); tried:" +
                 tried;
        });
  });
  return loaded.get();
}

llvm::Expected<std::unique_ptr<CudaDriverApi>>
openCudaDriver(const std::string &path) {
  auto table = std::make_unique<CudaDriverApi>();
  if (llvm::Error e = openTable(
          *table, {path}, "the CUDA driver", [&](const std::string &tried) {
            return "no CUDA driver: " + path + " not found; tried:" + tried;
          }))
    return std::move(e);
  return table;
}

llvm::Expected<const CublasLtApi *> loadCublasLt() {
  static const Loaded<CublasLtApi> loaded([](CublasLtApi &table) {
    std::vector<std::string> names;
    if (std::string lib = envOr("MEGASLIDE_CUBLASLT_LIBRARY"); !lib.empty())
      names = {lib};
    else
      names = cudaLibraryCandidates(
          {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"});
    return openTable(table, names, "cuBLASLt", [](const std::string &tried) {
      return "no cuBLASLt: libcublasLt.so not found; tried:" + tried +
             "\n(and found none in the lib64, lib and targets/*/lib "
             "folders of $CUDA_HOME, $CUDA_PATH and /usr/local/cuda, nor in "
             "a pip wheel's nvidia/*/lib)\ninstall the CUDA toolkit's "
             "cuBLAS, or point CUDA_HOME, LD_LIBRARY_PATH or "
             "MEGASLIDE_CUBLASLT_LIBRARY at it";
    });
  });
  return loaded.get();
}

llvm::Expected<const NcclApi *> loadNccl() {
  static const Loaded<NcclApi> loaded([](NcclApi &table) -> llvm::Error {
    std::vector<std::string> names;
    if (std::string lib = envOr("MEGASLIDE_NCCL_LIBRARY"); !lib.empty())
      names = {lib};
    else
      names = cudaLibraryCandidates({"libnccl.so.2", "libnccl.so"});
    if (llvm::Error e =
            openTable(table, names, "NCCL", [](const std::string &tried) {
              return "no NCCL: libnccl.so.2 not found; tried:" + tried +
                     "\n(and found none in the CUDA toolkit's folders nor in "
                     "a pip wheel's nvidia/*/lib)\ninstall the pinned "
                     "nvidia-nccl-cu13 wheel (scripts/install-deps.sh), or "
                     "point LD_LIBRARY_PATH or MEGASLIDE_NCCL_LIBRARY at it";
            }))
      return e;
    // NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9.
    int version = 0;
    if (table.ncclGetVersion(&version) != ncclSuccess || version < 21800)
      return llvm::createStringError(
          llvm::formatv("{0} is NCCL {1}.{2}.{3}; the device collectives "
                        "need 2.18 or later",
                        table.library, version / 10000, version / 100 % 100,
                        version % 100)
              .str());
    return llvm::Error::success();
  });
  return loaded.get();
}

llvm::Error checkNccl(const NcclApi &api, ncclResult_t result,
                      llvm::StringRef what) {
  if (result == ncclSuccess)
    return llvm::Error::success();
  const char *text = api.ncclGetErrorString(result);
  return llvm::createStringError(llvm::formatv("{0}: NCCL error {1} ({2})",
                                               what, result,
                                               text ? text : "unknown")
                                     .str());
}

/// Names of the results a driver may fail to name itself (the toolkit's
/// stub library answers every call, cuGetErrorName included, with 34).
static const char *knownResultName(CUresult r) {
  switch (r) {
  case 1:
    return "CUDA_ERROR_INVALID_VALUE";
  case 2:
    return "CUDA_ERROR_OUT_OF_MEMORY";
  case 3:
    return "CUDA_ERROR_NOT_INITIALIZED";
  case 34:
    return "CUDA_ERROR_STUB_LIBRARY";
  case 35:
    return "CUDA_ERROR_INSUFFICIENT_DRIVER";
  case 100:
    return "CUDA_ERROR_NO_DEVICE";
  case 101:
    return "CUDA_ERROR_INVALID_DEVICE";
  case 999:
    return "CUDA_ERROR_UNKNOWN";
  }
  return nullptr;
}

static std::string resultName(const CudaDriverApi &api, CUresult r) {
  const char *name = nullptr;
  if (api.cuGetErrorName && api.cuGetErrorName(r, &name) != CUDA_SUCCESS)
    name = nullptr;
  if (!name)
    name = knownResultName(r);
  return name ? std::string(name) : llvm::formatv("CUresult {0}", r).str();
}

bool isStickyCudaError(CUresult result) {
  switch (result) {
  case 700: // CUDA_ERROR_ILLEGAL_ADDRESS
  case 702: // CUDA_ERROR_LAUNCH_TIMEOUT
  case 710: // CUDA_ERROR_ASSERT
  case 714: // CUDA_ERROR_HARDWARE_STACK_ERROR
  case 715: // CUDA_ERROR_ILLEGAL_INSTRUCTION
  case 716: // CUDA_ERROR_MISALIGNED_ADDRESS
  case 717: // CUDA_ERROR_INVALID_ADDRESS_SPACE
  case 718: // CUDA_ERROR_INVALID_PC
  case 719: // CUDA_ERROR_LAUNCH_FAILED
  case 721: // CUDA_ERROR_TENSOR_MEMORY_LEAK
  case 810: // CUDA_ERROR_MPS_CLIENT_TERMINATED
    return true;
  default:
    return false;
  }
}

std::string cuResultString(const CudaDriverApi &api, CUresult result) {
  const char *name = nullptr, *text = nullptr;
  if (api.cuGetErrorName && api.cuGetErrorName(result, &name) != CUDA_SUCCESS)
    name = nullptr;
  if (api.cuGetErrorString &&
      api.cuGetErrorString(result, &text) != CUDA_SUCCESS)
    text = nullptr;
  std::string s = !name  ? resultName(api, result)
                  : text ? std::string(name) + ": " + text
                         : std::string(name);
  if (isStickyCudaError(result))
    s += " (a sticky error: the CUDA context is unusable, the process must "
         "restart; the call that reports it is the first to synchronise "
         "after the fault, not necessarily its cause: rerun with "
         "MEGASLIDE_CUDA_SYNC=1 to find the kernel)";
  return s;
}

llvm::Error checkCu(const CudaDriverApi &api, CUresult result,
                    const llvm::Twine &what) {
  if (result == CUDA_SUCCESS)
    return llvm::Error::success();
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 what + ": " + cuResultString(api, result));
}

llvm::Error checkCublas(const CublasLtApi &api, cublasStatus_t status,
                        const llvm::Twine &what) {
  if (status == CUBLAS_STATUS_SUCCESS)
    return llvm::Error::success();
  const char *name =
      api.cublasLtGetStatusName ? api.cublasLtGetStatusName(status) : nullptr;
  std::string s = name ? std::string(name)
                       : llvm::formatv("cublasStatus {0}", status).str();
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 what + ": cuBLASLt " + s);
}

llvm::Expected<CudaDeviceInfo> initCudaDevice(const CudaDriverApi &api,
                                              int ordinal) {
  auto errorName = [&](CUresult r) { return resultName(api, r); };
  if (CUresult r = api.cuInit(0); r != CUDA_SUCCESS)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "CUDA driver reports no device (%s from cuInit, driver %s)",
        errorName(r).c_str(), api.library.c_str());
  int count = 0;
  if (CUresult r = api.cuDeviceGetCount(&count); r != CUDA_SUCCESS)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "CUDA driver reports no device (%s)",
                                   errorName(r).c_str());
  if (count == 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "CUDA driver reports no device (CUDA_ERROR_NO_DEVICE)");
  if (ordinal < 0 || ordinal >= count)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "CUDA device %d does not exist (%d devices)",
                                   ordinal, count);
  CudaDeviceInfo info;
  if (llvm::Error e =
          checkCu(api, api.cuDeviceGet(&info.device, ordinal), "cuDeviceGet"))
    return std::move(e);
  char name[256] = {};
  if (api.cuDeviceGetName(name, sizeof(name) - 1, info.device) == CUDA_SUCCESS)
    info.name = name;
  api.cuDeviceGetAttribute(
      &info.ccMajor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, info.device);
  api.cuDeviceGetAttribute(
      &info.ccMinor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, info.device);
  api.cuDeviceGetAttribute(&info.multiprocessors,
                           CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                           info.device);
  api.cuDeviceGetAttribute(&info.maxThreadsPerMultiprocessor,
                           CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
                           info.device);
  api.cuDriverGetVersion(&info.driverVersion);
  return info;
}

} // namespace megaslide::cuda
