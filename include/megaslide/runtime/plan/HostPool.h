//===- HostPool.h - Pinned host values and cross-stream waits ---*- C++ -*-===//
//
// Where a plan's host values (device-to-host results) live in pinned
// memory, and the waits that reuse of device and pinned bytes across
// streams implies. One home for both: the cuda backend issues exactly
// these waits, and the sim replay (and so the planner's step time) prices
// them (docs/Runtime.md, "Pinned host values"; docs/CostModel.md).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_HOSTPOOL_H
#define MEGASLIDE_RUNTIME_PLAN_HOSTPOOL_H

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/Liveness.h"

#include <cstdint>
#include <vector>

namespace megaslide::exec {

/// Every pinned buffer starts on this boundary (the plans' alignment).
inline constexpr int64_t kHostPoolAlign = 256;
/// Host values get bytes of their own while all of them fit this; beyond,
/// gradients cycle through the ring and the rest share bytes by liveness.
inline constexpr int64_t kHostPoolNoReuseBytes = int64_t(8) << 30;

struct HostPoolLayout {
  /// Per value: the offset of a host value in the pool, else -1.
  std::vector<int64_t> offset;
  int64_t bytes = 0;
  /// Whether host values share bytes (the pool exceeds the no-reuse
  /// bytes); then the gradients take `ringSlots` slots of `ringSlotBytes`
  /// at the start of the pool, the others are packed by liveness after.
  bool shared = false;
  int64_t ringSlots = 0, ringSlotBytes = 0;
};

/// The bytes a fetch or device_to_host copy `inst` moves: its result's, or
/// for one marked `ranks` (a job's) the largest rank's shard, rank 0's
/// (dist::shardRange): what each rank stages in pinned memory for it.
int64_t copiedBytes(const ExecPlan &plan, const Instruction &inst);

/// Per value of `plan`: the pinned bytes of a host value (0 for others):
/// its tensor's, or a device_to_host result's copiedBytes, since a rank's
/// copy of its shard writes it from the value's start.
std::vector<int64_t> hostValueBytes(const ExecPlan &plan);

/// Lays out `plan`'s host values (hostValueBytes). A gradient is a
/// device-to-host result read by a host_adamw; consecutive gradients of one
/// layer (in program order) form a group, and group g takes ring slot g mod
/// plan.gradientBuffers, each slot as large as the largest group: the
/// copy of group g's gradients waits only for the host updates of group
/// g - gradientBuffers, so the GPU may run that many groups ahead of the
/// host optimizer. The planner's "gradient staging" is the same bytes.
HostPoolLayout layoutHostPool(const ExecPlan &plan, const Liveness &live,
                              int64_t noReuseBytes = kHostPoolNoReuseBytes);

/// The arena offset of a device value, through the views it is of; -1
/// when it has none.
int64_t deviceOffset(const ExecPlan &plan, int64_t id);

/// An earlier instruction that must have completed first.
struct Dependency {
  Stream stream;
  int64_t instruction;
};

/// Per instruction, the write-after-read/write waits on other streams that
/// reuse of arena bytes and of the pool's bytes (`hostOffset` per value,
/// `hostBytes` in all, each value's hostValueBytes) implies in program order;
/// filtered: none implied by an earlier wait of the same stream or by the
/// plan's own waits. The plan's events order producers before consumers; these
/// are not in it.
std::vector<std::vector<Dependency>>
crossStreamWaits(const ExecPlan &plan, const std::vector<int64_t> &hostOffset,
                 int64_t hostBytes);

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_HOSTPOOL_H
