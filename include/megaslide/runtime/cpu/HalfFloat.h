//===- HalfFloat.h - 16-bit float conversions -------------------*- C++ -*-===//
//
// bf16 and IEEE fp16 to and from fp32, shared by the kernels, the backends
// and the safetensors reader: one definition of the rounding everywhere.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_HALFFLOAT_H
#define MEGASLIDE_RUNTIME_CPU_HALFFLOAT_H

#include <cstdint>
#include <cstring>

namespace megaslide::cpu {

/// The fp32 value of a bf16 bit pattern (exact).
inline float bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

/// The bf16 bit pattern nearest to `f`, ties to even; NaNs stay (quiet)
/// NaNs with their sign. Branch-free so that loops calling it vectorise.
inline uint16_t floatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  uint32_t quietNan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? quietNan : rounded);
}

/// The fp32 value of an IEEE fp16 bit pattern (exact; subnormals, inf and
/// NaN kept).
inline float halfToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

/// The fp16 bit pattern nearest to `f`, ties to even.
inline uint16_t floatToHalf(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_HALFFLOAT_H
