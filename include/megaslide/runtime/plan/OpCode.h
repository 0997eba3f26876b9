//===- OpCode.h - The op of an execution-plan instruction -------*- C++ -*-===//
//
// The ops of plan/Ops.def as an enum: a plan names its ops in the file
// (docs/ExecutionPlan.md), the loader decodes each name once, and the
// backends, the validator and the cost model switch or index on the code.
// Header-only, so the planner (lib/Analysis/CostModel.cpp) and the sim core
// use it without linking the runtime.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_OPCODE_H
#define MEGASLIDE_RUNTIME_PLAN_OPCODE_H

#include "llvm/ADT/StringRef.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace megaslide::exec {

enum class OpCode : uint8_t {
#define MEGASLIDE_OP(Name, Spelling, Cost, Family) Name,
#include "megaslide/runtime/plan/Ops.def"
};

inline constexpr size_t kNumOpCodes = 0
#define MEGASLIDE_OP(Name, Spelling, Cost, Family) +1
#include "megaslide/runtime/plan/Ops.def"
    ;

/// Every op, in the order of Ops.def.
inline constexpr std::array<OpCode, kNumOpCodes> kAllOpCodes = {
#define MEGASLIDE_OP(Name, Spelling, Cost, Family) OpCode::Name,
#include "megaslide/runtime/plan/Ops.def"
};

/// The op's name in a plan: its IR name without the dialect prefix
/// ("linear", "dsa3d_grad", "fetch").
inline const char *opName(OpCode op) {
  static constexpr const char *names[] = {
#define MEGASLIDE_OP(Name, Spelling, Cost, Family) Spelling,
#include "megaslide/runtime/plan/Ops.def"
  };
  return names[static_cast<size_t>(op)];
}

/// The op named `name` in a plan, or nullopt for a name this runtime does
/// not know.
inline std::optional<OpCode> parseOpCode(llvm::StringRef name) {
  for (OpCode op : kAllOpCodes)
    if (name == opName(op))
      return op;
  return std::nullopt;
}

/// An `msched` op (run by the backends themselves) rather than a graph op
/// (a kernel).
inline bool isScheduleOp(OpCode op) {
  switch (op) {
#define MEGASLIDE_GRAPH_OP(Name, Spelling, Cost, Family)                       \
  case OpCode::Name:                                                           \
    return false;
#define MEGASLIDE_SCHEDULE_OP(Name, Spelling, Cost, Family)                    \
  case OpCode::Name:                                                           \
    return true;
#include "megaslide/runtime/plan/Ops.def"
  }
  return false;
}

/// A table with one entry per op (kernels, lowerings), indexed by code.
template <typename T> class OpTable {
public:
  T &operator[](OpCode op) { return entries[static_cast<size_t>(op)]; }
  const T &operator[](OpCode op) const {
    return entries[static_cast<size_t>(op)];
  }

private:
  std::array<T, kNumOpCodes> entries{};
};

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_OPCODE_H
