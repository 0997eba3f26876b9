//===- Softmax.h - The exp of the CPU attention kernels ---------*- C++ -*-===//
//
// The row operations that global attention and 3D-DSA share around their
// GEMMs. Every exp of a softmax goes through expSubAndSum, so a vectorised
// exp replaces them all in one place. Sums keep a fixed association, so a
// row's result depends only on its length, never on the thread count.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_SOFTMAX_H
#define MEGASLIDE_RUNTIME_CPU_SOFTMAX_H

#include <cstdint>

namespace megaslide::cpu {

/// The largest of x[0, n); -inf when n is 0.
float maxOf(const float *x, int64_t n);

/// x[j] = exp(x[j] - shift) for j in [0, n); returns the sum of the new
/// x[j], in an association fixed by n.
float expSubAndSum(float *x, int64_t n, float shift);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_SOFTMAX_H
