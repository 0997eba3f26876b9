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

#include <csignal>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace megaslide::cpu {

/// Persistent threads that run one job at a time: run(n, call, context)
/// calls call(context, w) for w in [0, n), w = 0 on the calling thread,
/// and returns when all have returned; the pool grows to the largest n
/// asked for. A call made while a job runs (from inside it, or from
/// another thread) runs its workers one after another on the calling
/// thread. The CPU kernels share one process-wide pool (runOnWorkers); a
/// thread that must not fall back to running alone while they hold it (the
/// cuda backend's weight staging) owns one.
class WorkerPool {
public:
  WorkerPool();
  /// Joins the threads (none may be in a job).
  ~WorkerPool();
  WorkerPool(const WorkerPool &) = delete;
  WorkerPool &operator=(const WorkerPool &) = delete;

  void run(int64_t numWorkers, void (*call)(void *, int64_t), void *context);
  template <typename Fn> void run(int64_t numWorkers, Fn &&fn) {
    using F = std::remove_reference_t<Fn>;
    run(
        numWorkers,
        [](void *context, int64_t worker) {
          (*static_cast<F *>(context))(worker);
        },
        const_cast<void *>(static_cast<const void *>(&fn)));
  }

private:
  struct State;
  std::unique_ptr<State> state;
};

/// The process-wide count of threads the CPU kernels split their work
/// over: MEGASLIDE_NUM_THREADS if set to a positive integer (at most 1024),
/// else std::thread::hardware_concurrency() (at least 1, counted once). The
/// variable is read at each call, so a test may change it between kernels. An
/// invalid value is passed over here; entry points report it
/// (cpuThreadsSettingError).
int cpuThreads();

/// Null when MEGASLIDE_NUM_THREADS is unset or valid; otherwise a message
/// naming the variable, its value and what it takes. The entry points check
/// it through cpuSettingsError (cpu/Isa.h).
const char *cpuThreadsSettingError();

/// Holds back asynchronous signals (all but the faults SIGSEGV, SIGBUS,
/// SIGFPE, SIGILL and SIGTRAP) on this thread while it lives; nested holds
/// cost nothing. oneDNN's AVX-512 sgemm kernels point the stack pointer
/// into a heap buffer of their own while they run, so a signal handler run
/// on that thread then (megaslide-run's SIGINT/SIGTERM, Python's SIGINT, a
/// profiler's) has its frame written into the heap: "corrupted size vs.
/// prev_size", SIGSEGV or SIGFPE in about one run in a hundred stopped by a
/// signal. Held back, a signal goes to a thread outside the kernels or
/// waits until the hold ends. Pool workers hold them for good; a caller
/// holds them for the job it runs its share of, and gemmSerial for a call.
class AsyncSignalsHeld {
public:
  AsyncSignalsHeld();
  ~AsyncSignalsHeld();
  AsyncSignalsHeld(const AsyncSignalsHeld &) = delete;
  AsyncSignalsHeld &operator=(const AsyncSignalsHeld &) = delete;

private:
  bool outermost;
  sigset_t saved;
};

/// The CPU kernels' pool, one per process (a forked child gets its own).
WorkerPool &processPool();

/// WorkerPool::run on processPool().
template <typename Fn> void runOnWorkers(int64_t numWorkers, Fn &&fn) {
  processPool().run(numWorkers, std::forward<Fn>(fn));
}

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_WORKERPOOL_H
