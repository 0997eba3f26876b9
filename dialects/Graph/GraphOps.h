//===- GraphOps.h - MegaSlide graph dialect ---------------------*- C++ -*-===//
//
// The graph dialect, its interfaces and its ops. Include this one header.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_GRAPH_GRAPHOPS_H
#define MEGASLIDE_GRAPH_GRAPHOPS_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/InferTypeOpInterface.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include <cstdint>

namespace megaslide::graph {

/// FLOPs of one op; a multiply-add counts as 2.
struct FlopCount {
  uint64_t matmul = 0;    ///< dense GEMMs (linear, patch embedding)
  uint64_t attention = 0; ///< score and value products of attention/3D-DSA
  uint64_t other = 0;     ///< norms, activations, elementwise, optimizer

  uint64_t total() const { return matmul + attention + other; }
  FlopCount &operator+=(const FlopCount &o) {
    matmul += o.matmul;
    attention += o.attention;
    other += o.other;
    return *this;
  }
};

/// Discardable attribute naming the transformer block (i64) an op belongs
/// to; set by the model builder and propagated by autodiff, read by the
/// per-layer planning passes.
inline constexpr llvm::StringLiteral kLayerAttrName = "megaslide.layer";

/// The transformer block `op` belongs to, if any.
inline std::optional<int64_t> getLayer(mlir::Operation *op) {
  if (auto layer = op->getAttrOfType<mlir::IntegerAttr>(kLayerAttrName))
    return layer.getInt();
  return std::nullopt;
}

/// Tags ops of the backward pass (gradient computations).
template <typename ConcreteType>
class BackwardOp : public mlir::OpTrait::TraitBase<ConcreteType, BackwardOp> {};

} // namespace megaslide::graph

#include "dialects/Graph/GraphDialect.h.inc"
#include "dialects/Graph/GraphEnums.h.inc"
#include "dialects/Graph/GraphInterfaces.h.inc"

#define GET_OP_CLASSES
#include "dialects/Graph/GraphOps.h.inc"

#endif // MEGASLIDE_GRAPH_GRAPHOPS_H
