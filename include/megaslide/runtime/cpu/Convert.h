//===- Convert.h - A plan's element types to and from fp32 ------*- C++ -*-===//
//
// Both backends compute in fp32 on the host (the cpu backend's kernels, the
// host AdamW, step inputs and the loss) and store tensors in their planned
// dtype: one definition of the conversions, with HalfFloat.h's rounding.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_CONVERT_H
#define MEGASLIDE_RUNTIME_CPU_CONVERT_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include <cstdint>

namespace megaslide::cpu {

class WorkerPool;

/// dst[i] = the fp32 value of element i of `src` (n elements of `dtype`):
/// exact for bf16 and f16, integers rounded to the nearest float.
void widen(const void *src, exec::DType dtype, int64_t n, float *dst);

/// Element i of `dst` (n elements of `dtype`) = src[i]: bf16 and f16 round
/// to nearest even, integers truncate toward zero.
void narrow(const float *src, exec::DType dtype, int64_t n, void *dst);

/// narrow() on up to 8 workers of `pool`, in contiguous parts of at least
/// 2^20 elements: the same bytes.
void narrowOnWorkers(WorkerPool &pool, const float *src, exec::DType dtype,
                     int64_t n, void *dst);

/// acc[i] += the fp32 value of element i of `src`, in index order: the
/// same sum on every thread count and machine.
void accumulate(const void *src, exec::DType dtype, int64_t n, float *acc);

/// The squared L2 norm of n floating-point elements of `dtype` (bf16, f16
/// or f32), summed in double in index order, so it is the same on every
/// thread and machine; NaN or infinite when an element is.
double squaredNorm(const void *src, exec::DType dtype, int64_t n);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_CONVERT_H
