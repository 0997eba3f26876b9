//===- Random.h - Reproducible random numbers -------------------*- C++ -*-===//
//
// The runtime's one random number generator: splitmix64, whose whole state
// is one 64-bit word, so checkpoints save and restore it exactly and
// results do not depend on the standard library's distributions.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_RANDOM_H
#define MEGASLIDE_RUNTIME_TRAIN_RANDOM_H

#include "llvm/ADT/StringRef.h"

#include <cmath>
#include <cstdint>

namespace megaslide::train {

class Random {
public:
  explicit Random(uint64_t seed) : state(seed) {}

  /// What each draw adds to the state: n draws on is state + n kGamma.
  static constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

  uint64_t next() {
    uint64_t z = (state += kGamma);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() { return (next() >> 11) * 0x1.0p-53; }
  /// Standard normal (Box-Muller; one draw per call keeps the state simple).
  float normal() {
    double u1 = 1.0 - uniform(), u2 = uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) *
                              std::cos(6.283185307179586 * u2));
  }

  uint64_t state;
};

/// FNV-1a of a name, to derive per-tensor streams from one seed.
inline uint64_t hashName(llvm::StringRef name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : name)
    h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return h;
}

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_RANDOM_H
