//===- Liveness.h - When the values of a step hold their bytes --*- C++ -*-===//
//
// The liveness rule of MegaSlide: a value holds its bytes from the step
// that defines it to its last reader, inclusive; a reader of a view reads
// the value it views; a workspace is live during its step only. The
// planner applies it to the IR (collectDeviceBuffers in
// lib/Analysis/DeviceBuffers), the runtime to a plan (computeLiveness:
// the cpu backend frees by it, the pinned pool is laid out by it, validate
// checks the arena against it); both count live bytes with liveBytesAt,
// and CompileExecPlanTest checks that they agree on every preset.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_LIVENESS_H
#define MEGASLIDE_RUNTIME_PLAN_LIVENESS_H

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/support/Packing.h"

#include "llvm/ADT/ArrayRef.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace megaslide::exec {

/// When each value is needed, in instruction indices: a value is live from
/// the instruction defining it (inputs: from 0) to its last reader,
/// inclusive; a view keeps the value it views live; an output is live to
/// the last instruction.
struct Liveness {
  std::vector<int64_t> def, lastUse; ///< per value; -1 when never used
  /// Device values that own arena bytes (not views), with their intervals.
  std::vector<int64_t> deviceBuffers;
  /// Bytes live at each instruction: device buffers plus workspace.
  std::vector<int64_t> liveBytes;
  int64_t peakLiveBytes = 0;

  /// The last instruction at which value `id` (defined) holds its bytes:
  /// its last reader, or its definition when nothing reads it.
  int64_t end(int64_t id) const { return std::max(def[id], lastUse[id]); }
};
Liveness computeLiveness(const ExecPlan &plan);

/// The value whose arena bytes `id` occupies: itself, or the value a view
/// (or a chain of views) reuses.
int64_t bufferOf(const ExecPlan &plan, int64_t id);

/// Bytes live at each of `numSteps` steps: each slice counts from its start
/// to its end, inclusive (both in [0, numSteps)).
std::vector<int64_t> liveBytesAt(llvm::ArrayRef<Slice> slices,
                                 int64_t numSteps);

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_LIVENESS_H
