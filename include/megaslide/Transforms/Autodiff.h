//===- Autodiff.h - Reverse-mode differentiation of graph IR ----*- C++ -*-===//

#ifndef MEGASLIDE_TRANSFORMS_AUTODIFF_H
#define MEGASLIDE_TRANSFORMS_AUTODIFF_H

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

#endif // MEGASLIDE_TRANSFORMS_AUTODIFF_H
