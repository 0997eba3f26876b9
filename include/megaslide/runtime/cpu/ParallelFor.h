//===- ParallelFor.h - Threads and loops of the CPU kernels -----*- C++ -*-===//
//
// The work distribution and the inner loops that the CPU kernels (3D-DSA,
// AdamW, the cpu backend's dense and video ops) share: parallelFor hands
// out items dynamically, parallelChunks and parallelRanges split a range
// statically. Results never depend on the thread count: an item runs entirely
// on one thread, and sums keep a fixed association.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_PARALLELFOR_H
#define MEGASLIDE_RUNTIME_CPU_PARALLELFOR_H

#include "megaslide/runtime/cpu/WorkerPool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace megaslide::cpu {

/// Runs items [0, count) on up to cpuThreads() workers. Each worker
/// calls makeWorker() once, so per-thread scratch lives in the returned
/// callable rather than being reallocated per item; items are handed out
/// dynamically because border tiles and clamped windows make them uneven.
template <typename MakeWorker>
void parallelFor(int64_t count, MakeWorker makeWorker) {
  if (count <= 0)
    return;
  int64_t numThreads = std::min<int64_t>(cpuThreads(), count);
  std::atomic<int64_t> next{0};
  runOnWorkers(numThreads, [&](int64_t) {
    auto worker = makeWorker();
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1))
      worker(i);
  });
}

/// Runs fn(begin, end) over [0, count) split into at most `parts`
/// contiguous chunks, one per worker, whose boundaries are multiples of
/// `align` items (the last chunk may be shorter). Callers make each item's
/// result independent of the chunk it lands in.
template <typename Fn>
void parallelChunks(int64_t count, int64_t parts, int64_t align, Fn fn) {
  if (count <= 0)
    return;
  int64_t chunk = (count + parts - 1) / parts;
  chunk = (chunk + align - 1) / align * align;
  runOnWorkers((count + chunk - 1) / chunk, [&](int64_t worker) {
    fn(worker * chunk, std::min(count, (worker + 1) * chunk));
  });
}

/// Runs fn(begin, end) over a static partition of [0, count) into at most
/// cpuThreads() contiguous chunks of at least `grain` items, so small
/// loops stay on the calling thread. Callers make each item's result
/// independent of the chunk it lands in, so the partition (and hence the
/// thread count) never changes the output.
template <typename Fn>
void parallelRanges(int64_t count, int64_t grain, Fn fn) {
  if (count <= 0)
    return;
  int64_t numThreads = std::min<int64_t>(
      cpuThreads(),
      std::max<int64_t>(1, count / std::max<int64_t>(grain, 1)));
  parallelChunks(count, numThreads, 1, fn);
}

/// Dot product with eight independent partial sums: the lanes vectorise
/// without -ffast-math (no single sum is reassociated) and the result does
/// not depend on the thread count.
inline float dot(const float *a, const float *b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l)
      lanes[l] += a[d + l] * b[d + l];
  float tail = 0;
  for (; d < n; ++d)
    tail += a[d] * b[d];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
}

/// y += a * x.
inline void axpy(float *y, float a, const float *x, int64_t n) {
  for (int64_t d = 0; d < n; ++d)
    y[d] += a * x[d];
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_PARALLELFOR_H
