//===- Timeline.cpp - Discrete-event replay of a stream schedule ----------===//

#include "megaslide/runtime/sim/Timeline.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>

using namespace megaslide::sim;

double Timeline::lowerBound() const {
  return std::max(ioBusy, *std::max_element(std::begin(busy), std::end(busy)));
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

/// The host memory bandwidth in use over time by the tasks replayed so
/// far: a step function, the rate from each breakpoint to the next (0
/// before the first and after the last).
class HostUsage {
public:
  explicit HostUsage(double bandwidth) : bandwidth(bandwidth) {}

  /// Streams `bytes` from `start` at up to `rate` B/s through what the
  /// earlier tasks leave, records the use and returns the end time.
  double take(double start, double bytes, double rate) {
    if (bytes <= 0 || rate <= 0)
      return start;
    // What is left below this counts as nothing: rounding in the sums of
    // rates must not leave a task crawling at 1e-12 of its rate.
    const double tiny = 1e-9 * bandwidth;
    breakpoint(start);
    auto it = usage.find(start);
    double t = start, left = bytes;
    while (true) {
      auto next = std::next(it);
      double free = bandwidth - it->second;
      double r = free > tiny ? std::min(rate, free) : 0;
      double until = next == usage.end()
                         ? std::numeric_limits<double>::infinity()
                         : next->first;
      if (r > 0 && t + left / r <= until) {
        double end = t + left / r;
        breakpoint(end);
        // `it` survives the insertion: std::map iterators stay valid.
        it->second += r;
        return end;
      }
      if (r > 0) {
        left -= r * (until - t);
        it->second += r;
      }
      t = until;
      it = next;
    }
  }

private:
  /// Makes `at` a breakpoint, with the rate in effect there.
  void breakpoint(double at) {
    auto it = usage.upper_bound(at);
    double rate = it == usage.begin() ? 0 : std::prev(it)->second;
    usage.emplace(at, rate);
  }
  double bandwidth;
  std::map<double, double> usage;
};

} // namespace

Timeline megaslide::sim::replay(const std::vector<Task> &tasks,
                                double hostBandwidth) {
  Timeline t;
  t.start.resize(tasks.size());
  t.end.resize(tasks.size());
  double streamFree[exec::kNumStreams] = {};
  double ioFree = 0;
  ReleaseTimes released;
  HostUsage host(hostBandwidth);
  bool shareHost = std::isfinite(hostBandwidth);
  double issued = 0; // nothing starts before the issuing thread gets to it
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task &task = tasks[i];
    int s = static_cast<int>(task.stream);
    for (int64_t blocker : task.issueAfter)
      issued = std::max(issued, t.end[blocker]);
    double start = std::max(task.io ? ioFree : streamFree[s], issued);
    for (int64_t dep : task.deps)
      start = std::max(start, t.end[dep]);
    for (ByteRange r : task.writes)
      start = std::max(start, released.earliestWrite(r));
    t.start[i] = start;
    t.end[i] = start + task.seconds;
    double seconds = task.seconds;
    if (shareHost && task.hostBytes > 0) {
      double through = host.take(start, task.hostBytes, task.hostRate);
      // Rounding of bytes / (bytes / seconds) is not a slowdown.
      if (through - t.end[i] > 1e-9 * task.seconds) {
        t.end[i] = through;
        seconds = through - start;
      }
    }
    if (task.io) {
      ioFree = t.end[i];
      t.ioBusy += seconds;
    } else {
      streamFree[s] = t.end[i];
      t.busy[s] += seconds;
    }
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
