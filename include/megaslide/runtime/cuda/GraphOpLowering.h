//===- GraphOpLowering.h - Graph ops as CUDA kernels and GEMMs --*- C++ -*-===//
//
// lowerGraphOp turns one instruction into the generated kernels of
// ElementwiseKernels.h plus cuBLASLt GEMMs, memsets and copies over abstract
// buffers (operands, results, scratch). The backend binds them to device
// pointers; the tests run the same lowering on the host against an
// emulation of the kernels. Reductions are deterministic: fixed partial
// sums, no atomics.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_GRAPHOPLOWERING_H
#define MEGASLIDE_RUNTIME_CUDA_GRAPHOPLOWERING_H

#include "megaslide/runtime/cuda/ElementwiseKernels.h"

#include <variant>

namespace megaslide::cuda {

/// A buffer a lowered op touches: an operand or result of the instruction
/// (by index), or bytes of the op's scratch (byte offset, 256-aligned).
struct BufferRef {
  enum Kind : uint8_t { Operand, Result, Scratch } kind = Operand;
  int64_t index = 0;
  /// Bytes past the buffer's start: a launch over a slice of it (an op
  /// split into launches of at most kMaxKernelElements elements).
  int64_t offset = 0;

  static BufferRef operand(int64_t i) { return {Operand, i}; }
  static BufferRef result(int64_t i) { return {Result, i}; }
  static BufferRef scratch(int64_t offset) { return {Scratch, offset}; }
  BufferRef plus(int64_t bytes) const {
    return {kind, index, offset + bytes};
  }
};

/// A kernel argument: a buffer's address, a null pointer, a `long long`,
/// a `float` or a `double`.
struct KernelArg {
  enum Kind : uint8_t { Buffer, Null, I64, F32, F64 } kind = I64;
  BufferRef buffer;
  int64_t i = 0;
  double f = 0;

  static KernelArg buf(BufferRef b) { return {Buffer, b, 0, 0}; }
  static KernelArg null() { return {Null, {}, 0, 0}; }
  static KernelArg i64(int64_t v) { return {I64, {}, v, 0}; }
  static KernelArg f32(double v) { return {F32, {}, 0, v}; }
  static KernelArg f64(double v) { return {F64, {}, 0, v}; }
};

/// One launch of a generated kernel: grid x/y/z, kernelBlockThreads(name)
/// threads (kElementwiseBlockThreads but for attention on tensor cores), no
/// dynamic shared memory.
struct KernelLaunch {
  KernelInstance kernel;
  std::array<uint32_t, 3> grid{1, 1, 1};
  std::vector<KernelArg> args;
};

/// D = op(A) op(B) (+ bias per row of D) in cuBLASLt's column-major terms,
/// alpha 1, beta 0, fp32 accumulation: op(A) m x k, op(B) k x n, D m x n
/// with leading dimension ldd. A and B share a type; D is that type or f32;
/// the bias, when present, has D's type and m elements.
struct GemmCall {
  bool transA = false, transB = false;
  int64_t m = 0, n = 0, k = 0;
  BufferRef a, b, d;
  int64_t lda = 0, ldb = 0, ldd = 0;
  exec::DType abType = exec::DType::BF16, dType = exec::DType::BF16;
  bool hasBias = false;
  BufferRef bias;
};

/// Zero `bytes` bytes.
struct MemsetCall {
  BufferRef dst;
  int64_t bytes = 0;
};

/// Copy `bytes` bytes (a no-op when source and destination coincide).
struct CopyCall {
  BufferRef src, dst;
  int64_t bytes = 0;
};

using LoweredStep = std::variant<KernelLaunch, GemmCall, MemsetCall, CopyCall>;

/// The work of one graph op, in order on one stream.
struct LoweredOp {
  std::vector<LoweredStep> steps;
  int64_t scratchBytes = 0; ///< device scratch the steps need
};

/// True for the ops lowerGraphOp handles: every graph op of plan/Ops.def
/// but the 3D-DSA ones, which run the plan's generated modules.
bool hasGraphOpLowering(exec::OpCode op);

/// Lowers graph op `inst` with the given operand and result types. Errors
/// name the op and what is unsupported (shapes, head dims over 256, ...).
llvm::Expected<LoweredOp>
lowerGraphOp(const exec::Instruction &inst,
             llvm::ArrayRef<exec::TensorType> operands,
             llvm::ArrayRef<exec::TensorType> results);

/// Every kernel instance the lowered op launches.
std::vector<KernelInstance> kernelsOf(const LoweredOp &op);

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_GRAPHOPLOWERING_H
