//===- Finite.h - Finding non-finite values ---------------------*- C++ -*-===//
//
// The non-finite policy (docs/Runtime.md, "Non-finite values") checks
// every weight, data sample, gradient and checkpointed tensor. A scan is a
// branch-free OR over exponent bits, which compilers vectorise, so checking
// costs one read of the tensor; the index is searched only when one is
// found.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_FINITE_H
#define MEGASLIDE_RUNTIME_CPU_FINITE_H

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

namespace megaslide::cpu {

namespace detail {
/// Loads through memcpy: reading a float's bits through an integer
/// pointer would break strict aliasing.
template <typename Bits, Bits kExponent, typename T>
std::optional<int64_t> firstNonFiniteBits(const T *data, int64_t n) {
  static_assert(sizeof(T) == sizeof(Bits));
  auto bad = [data](int64_t i) {
    Bits b;
    std::memcpy(&b, data + i, sizeof(Bits));
    return (b & kExponent) == kExponent;
  };
  constexpr int64_t kBlock = 4096;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    int64_t end = begin + kBlock < n ? begin + kBlock : n;
    bool any = false;
    for (int64_t i = begin; i < end; ++i)
      any |= bad(i);
    if (!any)
      continue;
    for (int64_t i = begin; i < end; ++i)
      if (bad(i))
        return i;
  }
  return std::nullopt;
}
} // namespace detail

/// The index of the first NaN or infinity in `data[0, n)`, if any.
inline std::optional<int64_t> firstNonFinite(const float *data, int64_t n) {
  return detail::firstNonFiniteBits<uint32_t, 0x7f800000u>(data, n);
}

/// The same for bf16 (or any 16-bit float with an 8-bit exponent) bits.
inline std::optional<int64_t> firstNonFiniteBf16(const uint16_t *bits,
                                                 int64_t n) {
  return detail::firstNonFiniteBits<uint16_t, 0x7f80u>(bits, n);
}

/// The same for IEEE binary16 bits (5-bit exponent).
inline std::optional<int64_t> firstNonFiniteF16(const uint16_t *bits,
                                                int64_t n) {
  return detail::firstNonFiniteBits<uint16_t, 0x7c00u>(bits, n);
}

/// What a backend says when a gradient reaching the host optimizer holds a
/// non-finite value: the run stops at once, since earlier parameters of
/// the step may already be updated (an exact skip needs the deferred
/// update of docs/Runtime.md, "Non-finite values").
inline std::string nonFiniteGradientMessage(const std::string &param,
                                            int64_t step, int64_t element,
                                            float value) {
  const char *what = std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";
  char where[96];
  std::snprintf(where, sizeof where, "%s at element %lld",
                what, static_cast<long long>(element));
  return "step " + std::to_string(step) + ": the gradient of '" + param +
         "' holds " + where +
         "; the step stopped part-way and the host state is incomplete, so "
         "nothing is saved: resume from the last checkpoint, with a lower "
         "--lr or after checking the data";
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_FINITE_H
