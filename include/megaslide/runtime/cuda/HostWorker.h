//===- HostWorker.h - The cuda backend's host stream ------------*- C++ -*-===//
//
// The plan's host stream (the host AdamW, waits on GPU work) runs on one
// thread of its own, so the issuing thread never blocks on it unless an
// instruction depends on it.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_HOSTWORKER_H
#define MEGASLIDE_RUNTIME_CUDA_HOSTWORKER_H

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace megaslide::cuda {

/// The host stream: tasks run in program order on one thread; the issuing
/// thread can wait until a given instruction has run.
class HostWorker {
public:
  /// Starts the thread, which runs `init` first.
  void start(std::function<void()> init);
  void enqueue(int64_t index, std::function<void()> task);
  /// Until the task of instruction `index` (and all before it) has run.
  void waitFor(int64_t index);
  /// Until every task enqueued has run.
  void drain();
  /// Forgets what has run (a new step).
  void reset();
  /// Runs what is queued, then joins the thread.
  void shutdown();

private:
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv, done;
  std::deque<std::pair<int64_t, std::function<void()>>> queue;
  int64_t completed = -1;
  bool busy = false, stop = false;
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_HOSTWORKER_H
