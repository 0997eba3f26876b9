//===- GraphInterfaces.td - Graph op interfaces ------------*- tablegen -*-===//

#ifndef MEGASLIDE_GRAPH_INTERFACES
#define MEGASLIDE_GRAPH_INTERFACES

include "mlir/IR/OpBase.td"

def Graph_DifferentiableOpInterface : OpInterface<"DifferentiableOpInterface"> {
  let cppNamespace = "::megaslide::graph";
  let description = [{
    A forward op that knows how to emit its own backward. Reverse-mode
    autodiff (`megaslide::emitBackward`) walks the forward in reverse and
    asks each op for the gradients of the operands that need one.
  }];
  let methods = [
    InterfaceMethod<[{
        Emits ops computing the gradient of every operand `i` with
        `needed[i]` set, given `resultGrads` (a null value is a zero
        gradient). Appends one value per operand to `operandGrads` (null
        where not needed).
      }],
      "::mlir::LogicalResult", "emitGradients",
      (ins "::mlir::OpBuilder &":$builder,
           "::llvm::ArrayRef<::mlir::Value>":$resultGrads,
           "::llvm::ArrayRef<bool>":$needed,
           "::llvm::SmallVectorImpl<::mlir::Value> &":$operandGrads)>
  ];
}

def Graph_FlopCountOpInterface : OpInterface<"FlopCountOpInterface"> {
  let cppNamespace = "::megaslide::graph";
  let description = [{
    An op that does arithmetic reports its FLOPs (one multiply-add counts
    as 2), split into dense matmul, attention and everything else.
  }];
  let methods = [
    InterfaceMethod<"Returns the FLOPs this op performs.",
      "::megaslide::graph::FlopCount", "getFlopCount">
  ];
}

/// Marks ops that belong to the backward pass of a training step.
def Graph_BackwardOp : NativeOpTrait<"BackwardOp"> {
  let cppNamespace = "::megaslide::graph";
}

#endif // MEGASLIDE_GRAPH_INTERFACES
