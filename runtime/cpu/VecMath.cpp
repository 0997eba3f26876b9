//===- VecMath.cpp - Vectorised math of the CPU kernels -------------------===//
//
// VecKernels.inc is compiled three times: for the baseline (SSE2 on
// x86-64), AVX2 with FMA and AVX-512, each in a namespace of its own under
// a target pragma, so that one source serves every variant (AdamW.cpp does
// the same with target attributes on its few functions). The loops use
// GCC/Clang vector extensions one register wide (4, 8 or 16 floats). This file is compiled with -ffp-contract=fast
// (runtime/CMakeLists.txt): where FMA exists a * b + c becomes one
// rounding, so the variants differ in the last bits (cpu/Isa.h).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/VecMath.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

using namespace megaslide::cpu;

/// The types VecKernels.inc works on, `lanes` floats per register.
#define MEGASLIDE_VEC_TYPES(lanes)                                             \
  constexpr int kLanes = lanes, kHalf = lanes / 2;                            \
  typedef float VF __attribute__((vector_size(kLanes * sizeof(float))));      \
  typedef int32_t VI __attribute__((vector_size(kLanes * sizeof(int32_t))));  \
  typedef float VH __attribute__((vector_size(kHalf * sizeof(float))));       \
  typedef double VD __attribute__((vector_size(kHalf * sizeof(double))));     \
  typedef int64_t VL __attribute__((vector_size(kHalf * sizeof(int64_t))));

namespace generic {
MEGASLIDE_VEC_TYPES(4)
#include "VecKernels.inc"
} // namespace generic

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGASLIDE_VEC_X86 1

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))),              \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
MEGASLIDE_VEC_TYPES(8)
#include "VecKernels.inc"
} // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))),             \
    apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#endif
namespace avx512 {
MEGASLIDE_VEC_TYPES(16)
#include "VecKernels.inc"
} // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

const VecKernels &megaslide::cpu::vecKernels(CpuIsa isa) {
#ifdef MEGASLIDE_VEC_X86
  if (isa == CpuIsa::Avx512)
    return avx512::kKernels;
  if (isa == CpuIsa::Avx2)
    return avx2::kKernels;
#endif
  return generic::kKernels;
}
