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
/// emu: Dim3, launch(name, grid, threads, dynamicShared, kernel), the
/// running launch's dynamic shared memory (g_smem, g_smemBytes: exactly
/// `dynamicShared` bytes, 16-byte aligned, filled with 0xff, a NaN in 16
/// bits, at each block; it ends at a PROT_NONE page, so an access past a
/// size that is a multiple of 16 faults, and a canary in the bytes rounding
/// other sizes up to 16 catches writes there after the block), Slot and
/// collective(mine, all) (a warp rendezvous: `all` maps the 32 lanes'
/// slots to their results once), fail(what), inSmem (the extent check of
/// ldsm and cpAsync), ldsm, cpAsync (4, 8 or 16 bytes) and mma16816; and
/// of CUDA: threadIdx, blockIdx, blockDim, gridDim, __syncthreads,
/// __syncthreads_or, __shfl_xor_sync (float and int), the bit casts,
/// float2, min(int, int), atomicAdd(float2 *) and the function qualifiers.
/// Failures (shared memory overruns, misaligned copies, a thread waiting at
/// a barrier no other thread reaches: "deadlock") name the kernel; they
/// abort, unless the library's user calls its exported
/// emuRecoverFailures(1): then they end the launch, and emuFailure()
/// returns the message ("" after a launch without one).
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
