//===- Timeline.h - Discrete-event replay of a stream schedule --*- C++ -*-===//
//
// The timing core shared by the planner's step prediction and the sim
// backend. No MLIR: tasks are plain records in issue order.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SIM_TIMELINE_H
#define MEGASLIDE_RUNTIME_SIM_TIMELINE_H

#include "megaslide/runtime/plan/Stream.h"

#include <cstdint>
#include <vector>

namespace megaslide::sim {

/// Device bytes [offset, offset + size) of the arena.
struct ByteRange {
  int64_t offset;
  int64_t size;
};

/// Arena bytes that become reusable once all `users` (earlier tasks or
/// the task carrying it) have ended.
struct Release {
  ByteRange range;
  std::vector<int64_t> users;
};

struct Task {
  exec::Stream stream;
  double seconds = 0;
  std::vector<int64_t> deps;     ///< tasks whose results this one reads
  std::vector<ByteRange> writes; ///< arena bytes this task's results occupy
  std::vector<Release> frees;    ///< buffers whose last reader this is
};

struct Timeline {
  std::vector<double> start, end; ///< per task, seconds
  double busy[exec::kNumStreams] = {}; ///< summed task time per stream
  double makespan = 0;
  /// max over streams of busy time: no schedule can be faster.
  double lowerBound() const;
};

/// Replays tasks in issue order: each starts when its stream is free, its
/// dependencies have ended, and the arena bytes it writes are no longer
/// used by earlier buffers (write-after-read reuse of the static plan).
Timeline replay(const std::vector<Task> &tasks);

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_TIMELINE_H
