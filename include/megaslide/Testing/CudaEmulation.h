//===- CudaEmulation.h - Generated CUDA C++ built for the host --*- C++ -*-===//
//
// The tests of the generated kernels (the dense ones in CudaBackendTest,
// 3D-DSA in DsaKernelEmulationTest) have no GPU, so they compile the CUDA
// C++ with the host compiler after kCudaEmulationPrelude, one emulation of
// the CUDA execution model: blocks run one after another; a block's
// threads are fibers switched cooperatively at __syncthreads and at warp
// collectives, which are rendezvous of the 32 lanes of a warp. Each test
// adds what only its kernels use (16-bit conversions, inline-PTX
// replacements) and C entry points calling emu::launch, and loads the
// result with buildHostLibrary. FakeCuda (an asynchronous fake driver) runs
// such entry points as the kernels of its streams.
//
// What an emulation cannot check: timing, races of real asynchronous
// copies, or the hardware's reading of the PTX (scripts/device-check.sh).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TEST_UNIT_SUPPORT_CUDAEMULATION_H
#define MEGASLIDE_TEST_UNIT_SUPPORT_CUDAEMULATION_H

#include <filesystem>
#include <string>

namespace megaslide::test {

/// C++ source to put before generated CUDA C++. It defines, in namespace
/// emu: Dim3, the shared memory of the running block (g_smem, kSmemBytes,
/// filled with 0xff, a NaN in 16 bits, at each block), Slot and
/// collective(mine, all) (a warp rendezvous: `all` maps the 32 lanes'
/// slots to their results once), fail(what) (aborts, naming it) and
/// launch(grid, threads, kernel); and of CUDA: threadIdx, blockIdx,
/// blockDim, gridDim, __syncthreads, __shfl_xor_sync (float and int), the
/// bit casts, float2, min(int, int), atomicAdd(float2 *) and the function
/// qualifiers. A kernel that leaves a thread waiting at a barrier no other
/// thread reaches aborts ("deadlock").
extern const char *const kCudaEmulationPrelude;

/// The host C++ compiler: $CXX, else c++.
std::string hostCompiler();

/// Compiles `source` (C++17) into `dir`/`name`.emu.so with hidden symbols
/// and no GNU-unique ones, so each library keeps its own emulator state
/// and can be unloaded, and dlopens it. Returns null and says why (the
/// compiler's command and log, or dlerror) when either fails.
void *buildHostLibrary(const std::string &source,
                       const std::filesystem::path &dir,
                       const std::string &name, std::string &why);

} // namespace megaslide::test

#endif // MEGASLIDE_TEST_UNIT_SUPPORT_CUDAEMULATION_H
