//===- GraphAutodiff.h - Reverse mode over graph IR -------------*- C++ -*-===//
//
// Part of the graph dialect: it needs nothing but DifferentiableOpInterface,
// which each op implements (GraphGradients.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_GRAPH_GRAPHAUTODIFF_H
#define MEGASLIDE_GRAPH_GRAPHAUTODIFF_H

#include "mlir/IR/Builders.h"
#include "mlir/IR/Value.h"

namespace megaslide {

/// Emits, at the builder's insertion point, the backward pass of the scalar
/// `loss` with respect to each value of `wrt` (all in the same block as
/// the loss). Ops are visited in reverse order, so the gradients of later
/// layers are produced first; each op emits its own backward through
/// DifferentiableOpInterface. Returns one gradient per `wrt` value (a
/// zeros op for values the loss does not depend on), or failure after
/// emitting a diagnostic on the op that cannot be differentiated.
mlir::FailureOr<llvm::SmallVector<mlir::Value>>
emitBackward(mlir::OpBuilder &builder, mlir::Value loss,
             llvm::ArrayRef<mlir::Value> wrt);

} // namespace megaslide

#endif // MEGASLIDE_GRAPH_GRAPHAUTODIFF_H
