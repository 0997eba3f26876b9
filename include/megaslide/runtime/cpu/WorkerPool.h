//===- WorkerPool.h - Persistent threads of the CPU kernels -----*- C++ -*-===//
//
// The CPU kernels (3D-DSA, AdamW, the cpu backend's dense and video ops)
// split their work over cpuThreads() workers. Starting std::threads
// per call cost more than the start itself: a memory-bound 50 ms AdamW step
// took 55 ms (median) against 50 ms on persistent workers, and trailed
// torch's persistent OpenMP threads (docs/Benchmarks.md, "Host AdamW"); a
// new thread most likely shares its parent's core until the scheduler
// moves it. The workers therefore live for the whole process, parked on a
// condition variable between calls.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_WORKERPOOL_H
#define MEGASLIDE_RUNTIME_CPU_WORKERPOOL_H

#include <cstdint>
#include <type_traits>

namespace megaslide::cpu {

/// The process-wide count of threads the CPU kernels split their work
/// over: MEGASLIDE_NUM_THREADS if set to a positive integer (at most 1024),
/// else std::thread::hardware_concurrency() (at least 1). Read at each call,
/// so a test may change the variable between kernels.
int cpuThreads();

namespace detail {
void runOnWorkers(int64_t numWorkers, void (*call)(void *, int64_t),
                  void *context);
} // namespace detail

/// Calls fn(w) for every w in [0, numWorkers) and returns when all calls
/// have returned: w = 0 on the calling thread, the others on threads of a
/// process-wide pool, which grows to the largest count asked for. A call
/// made while the pool is busy (from inside fn, or from another thread)
/// runs its workers one after another on the calling thread, so fn must
/// not make one worker wait for another.
template <typename Fn> void runOnWorkers(int64_t numWorkers, Fn &&fn) {
  using F = std::remove_reference_t<Fn>;
  detail::runOnWorkers(
      numWorkers,
      [](void *context, int64_t worker) {
        (*static_cast<F *>(context))(worker);
      },
      const_cast<void *>(static_cast<const void *>(&fn)));
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_WORKERPOOL_H
