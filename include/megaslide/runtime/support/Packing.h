//===- Packing.h - Static offsets for buffers with lifetimes ----*- C++ -*-===//
//
// MLIR-free, so that one packer serves the compiler's device arena
// (megaslide-plan-memory) and the cuda backend's shared pinned pool (HostPool.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_PACKING_H
#define MEGASLIDE_RUNTIME_SUPPORT_PACKING_H

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <vector>

namespace megaslide {

/// A buffer of `size` bytes live from step `start` to step `end`
/// (inclusive): it may share bytes only with slices not live at the same
/// time.
struct Slice {
  int64_t size;
  int64_t start;
  int64_t end;
};

struct Packing {
  std::vector<int64_t> offsets; ///< one per slice, multiples of alignment
  int64_t arenaSize = 0;        ///< bytes the offsets span
};

/// Assigns offsets by a best-fit linear scan in time order: at each step,
/// slices that died before it are freed (and coalesced), then the slices
/// starting at it are placed, largest first, into the smallest free block
/// that holds them, or on top of the arena. Deterministic.
Packing packSlices(llvm::ArrayRef<Slice> slices, int64_t alignment);

/// The most bytes live at any one step (a lower bound on any packing).
int64_t peakLiveBytes(llvm::ArrayRef<Slice> slices, int64_t alignment);

/// Rounds `bytes` up to a multiple of `alignment`.
inline int64_t alignTo(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

} // namespace megaslide

#endif // MEGASLIDE_RUNTIME_SUPPORT_PACKING_H
