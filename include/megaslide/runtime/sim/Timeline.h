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
#include <limits>
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
  /// Tasks the issuing thread waits for before it issues this one: neither
  /// this task nor any later one starts before they end (the cuda
  /// backend's issue loop blocking on its host worker).
  std::vector<int64_t> issueAfter;
  std::vector<ByteRange> writes; ///< arena bytes this task's results occupy
  std::vector<Release> frees;    ///< buffers whose last reader this is
  /// Host memory bytes the task moves (a fetch's staging cast, the host
  /// AdamW), at most at `hostRate` B/s: the rate that makes them last
  /// `seconds` when the task has the host to itself. 0: no host traffic.
  double hostBytes = 0;
  double hostRate = 0;
  /// A read or write of the NVMe tier: it runs on the replay's I/O lane,
  /// one transfer at a time in issue order, not on `stream`.
  bool io = false;
};

struct Timeline {
  std::vector<double> start, end; ///< per task, seconds
  /// Summed task time (end - start) per stream, host sharing included.
  double busy[exec::kNumStreams] = {};
  double ioBusy = 0; ///< summed time of the I/O lane's tasks (Task::io)
  double makespan = 0;
  /// max over streams (and the I/O lane) of busy time: no schedule can be
  /// faster.
  double lowerBound() const;
};

/// What the issuing thread's waits (Task::issueAfter: e.g. a gradient copy
/// into a ring slot whose last gradient a host AdamW still reads) cost:
/// the tasks that wait, and the step time they add, the replay with them
/// against the replay without (sim::issueWaits).
struct IssueWaits {
  int64_t instructions = 0;
  double seconds = 0;
};

/// Replays tasks in issue order: each starts when its stream is free, its
/// dependencies have ended, the arena bytes it writes are no longer used
/// by earlier buffers (write-after-read reuse of the static plan), and the
/// issueAfter tasks of it and of every earlier task have ended.
/// Tasks with host traffic share `hostBandwidth` B/s: in issue order each
/// takes, over time, what the earlier ones leave, up to its own hostRate,
/// and ends no earlier than `seconds` after its start and no earlier than
/// its host bytes are through (docs/CostModel.md, "The replay").
Timeline replay(const std::vector<Task> &tasks,
                double hostBandwidth = std::numeric_limits<double>::infinity());

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_TIMELINE_H
