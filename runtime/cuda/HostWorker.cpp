//===- HostWorker.cpp - The cuda backend's host stream --------------------===//

#include "megaslide/runtime/cuda/HostWorker.h"

#include <algorithm>

using namespace megaslide::cuda;

void HostWorker::start(std::function<void()> init) {
  thread = std::thread([this, init] {
    init();
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty())
        return;
      auto [index, task] = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lock.unlock();
      task();
      lock.lock();
      busy = false;
      completed = std::max(completed, index);
      done.notify_all();
    }
  });
}

void HostWorker::enqueue(int64_t index, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu);
    queue.emplace_back(index, std::move(task));
  }
  cv.notify_one();
}

void HostWorker::waitFor(int64_t index) {
  std::unique_lock<std::mutex> lock(mu);
  done.wait(lock, [&] { return completed >= index; });
}

void HostWorker::drain() {
  std::unique_lock<std::mutex> lock(mu);
  done.wait(lock, [&] { return queue.empty() && !busy; });
}

void HostWorker::reset() {
  std::lock_guard<std::mutex> lock(mu);
  completed = -1;
}

void HostWorker::shutdown() {
  if (!thread.joinable())
    return;
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  thread.join();
}
