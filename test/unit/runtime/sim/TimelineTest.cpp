//===- TimelineTest.cpp - Discrete-event replay of stream schedules -------===//
//
// replay() (runtime/sim/Timeline.cpp) on hand-computed schedules: stream
// order, overlap across streams, dependencies, write-after-read reuse of
// arena bytes (including releases that wait for other readers and partial
// re-releases), the sharing of host memory bandwidth, and the lower bound.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/sim/Timeline.h"

#include "gtest/gtest.h"

#include <string>
#include <vector>

using namespace megaslide::sim;
using megaslide::exec::Stream;

namespace {

constexpr Stream kCompute = Stream::Compute;
constexpr Stream kH2D = Stream::HostToDevice;
constexpr Stream kD2H = Stream::DeviceToHost;
constexpr Stream kHost = Stream::Host;

Task task(Stream stream, double seconds, std::vector<int64_t> deps = {},
          std::vector<ByteRange> writes = {}, std::vector<Release> frees = {}) {
  Task t;
  t.stream = stream;
  t.seconds = seconds;
  t.deps = std::move(deps);
  t.writes = std::move(writes);
  t.frees = std::move(frees);
  return t;
}

double busy(const Timeline &t, Stream s) { return t.busy[static_cast<int>(s)]; }

TEST(Timeline, EmptyScheduleTakesNoTime) {
  Timeline t = replay({});
  EXPECT_TRUE(t.start.empty());
  EXPECT_DOUBLE_EQ(t.makespan, 0);
  EXPECT_DOUBLE_EQ(t.lowerBound(), 0);
}

TEST(Timeline, OneStreamRunsTasksBackToBack) {
  Timeline t =
      replay({task(kCompute, 1), task(kCompute, 2), task(kCompute, 3)});
  EXPECT_EQ(t.start, (std::vector<double>{0, 1, 3}));
  EXPECT_EQ(t.end, (std::vector<double>{1, 3, 6}));
  EXPECT_DOUBLE_EQ(t.makespan, 6);
  EXPECT_DOUBLE_EQ(busy(t, kCompute), 6);
  EXPECT_DOUBLE_EQ(busy(t, kH2D), 0);
  EXPECT_DOUBLE_EQ(t.lowerBound(), 6);
}

TEST(Timeline, IndependentStreamsOverlap) {
  Timeline t = replay({task(kCompute, 2), task(kH2D, 3), task(kD2H, 1),
                       task(kHost, 0.5), task(kCompute, 2)});
  EXPECT_EQ(t.start, (std::vector<double>{0, 0, 0, 0, 2}));
  EXPECT_EQ(t.end, (std::vector<double>{2, 3, 1, 0.5, 4}));
  EXPECT_DOUBLE_EQ(t.makespan, 4);
  EXPECT_DOUBLE_EQ(busy(t, kCompute), 4);
  EXPECT_DOUBLE_EQ(busy(t, kH2D), 3);
  EXPECT_DOUBLE_EQ(busy(t, kD2H), 1);
  EXPECT_DOUBLE_EQ(busy(t, kHost), 0.5);
}

TEST(Timeline, DependencyDelaysTheConsumer) {
  // A 2 s copy in, a compute that reads it, a compute that does not (it
  // still waits for its stream), and a copy out of the first result.
  Timeline t = replay({task(kH2D, 2), task(kCompute, 1, {0}), task(kCompute, 1),
                       task(kD2H, 0.5, {1})});
  EXPECT_EQ(t.start, (std::vector<double>{0, 2, 3, 3}));
  EXPECT_EQ(t.end, (std::vector<double>{2, 3, 4, 3.5}));
  EXPECT_DOUBLE_EQ(t.makespan, 4);
}

TEST(Timeline, LatestDependencyWins) {
  Timeline t = replay({task(kH2D, 1), task(kD2H, 4), task(kHost, 2),
                       task(kCompute, 1, {0, 1, 2})});
  EXPECT_DOUBLE_EQ(t.start[3], 4);
  EXPECT_DOUBLE_EQ(t.end[3], 5);
}

TEST(Timeline, WriteWaitsForTheReleaseOfReusedBytes) {
  // Task 0 copies a buffer into [0, 1024); task 1 (5 s) and task 2 (1 s)
  // read it; task 2 is the last reader in issue order and carries the
  // release, which waits for task 1 too: the bytes are free at 6 s.
  // Task 3 reuses [512, 768) and waits for that; task 4 writes bytes no
  // one released and only waits for its stream.
  ByteRange buffer{0, 1024};
  std::vector<Task> tasks = {
      task(kH2D, 1, {}, {buffer}),
      task(kCompute, 5, {0}),
      task(kD2H, 1, {0}, {}, {Release{buffer, {1}}}),
      task(kH2D, 1, {}, {ByteRange{512, 256}}),
      task(kH2D, 1, {}, {ByteRange{1024, 1024}}),
  };
  Timeline t = replay(tasks);
  EXPECT_EQ(t.start, (std::vector<double>{0, 1, 1, 6, 7}));
  EXPECT_EQ(t.end, (std::vector<double>{1, 6, 2, 7, 8}));
  EXPECT_DOUBLE_EQ(t.makespan, 8);
}

TEST(Timeline, DisjointWritesDoNotWait) {
  ByteRange buffer{0, 1024};
  std::vector<Task> tasks = {
      task(kH2D, 1, {}, {buffer}),
      task(kCompute, 5, {0}, {}, {Release{buffer, {1}}}),
      // Ends exactly where the released bytes start: no overlap.
      task(kH2D, 1, {}, {ByteRange{1024, 512}}),
  };
  Timeline t = replay(tasks);
  EXPECT_DOUBLE_EQ(t.start[2], 1);
  // One byte of overlap is enough to wait.
  tasks[2].writes = {ByteRange{1023, 512}};
  EXPECT_DOUBLE_EQ(replay(tasks).start[2], 6);
}

TEST(Timeline, ReleaseWithoutUsersIsTheCarriersEnd) {
  ByteRange buffer{256, 256};
  Timeline t = replay({task(kCompute, 3, {}, {buffer}, {Release{buffer, {}}}),
                       task(kH2D, 1, {}, {buffer})});
  EXPECT_DOUBLE_EQ(t.start[1], 3);
}

TEST(Timeline, WriteOverSeveralReleasesWaitsForTheLatest) {
  // Two buffers released at 2 s and 5 s; a write spanning both waits for
  // the later one, a write into the first only for the earlier one.
  std::vector<Task> tasks = {
      task(kCompute, 2, {}, {}, {Release{ByteRange{0, 512}, {}}}),
      task(kCompute, 3, {}, {}, {Release{ByteRange{512, 512}, {}}}),
      task(kH2D, 1, {}, {ByteRange{256, 512}}),
      task(kD2H, 1, {}, {ByteRange{0, 256}}),
  };
  Timeline t = replay(tasks);
  EXPECT_DOUBLE_EQ(t.start[2], 5);
  EXPECT_DOUBLE_EQ(t.start[3], 2);
}

TEST(Timeline, PartialReReleaseSplitsTheRange) {
  // [0, 1024) is released at 1 s; later [256, 512) is reused and released
  // again at 10 s. Writes inside the re-released part wait for 10 s, the
  // rest of the original range is still free from 1 s.
  std::vector<Task> tasks = {
      task(kCompute, 1, {}, {}, {Release{ByteRange{0, 1024}, {}}}),
      task(kHost, 10, {}, {}, {Release{ByteRange{256, 256}, {}}}),
      task(kH2D, 1, {}, {ByteRange{300, 8}}),
      task(kD2H, 1, {}, {ByteRange{0, 256}}),
      task(kCompute, 1, {}, {ByteRange{512, 512}}),
  };
  Timeline t = replay(tasks);
  EXPECT_DOUBLE_EQ(t.start[2], 10);
  EXPECT_DOUBLE_EQ(t.start[3], 1);
  EXPECT_DOUBLE_EQ(t.start[4], 1);
}

TEST(Timeline, LowerBoundIsTheBusiestStream) {
  // Dependencies serialise the streams (makespan 7.5), but no schedule
  // can beat the 4 s of transfers in.
  std::vector<Task> tasks = {task(kH2D, 2),      task(kCompute, 1, {0}),
                             task(kH2D, 2, {1}), task(kCompute, 1.5, {2}),
                             task(kD2H, 1, {3}), task(kHost, 0.25)};
  Timeline t = replay(tasks);
  EXPECT_DOUBLE_EQ(t.makespan, 7.5);
  EXPECT_DOUBLE_EQ(busy(t, kH2D), 4);
  EXPECT_DOUBLE_EQ(busy(t, kCompute), 2.5);
  EXPECT_DOUBLE_EQ(t.lowerBound(), 4);
  EXPECT_LE(t.lowerBound(), t.makespan);
}

Task hostTask(Stream stream, double seconds, double bytes) {
  Task t = task(stream, seconds);
  t.hostBytes = bytes;
  t.hostRate = bytes / seconds;
  return t;
}

// Host traffic shares the host memory bandwidth (100 B/s here): a task
// takes what the tasks issued before it leave.
TEST(Timeline, HostTasksShareTheHostBandwidth) {
  // Alone, or with room for both: no slowdown.
  Timeline alone = replay({hostTask(kHost, 2, 100)}, 100);
  EXPECT_DOUBLE_EQ(alone.end[0], 2);
  Timeline room =
      replay({hostTask(kHost, 2, 100), hostTask(kH2D, 2, 100)}, 100);
  EXPECT_DOUBLE_EQ(room.end[1], 2);
  // An AdamW at 80 B/s over [0, 2) and a fetch wanting 60 B/s for 1 s
  // from 0: the fetch gets 20 B/s until 2, then 60 B/s: 40 B by 2, the
  // other 20 B by 2 + 1/3.
  Timeline shared =
      replay({hostTask(kHost, 2, 160), hostTask(kH2D, 1, 60)}, 100);
  EXPECT_DOUBLE_EQ(shared.end[0], 2);
  EXPECT_NEAR(shared.end[1], 2 + 1.0 / 3, 1e-12);
  EXPECT_NEAR(busy(shared, kH2D), 2 + 1.0 / 3, 1e-12);
  // Never slower than its own time: a fetch bound by the copy keeps it.
  Timeline copyBound = replay({hostTask(kHost, 2, 160), task(kH2D, 3)}, 100);
  EXPECT_DOUBLE_EQ(copyBound.end[1], 3);
  // Without a bandwidth (the default) nothing is shared.
  Timeline unshared = replay({hostTask(kHost, 2, 160), hostTask(kH2D, 1, 60)});
  EXPECT_DOUBLE_EQ(unshared.end[1], 1);
}

// The names of the printed IR and the plan's JSON (plan/Stream.h).
TEST(Timeline, StreamNames) {
  using megaslide::exec::parseStream;
  using megaslide::exec::streamName;
  EXPECT_EQ(std::string(streamName(kCompute)), "compute");
  EXPECT_EQ(std::string(streamName(kH2D)), "h2d");
  EXPECT_EQ(std::string(streamName(kD2H)), "d2h");
  EXPECT_EQ(std::string(streamName(kHost)), "host");
  for (Stream s : {kCompute, kH2D, kD2H, kHost})
    EXPECT_EQ(parseStream(streamName(s)), s);
  EXPECT_EQ(parseStream("gpu"), std::nullopt);
}

} // namespace
