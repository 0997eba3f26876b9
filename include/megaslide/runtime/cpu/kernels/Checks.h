//===- Checks.h - Argument checks of the cpu graph kernels ------*- C++ -*-===//
//
// Every kernel checks arity, buffers, shapes and attributes before touching
// memory, so a malformed instruction is an llvm::Error naming the op, never a
// crash. The messages follow the graph verifiers (dialects/Graph/GraphOps.cpp)
// after a "megaslide.<op>: " prefix, e.g.
//   megaslide.linear: 'bias' has shape [6] but expected [5]
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_KERNELS_CHECKS_H
#define MEGASLIDE_RUNTIME_CPU_KERNELS_CHECKS_H

#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/support/Shape.h"

#include "llvm/ADT/Twine.h"

#include <cstdint>
#include <optional>
#include <string>

namespace megaslide::cpu {

/// How many operands, results or dimensions an op accepts: exactly n,
/// n to m, or at least n.
struct Count {
  size_t min, max;
  Count(size_t n) : min(n), max(n) {}
  Count(size_t lo, size_t hi) : min(lo), max(hi) {}
  static Count atLeast(size_t n) { return {n, SIZE_MAX}; }

  bool contains(size_t n) const { return n >= min && n <= max; }
  /// "2", "2 to 3" or "at least 1".
  std::string str() const;
};

/// "megaslide.<op>: <message>": a failing step names its culprit first.
llvm::Error opError(const exec::Instruction &inst, const llvm::Twine &message);

/// Operand and result counts: "expects 2 to 3 operands, got 1".
llvm::Error checkArity(const exec::Instruction &inst,
                       llvm::ArrayRef<OpTensor> operands,
                       llvm::ArrayRef<OpTensor> results, Count numOperands,
                       Count numResults);

/// No dimension of `t` is negative (any dtype).
llvm::Error checkExtents(const exec::Instruction &inst, const OpTensor &t,
                         llvm::StringRef name);

/// A float tensor with non-negative extents: safe to read as fp32.
llvm::Error checkFloat(const exec::Instruction &inst, const OpTensor &t,
                       llvm::StringRef name);

/// A float tensor of `rank` dimensions; `layout` names them in the message
/// ("[B, N, D]", "[..., in]").
llvm::Error checkFloatRank(const exec::Instruction &inst, const OpTensor &t,
                           llvm::StringRef name, Count rank,
                           llvm::StringRef layout);

/// `t` has exactly `shape` (any dtype).
llvm::Error checkShape(const exec::Instruction &inst, const OpTensor &t,
                       llvm::StringRef name, llvm::ArrayRef<int64_t> shape);

/// A float tensor of exactly `shape`.
llvm::Error checkFloatShape(const exec::Instruction &inst, const OpTensor &t,
                            llvm::StringRef name,
                            llvm::ArrayRef<int64_t> shape);

/// The finite float attribute `name`; `fallback` is its ODS default, used
/// when the plan writer left a defaulted attribute out.
llvm::Expected<double>
finiteFloatAttr(const exec::Instruction &inst, llvm::StringRef name,
                std::optional<double> fallback = std::nullopt);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_KERNELS_CHECKS_H
