//===- Shape.h - Shapes in messages -----------------------------*- C++ -*-===//
//
// The graph verifiers (dialects/Graph), the cpu kernels' argument checks
// and the host's readers of safetensors, weights and checkpoints all name
// shapes in their messages; they print them one way, so a problem reads
// the same whichever of them finds it. Header-only: LLVM's ArrayRef only.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_SHAPE_H
#define MEGASLIDE_RUNTIME_SUPPORT_SHAPE_H

#include "llvm/ADT/ArrayRef.h"

#include <cstdint>
#include <string>

namespace megaslide {

/// "[2, 3, 4]"; "[]" for a scalar.
inline std::string shapeString(llvm::ArrayRef<int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

} // namespace megaslide

#endif // MEGASLIDE_RUNTIME_SUPPORT_SHAPE_H
