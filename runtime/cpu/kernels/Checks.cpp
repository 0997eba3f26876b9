//===- Checks.cpp - Argument checks of the cpu graph kernels --------------===//

#include "megaslide/runtime/cpu/kernels/Checks.h"

#include <cmath>

using namespace megaslide;
using namespace megaslide::cpu;

using llvm::Error;
using llvm::StringRef;
using llvm::Twine;

std::string Count::str() const {
  if (min == max)
    return std::to_string(min);
  if (max == SIZE_MAX)
    return "at least " + std::to_string(min);
  return std::to_string(min) + " to " + std::to_string(max);
}

Error cpu::opError(const exec::Instruction &inst, const Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 llvm::Twine("megaslide.") + opName(inst.op) +
                                     ": " + message);
}

Error cpu::checkArity(const exec::Instruction &inst,
                      llvm::ArrayRef<OpTensor> operands,
                      llvm::ArrayRef<OpTensor> results, Count numOperands,
                      Count numResults) {
  auto check = [&](size_t got, Count expected, StringRef noun) -> Error {
    if (expected.contains(got))
      return Error::success();
    bool one =
        expected.min == 1 && (expected.max == 1 || expected.max == SIZE_MAX);
    return opError(inst, "expects " + expected.str() + " " + noun +
                             (one ? "" : "s") + ", got " + Twine(got));
  };
  if (Error e = check(operands.size(), numOperands, "operand"))
    return e;
  return check(results.size(), numResults, "result");
}

Error cpu::checkExtents(const exec::Instruction &inst, const OpTensor &t,
                        StringRef name) {
  for (int64_t d : t.type.shape)
    if (d < 0)
      return opError(inst, "'" + name + "' has a negative dimension in " +
                               shapeString(t.type.shape));
  return Error::success();
}

/// Whether `t` arrived as fp32. An empty tensor may come without a buffer.
static bool isFloat(const OpTensor &t) {
  return t.f32 ||
         (t.type.numElements() == 0 && (t.type.dtype == exec::DType::F32 ||
                                        t.type.dtype == exec::DType::BF16 ||
                                        t.type.dtype == exec::DType::F16));
}

Error cpu::checkFloat(const exec::Instruction &inst, const OpTensor &t,
                      StringRef name) {
  if (Error e = checkExtents(inst, t, name))
    return e;
  if (!isFloat(t))
    return opError(inst, "'" + name + "' must be a float tensor");
  return Error::success();
}

Error cpu::checkFloatRank(const exec::Instruction &inst, const OpTensor &t,
                          StringRef name, Count rank, StringRef layout) {
  if (Error e = checkFloat(inst, t, name))
    return e;
  if (!rank.contains(t.type.shape.size()))
    return opError(inst, "'" + name + "' must have rank " + rank.str() + " " +
                             layout + ", got " + shapeString(t.type.shape));
  return Error::success();
}

Error cpu::checkShape(const exec::Instruction &inst, const OpTensor &t,
                      StringRef name, llvm::ArrayRef<int64_t> shape) {
  if (llvm::ArrayRef<int64_t>(t.type.shape) == shape)
    return Error::success();
  return opError(inst, "'" + name + "' has shape " + shapeString(t.type.shape) +
                           " but expected " + shapeString(shape));
}

Error cpu::checkFloatShape(const exec::Instruction &inst, const OpTensor &t,
                           StringRef name, llvm::ArrayRef<int64_t> shape) {
  if (Error e = checkFloat(inst, t, name))
    return e;
  return checkShape(inst, t, name, shape);
}

llvm::Expected<double> cpu::finiteFloatAttr(const exec::Instruction &inst,
                                            StringRef name,
                                            std::optional<double> fallback) {
  if (!inst.attr(name)) {
    if (fallback)
      return *fallback;
    return opError(inst, "missing float attribute '" + name + "'");
  }
  std::optional<double> v = inst.floatAttr(name);
  if (!v || !std::isfinite(*v))
    return opError(inst, "attribute '" + name + "' must be a finite number");
  return *v;
}
