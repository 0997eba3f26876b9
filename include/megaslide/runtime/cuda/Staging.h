//===- Staging.h - Weight staging off the issuing thread --------*- C++ -*-===//
//
// A fetch casts an fp32 master into pinned staging and copies it to the
// device. The cast runs on a thread of its own, ahead of the thread that
// issues the plan: it works through the step's fetches in program order as
// soon as their bytes have room in a ring of pinned memory, so the issuing
// thread only ever waits for a cast the GPU would have to wait for anyway
// (docs/Runtime.md, "Weight staging").
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_STAGING_H
#define MEGASLIDE_RUNTIME_CUDA_STAGING_H

#include "megaslide/runtime/cpu/WorkerPool.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace megaslide::cuda {

/// Placement in a ring of `capacity` bytes: regions are taken at the head
/// and given back oldest first, as their copies complete.
class StagingRing {
public:
  explicit StagingRing(int64_t capacity = 0) : capacity(capacity) {}
  int64_t size() const { return capacity; }
  /// The offset of `bytes` contiguous bytes for `owner`, or nullopt while
  /// the regions in use leave no such room (release the oldest first).
  /// `bytes` must be in (0, size()].
  std::optional<int64_t> place(int64_t bytes, int64_t owner);
  bool empty() const { return regions.empty(); }
  /// The owner of the oldest region in use.
  int64_t oldest() const { return regions.front().owner; }
  void releaseOldest();
  void clear() { regions.clear(); }

private:
  struct Region {
    int64_t offset, bytes, owner;
  };
  int64_t capacity;
  std::deque<Region> regions; ///< in placement order
};

/// The staging thread. Per step: begin() with the step's fetches in
/// program order; the issuing thread takes each one's bytes with staged(),
/// issues its copy and calls copyIssued(); finish() before the next step.
class WeightStager {
public:
  struct Job {
    const float *source = nullptr;
    int64_t count = 0;
    exec::DType dtype = exec::DType::BF16;
    /// The master is updated earlier in the step: cast only after release().
    bool afterUpdate = false;
    /// Run on the staging thread right before the cast: a deferred update
    /// of the master (StepOptions::beforeFetch).
    std::function<void()> before;
  };
  /// Blocks until the copy of job `k` has completed; an error message, or
  /// empty on success.
  using WaitForCopy = std::function<std::string(int64_t k)>;

  /// Starts the thread, which runs `init` first; `ring` holds `capacity`
  /// bytes, each job's bytes placed at 4 KiB alignment.
  void start(std::function<void()> init, uint8_t *ring, int64_t capacity,
             WaitForCopy waitForCopy);
  void begin(std::vector<Job> jobs);
  /// The staged bytes of job `k` once cast; nullptr if the step stopped
  /// (stop(), or an error: see error()) before it was.
  uint8_t *staged(int64_t k);
  /// Job `k`'s copy is issued: its bytes are reused once it completes.
  void copyIssued(int64_t k);
  /// Job `k` (afterUpdate) may be cast: its master's update has run.
  void release(int64_t k);
  /// Casts nothing more this step; wakes every wait.
  void stop();
  /// Waits until the thread has finished or stopped this step's jobs.
  void finish();
  std::string error();
  /// Stops and joins the thread.
  void shutdown();

private:
  void run(std::function<void()> init);
  /// Waits (mu held) for `ready` or a stop; false on a stop.
  bool await(std::unique_lock<std::mutex> &lock,
             const std::function<bool()> &ready);

  /// Its own workers: the host AdamW holds the CPU kernels' pool for
  /// seconds, and a cast left to run alone meanwhile would take ~8x longer
  /// than the replay charges.
  cpu::WorkerPool workers;
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  uint8_t *base = nullptr;
  StagingRing ring;
  WaitForCopy waitForCopy;
  std::vector<Job> jobs;
  std::vector<int64_t> offsets;
  std::vector<bool> released;
  int64_t stagedCount = 0, issuedCount = 0;
  bool active = false, stopped = false, quit = false;
  std::string failure;
};

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_STAGING_H
