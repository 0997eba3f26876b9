//===- ElementwiseKernels.h - CUDA C++ of the dense graph ops --*- C++ -*-===//
//
// The cuda backend's kernels for every graph op that is neither a GEMM nor
// 3D-DSA: norms, modulation, activations, residual and bias adds, casts,
// split/concat, patch embedding (im2col + GEMM), (un)patchify, timestep and
// table embeddings, 3D RoPE, global attention, flow matching. Each kernel is
// a CUDA C++ template over the element types it reads and writes (bf16, f16,
// f32; ids i32/i64) with fp32 arithmetic, instantiated as one extern "C"
// kernel per type combination a plan needs and compiled with NVRTC
// (include/megaslide/runtime/cuda/Nvrtc.h) for sm_90a. Shapes are kernel
// arguments, so one compilation serves every layer. Which kernels an op
// launches is GraphOpLowering.h's.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_ELEMENTWISEKERNELS_H
#define MEGASLIDE_RUNTIME_CUDA_ELEMENTWISEKERNELS_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <string>
#include <vector>

namespace megaslide::cuda {

/// Threads per block of every generated kernel.
inline constexpr unsigned kElementwiseBlockThreads = 256;
/// Largest head dim the global-attention kernels take (8 values per lane).
inline constexpr int64_t kAttentionMaxHeadDim = 256;
/// Threads per block of the tensor-core attention kernels (4 warps of 16
/// rows each, docs/Runtime.md, "Attention on tensor cores").
inline constexpr unsigned kAttentionTcBlockThreads = 128;
/// Largest head dim of the tensor-core attention kernels (which take the
/// multiples of 8 up to it).
inline constexpr int64_t kAttentionTcMaxHeadDim = 128;

/// Most elements one launch of a grid-stride kernel may cover: their
/// indices are 32-bit (no 64-bit division per element), and i plus the
/// grid's thread count must not wrap. The lowering refuses larger ops.
inline constexpr int64_t kMaxKernelElements = INT32_MAX;

/// A divisor d in [1, 2^31) as the kernels' `msDivisor` argument (a `q`
/// parameter): its Granlund-Montgomery multiplier m = floor(2^32 (2^s -
/// d) / d) + 1, s = ceil(log2 d), in the low 32 bits and d in the high
/// ones, so that n / d = (umulhi(n, m) + n) >> s for every n < 2^31.
uint64_t fastDivisor(int64_t d);

/// A kernel template instantiated for concrete element types.
struct KernelInstance {
  std::string kind;               ///< e.g. "layer_norm", "colsum_partial"
  std::vector<exec::DType> types; ///< one per template type parameter

  /// The extern "C" name: "ms_" + kind + "_" + type names joined by "_",
  /// e.g. ms_layer_norm_bf16_bf16_bf16_bf16.
  std::string name() const;
  bool operator<(const KernelInstance &o) const;
  bool operator==(const KernelInstance &o) const;
};

/// Kernel kinds the generator knows, with how many type parameters each
/// takes, in source order.
struct KernelKindInfo {
  const char *kind;
  int numTypes;
  unsigned threads; ///< threads per block of its launches
  bool tensorCore;  ///< 16-bit inputs only (no f32 instance)
};
llvm::ArrayRef<KernelKindInfo> elementwiseKernelKinds();

/// Threads per block of the generated kernel named `name` (ms_<kind>_...):
/// kElementwiseBlockThreads but for the tensor-core attention kernels.
unsigned kernelBlockThreads(llvm::StringRef name);

/// The C type of each parameter of an instance's kernel, e.g. {"const
/// ms_bf16 *", "float *", "long long", "float"}; empty for an unknown kind.
std::vector<std::string> kernelParameterTypes(const KernelInstance &kernel);

/// CUDA C++ with the shared helpers, every kernel template and one
/// `extern "C" __global__` per (distinct) instance. Header-free: the
/// 16-bit conversions are written out; with MS_HOST_EMULATION defined the
/// inline PTX is left out for a host compiler (the emulator supplies it).
std::string emitElementwiseSource(llvm::ArrayRef<KernelInstance> kernels);

/// Every kind with uniform bf16, f16 and f32 types and a mixed bf16/f32
/// variant (ids i32 and i64 where a kind takes them; the tensor-core kinds
/// without f32 inputs): what the tests compile.
std::vector<KernelInstance> representativeKernelInstances();

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_ELEMENTWISEKERNELS_H
