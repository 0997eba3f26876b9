//===- Timeline.cpp - Discrete-event replay of a stream schedule ----------===//

#include "megaslide/runtime/sim/Timeline.h"

#include <algorithm>
#include <iterator>
#include <map>

using namespace megaslide::sim;

double Timeline::lowerBound() const {
  return *std::max_element(std::begin(busy), std::end(busy));
}

namespace {

/// For every arena byte, the time after which it may be overwritten.
/// Disjoint segments keyed by start offset.
class ReleaseTimes {
public:
  double earliestWrite(ByteRange r) const {
    double t = 0;
    auto it = segments.upper_bound(r.offset);
    if (it != segments.begin())
      --it;
    for (; it != segments.end() && it->first < r.offset + r.size; ++it)
      if (it->first + it->second.size > r.offset)
        t = std::max(t, it->second.time);
    return t;
  }

  void release(ByteRange r, double time) {
    split(r.offset);
    split(r.offset + r.size);
    auto first = segments.lower_bound(r.offset);
    auto last = segments.lower_bound(r.offset + r.size);
    segments.erase(first, last);
    segments[r.offset] = {r.size, time};
  }

private:
  struct Segment {
    int64_t size;
    double time;
  };
  /// Makes `at` a segment boundary.
  void split(int64_t at) {
    auto it = segments.upper_bound(at);
    if (it == segments.begin())
      return;
    --it;
    int64_t begin = it->first, end = begin + it->second.size;
    if (at <= begin || at >= end)
      return;
    segments[at] = {end - at, it->second.time};
    it->second.size = at - begin;
  }
  std::map<int64_t, Segment> segments;
};

} // namespace

Timeline megaslide::sim::replay(const std::vector<Task> &tasks) {
  Timeline t;
  t.start.resize(tasks.size());
  t.end.resize(tasks.size());
  double streamFree[exec::kNumStreams] = {};
  ReleaseTimes released;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task &task = tasks[i];
    int s = static_cast<int>(task.stream);
    double start = streamFree[s];
    for (int64_t dep : task.deps)
      start = std::max(start, t.end[dep]);
    for (ByteRange r : task.writes)
      start = std::max(start, released.earliestWrite(r));
    t.start[i] = start;
    t.end[i] = start + task.seconds;
    streamFree[s] = t.end[i];
    t.busy[s] += task.seconds;
    t.makespan = std::max(t.makespan, t.end[i]);
    for (const Release &r : task.frees) {
      double time = t.end[i];
      for (int64_t user : r.users)
        time = std::max(time, t.end[user]);
      released.release(r.range, time);
    }
  }
  return t;
}
