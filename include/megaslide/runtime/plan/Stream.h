//===- Stream.h - The five queues of a training step ------------*- C++ -*-===//
//
// The one definition of a step's streams, shared by the compiler and the
// runtime: the schedule dialect stores it as an i32 (`msched.stream`, the
// stream of `msched.record` and `msched.wait`;
// dialects/Schedule/ScheduleDialect.td), the execution plan names it in
// each instruction, and the replay (include/megaslide/runtime/sim/Timeline.h)
// and the backends run one queue per stream. Header only and free of MLIR and
// LLVM, so the dialect includes it without linking the runtime.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_STREAM_H
#define MEGASLIDE_RUNTIME_PLAN_STREAM_H

#include <cstdint>
#include <optional>
#include <string_view>

namespace megaslide::exec {

/// The values are the i32s of `msched.stream`: printed IR and saved
/// modules depend on them.
enum class Stream : uint8_t {
  Compute = 0,
  HostToDevice = 1,
  DeviceToHost = 2,
  Host = 3,
  /// The device collectives of a job of several ranks (all_gather,
  /// reduce_scatter: NCCL); no single-rank plan has any.
  Comm = 4
};
inline constexpr int kNumStreams = static_cast<int>(Stream::Comm) + 1;

/// The streams' names, in the enum's order: in the printed IR, the plan's
/// JSON, traces and reports.
inline constexpr const char *kStreamNames[] = {"compute", "h2d", "d2h", "host",
                                               "comm"};
static_assert(sizeof(kStreamNames) / sizeof(kStreamNames[0]) == kNumStreams,
              "a stream without its name");

/// Whether `value` is the number of a stream.
constexpr bool isStream(int64_t value) {
  return value >= 0 && value < kNumStreams;
}

constexpr const char *streamName(Stream stream) {
  return isStream(static_cast<int64_t>(stream))
             ? kStreamNames[static_cast<int>(stream)]
             : "?";
}

/// The copy streams, compute and the collectives: what the GPU runs.
constexpr bool isGpuStream(Stream s) { return s != Stream::Host; }

/// The stream named `name` (streamName), if any.
constexpr std::optional<Stream> parseStream(std::string_view name) {
  for (int i = 0; i < kNumStreams; ++i)
    if (name == streamName(static_cast<Stream>(i)))
      return static_cast<Stream>(i);
  return std::nullopt;
}

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_STREAM_H
