//===- Nvrtc.h - Run-time CUDA C++ compilation with NVRTC -------*- C++ -*-===//
//
// Compiles generated CUDA C++ (the 3D-DSA kernels) to cubins with NVRTC.
// NVRTC is loaded with dlopen at run time through a small symbol table, so
// binaries built here run where no CUDA exists and say so clearly. Results
// are cached on disk, keyed by a stable hash of source, architecture,
// options and NVRTC version (nothing of the machine's paths for a
// header-free source). No MLIR dependency (runtime/).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_NVRTC_H
#define MEGASLIDE_RUNTIME_CUDA_NVRTC_H

#include <cstdint>
#include <string>
#include <vector>

namespace megaslide::cuda {

/// What one NVRTC compilation produced. `error` is empty on success; on an
/// NVRTC compilation failure it is the compiler log, verbatim.
struct CompileResult {
  std::string cubin; ///< SASS for a real architecture (sm_XX), else empty
  std::string ptx;
  std::string log; ///< NVRTC's log, including ptxas -v resource lines
  std::string error;
  bool fromCache = false;

  bool ok() const { return error.empty(); }
};

/// Compiles `source` (program name `name`, used in diagnostics) for `arch`
/// ("sm_90a" gives a cubin, "compute_90a" PTX only) with
/// defaultCompileOptions(arch, source) and `extraOptions`. Looks up and fills
/// the on-disk cache (kernelCacheDir()).
CompileResult compileCuda(const std::string &source, const std::string &name,
                          const std::string &arch,
                          const std::vector<std::string> &extraOptions = {});

/// True if NVRTC could be loaded; otherwise `whyNot` says what was tried.
/// Tries $MEGASLIDE_NVRTC_LIBRARY alone when set, else libnvrtc.so,
/// libnvrtc.so.13 (loader path), $CUDA_HOME/lib64 and /usr/local/cuda/lib64.
bool nvrtcAvailable(std::string *whyNot = nullptr);

/// NVRTC's version as "major.minor", or "" when NVRTC is not loadable.
std::string nvrtcVersionString();

/// True if `source` has an #include directive (a line starting with `#`
/// and `include`, blanks allowed around the `#`).
bool includesHeaders(const std::string &source);

/// The options compileCuda passes before `extraOptions`: the architecture,
/// C++17 and ptxas -v; for a source that includes headers, also the CUDA
/// include folder ($CUDA_HOME/include, else /usr/local/cuda/include) when it
/// exists. The options are part of the cache key, so a header-free source
/// (every generated kernel) has the same key wherever CUDA is installed.
std::vector<std::string> defaultCompileOptions(const std::string &arch,
                                               const std::string &source = "");

//===----------------------------------------------------------------------===//
// On-disk kernel cache
//===----------------------------------------------------------------------===//

/// $MEGASLIDE_KERNEL_CACHE, else $XDG_CACHE_HOME/megaslide/kernels, else
/// ~/.cache/megaslide/kernels; "" when MEGASLIDE_KERNEL_CACHE is "off" or no
/// directory can be named.
std::string kernelCacheDir();

/// 64-bit FNV-1a: stable across runs, compilers and machines.
uint64_t fnv1a64(const std::string &data,
                 uint64_t seed = 0xcbf29ce484222325ull);

/// Cache key (16 hex digits) of a compilation: every input is length-framed
/// so that moving text between fields changes the key.
std::string cacheKey(const std::string &source, const std::string &arch,
                     const std::vector<std::string> &options,
                     const std::string &nvrtcVersion);

//===----------------------------------------------------------------------===//
// Resource usage and occupancy
//===----------------------------------------------------------------------===//

/// One kernel's resources as reported by `ptxas -v`.
struct KernelResources {
  std::string kernel;
  int registers = 0;
  int sharedBytes = 0; ///< static shared memory
  int stackBytes = 0;
  int spillStores = 0;
  int spillLoads = 0;
};

/// Parses the ptxas info lines of an NVRTC (or nvcc -Xptxas -v) log, one
/// entry per compiled entry function, in log order.
std::vector<KernelResources> parsePtxasLog(const std::string &log);

/// Theoretical occupancy of one SM of H100/H200 (sm_90).
struct Occupancy {
  int blocksPerSm = 0;
  int warpsPerSm = 0;
  double fraction = 0; ///< active warps / 64
  std::string limiter; ///< the binding limits, e.g. "registers and threads",
                       ///< or why the kernel cannot launch
};

/// sm_90 limits: 65536 registers per SM allocated per warp in units of 256,
/// at most 255 per thread and 65536 per block; 228 KB shared memory per SM,
/// at most 227 KB per block, plus 1 KB the driver reserves per block; 2048
/// threads (64 warps) and 32 blocks per SM.
Occupancy occupancySm90(const KernelResources &kernel, int threadsPerBlock,
                        int dynamicSharedBytes = 0);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_NVRTC_H
