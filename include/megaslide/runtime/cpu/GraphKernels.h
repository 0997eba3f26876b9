//===- GraphKernels.h - fp32 reference kernels of the graph ops -*- C++ -*-===//
//
// The cpu backend's numerics: one kernel per `megaslide` op that can appear
// in a scheduled step, forward and backward, with the semantics its
// description in dialects/Graph/GraphOps.td states. Tensors
// arrive as fp32 whatever their stored dtype (the interpreter widens bf16
// operands and rounds results back), so every kernel accumulates in fp32 or
// better.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_GRAPHKERNELS_H
#define MEGASLIDE_RUNTIME_CPU_GRAPHKERNELS_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/Support/Error.h"

#include <vector>

namespace megaslide::cpu {

/// An operand or result of a graph op. Float tensors (bf16, f16, f32) are
/// given as fp32 in `f32`; i32 and i64 tensors in `i32` / `i64`. Data is
/// C-contiguous in `type.shape`. Result buffers are not zeroed.
struct OpTensor {
  exec::TensorType type;
  float *f32 = nullptr;
  int32_t *i32 = nullptr;
  int64_t *i64 = nullptr;
};

/// Computes the results of `inst` (a graph op) from its operands. Errors
/// name the op when it has no cpu kernel or its attributes are unusable.
using GraphKernel = llvm::Error (*)(const exec::Instruction &inst,
                                    llvm::ArrayRef<OpTensor> operands,
                                    llvm::ArrayRef<OpTensor> results);

/// The kernel of graph op `op`, or null for a schedule op (the backend
/// runs those itself). Every graph op of plan/Ops.def has one.
GraphKernel findGraphKernel(exec::OpCode op);

/// Runs `kernel` on graph op `inst` of `plan` over tensors stored in their
/// planned dtypes at `bytesOf(id)`: floating-point operands widened to
/// fp32 in `wide` (kept by the caller from op to op), results rounded back.
llvm::Error runGraphKernel(GraphKernel kernel, const exec::ExecPlan &plan,
                           const exec::Instruction &inst,
                           llvm::function_ref<uint8_t *(int64_t id)> bytesOf,
                           std::vector<std::vector<float>> &wide);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_GRAPHKERNELS_H
