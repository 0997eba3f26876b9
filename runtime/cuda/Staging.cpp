//===- Staging.cpp - Weight staging off the issuing thread ----------------===//

#include "megaslide/runtime/cuda/Staging.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/support/Packing.h"

#include <algorithm>

using namespace megaslide;
using namespace megaslide::cuda;

std::optional<int64_t> StagingRing::place(int64_t bytes, int64_t owner) {
  auto take = [&](int64_t offset) {
    regions.push_back({offset, bytes, owner});
    return offset;
  };
  if (regions.empty())
    return take(0);
  int64_t tail = regions.front().offset;
  int64_t head = regions.back().offset + regions.back().bytes;
  if (head > tail) {
    // In use: [tail, head). Room after the head, else before the tail.
    if (capacity - head >= bytes)
      return take(head);
    if (tail >= bytes)
      return take(0);
    return std::nullopt;
  }
  // Wrapped, in use: [tail, capacity) and [0, head); room between.
  if (tail - head >= bytes)
    return take(head);
  return std::nullopt;
}

void StagingRing::releaseOldest() { regions.pop_front(); }

void WeightStager::start(std::function<void()> init, uint8_t *ringBase,
                         int64_t capacity, WaitForCopy wait) {
  base = ringBase;
  ring = StagingRing(capacity);
  waitForCopy = std::move(wait);
  thread = std::thread([this, init] { run(init); });
}

void WeightStager::begin(std::vector<Job> stepJobs) {
  {
    std::lock_guard<std::mutex> lock(mu);
    jobs = std::move(stepJobs);
    offsets.assign(jobs.size(), -1);
    released.assign(jobs.size(), false);
    stagedCount = issuedCount = 0;
    stopped = false;
    failure.clear();
    ring.clear(); // the last step's copies completed before it returned
    active = !jobs.empty();
  }
  cv.notify_all();
}

bool WeightStager::await(std::unique_lock<std::mutex> &lock,
                         const std::function<bool()> &ready) {
  cv.wait(lock, [&] { return stopped || quit || ready(); });
  return !stopped && !quit;
}

void WeightStager::run(std::function<void()> init) {
  init();
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return quit || active; });
    if (quit)
      return;
    for (int64_t k = 0; k < static_cast<int64_t>(jobs.size()); ++k) {
      const Job &job = jobs[k];
      int64_t bytes = alignTo(
          std::max<int64_t>(job.count * exec::dtypeBytes(job.dtype), 1), 4096);
      if (job.afterUpdate && !await(lock, [&] { return released[k]; }))
        break;
      std::optional<int64_t> offset;
      bool ok = true;
      while (ok && !(offset = ring.place(bytes, k))) {
        // The oldest region is free once its copy, issued, has completed.
        int64_t oldest = ring.oldest();
        if (!(ok = await(lock, [&] { return issuedCount > oldest; })))
          break;
        lock.unlock();
        std::string why = waitForCopy(oldest);
        lock.lock();
        if (!why.empty()) {
          failure = why;
          stopped = true;
          ok = false;
          break;
        }
        ring.releaseOldest();
      }
      if (!ok)
        break;
      lock.unlock();
      if (job.before)
        job.before();
      cpu::narrowOnWorkers(workers, job.source, job.dtype, job.count,
                           base + *offset);
      lock.lock();
      offsets[k] = *offset;
      stagedCount = k + 1;
      cv.notify_all();
      if (stopped || quit)
        break;
    }
    active = false;
    cv.notify_all();
  }
}

uint8_t *WeightStager::staged(int64_t k) {
  std::unique_lock<std::mutex> lock(mu);
  // Bytes staged before a stop are still whole.
  await(lock, [&] { return stagedCount > k; });
  return stagedCount > k ? base + offsets[k] : nullptr;
}

void WeightStager::copyIssued(int64_t k) {
  {
    std::lock_guard<std::mutex> lock(mu);
    issuedCount = std::max(issuedCount, k + 1);
  }
  cv.notify_all();
}

void WeightStager::release(int64_t k) {
  {
    std::lock_guard<std::mutex> lock(mu);
    released[k] = true;
  }
  cv.notify_all();
}

void WeightStager::stop() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopped = true;
  }
  cv.notify_all();
}

void WeightStager::finish() {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return !active; });
}

std::string WeightStager::error() {
  std::lock_guard<std::mutex> lock(mu);
  return failure;
}

void WeightStager::shutdown() {
  if (!thread.joinable())
    return;
  {
    std::lock_guard<std::mutex> lock(mu);
    quit = true;
  }
  cv.notify_all();
  thread.join();
}
