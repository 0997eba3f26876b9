//===- WorkerPool.cpp - Persistent worker threads of the CPU kernels ------===//

#include "megaslide/runtime/cpu/WorkerPool.h"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>

using namespace megaslide::cpu;

namespace {

/// MEGASLIDE_NUM_THREADS as a count in [1, 1024]; 0 when unset or invalid.
int threadsSetting(const char *env) {
  if (!env)
    return 0;
  char *end = nullptr;
  errno = 0;
  long n = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || errno == ERANGE || n < 1 || n > 1024)
    return 0;
  return static_cast<int>(n);
}

} // namespace

int megaslide::cpu::cpuThreads() {
  if (int n = threadsSetting(std::getenv("MEGASLIDE_NUM_THREADS")))
    return n;
  // glibc counts the cores by reading sysfs at every call: once per
  // process, not ~200 times per step of the tiny model.
  static const int cores =
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return cores;
}

const char *megaslide::cpu::cpuThreadsSettingError() {
  const char *env = std::getenv("MEGASLIDE_NUM_THREADS");
  if (!env || threadsSetting(env))
    return nullptr;
  thread_local std::string message;
  message = std::string("MEGASLIDE_NUM_THREADS is '") + env +
            "'; use a whole number of threads from 1 to 1024, or unset it "
            "for all cores";
  return message.c_str();
}

namespace {

/// The AsyncSignalsHeld alive on this thread.
thread_local int signalHolds = 0;

const sigset_t &asyncSignals() {
  static const sigset_t set = [] {
    sigset_t s;
    sigfillset(&s);
    for (int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP})
      sigdelset(&s, fault);
    return s;
  }();
  return set;
}

} // namespace

megaslide::cpu::AsyncSignalsHeld::AsyncSignalsHeld()
    : outermost(signalHolds++ == 0) {
  if (outermost)
    pthread_sigmask(SIG_BLOCK, &asyncSignals(), &saved);
}

megaslide::cpu::AsyncSignalsHeld::~AsyncSignalsHeld() {
  --signalHolds;
  if (outermost)
    pthread_sigmask(SIG_SETMASK, &saved, nullptr);
}

namespace megaslide::cpu {

/// One job at a time: `generation` announces it, workers 1 .. numWorkers-1
/// (pool thread i is worker i + 1) run it, `remaining` counts them home.
struct WorkerPool::State {
  void run(int64_t numWorkers, void (*call)(void *, int64_t), void *context) {
    auto runHere = [&] {
      for (int64_t w = 0; w < numWorkers; ++w)
        call(context, w);
    };
    AsyncSignalsHeld held; // this thread's share runs kernels too
    if (numWorkers <= 1)
      return runHere();
    std::unique_lock<std::mutex> job(busy, std::try_to_lock);
    if (!job.owns_lock())
      return runHere();
    {
      std::lock_guard<std::mutex> lock(mutex);
      while (static_cast<int64_t>(threads.size()) < numWorkers - 1) {
        int64_t worker = static_cast<int64_t>(threads.size()) + 1;
        threads.emplace_back([this, worker] { serve(worker); });
      }
      this->call = call;
      this->context = context;
      this->numWorkers = numWorkers;
      remaining = numWorkers - 1;
      ++generation;
    }
    wake.notify_all();
    call(context, 0);
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return remaining == 0; });
  }

  void serve(int64_t worker) {
    // For good: signals go to the process's other threads.
    AsyncSignalsHeld held;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return quit || generation != seen; });
      if (quit)
        return;
      seen = generation;
      if (worker >= numWorkers)
        continue;
      lock.unlock();
      call(context, worker);
      lock.lock();
      if (--remaining == 0)
        done.notify_one();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      quit = true;
    }
    wake.notify_all();
    for (std::thread &t : threads)
      t.join();
  }

  std::mutex busy; ///< held by the caller for a whole job
  std::mutex mutex;
  std::condition_variable wake, done;
  std::vector<std::thread> threads;
  uint64_t generation = 0;
  int64_t numWorkers = 0, remaining = 0;
  bool quit = false;
  void (*call)(void *, int64_t) = nullptr;
  void *context = nullptr;
};

WorkerPool::WorkerPool() : state(std::make_unique<State>()) {}
WorkerPool::~WorkerPool() { state->stop(); }

void WorkerPool::run(int64_t numWorkers, void (*call)(void *, int64_t),
                     void *context) {
  state->run(numWorkers, call, context);
}

} // namespace megaslide::cpu

namespace {

// Never destroyed: workers may still be parked in it while the process
// exits. A forked child has none of the parent's threads, so it starts a
// pool of its own (the old one, whose workers did not survive the fork, is
// abandoned as it was).
WorkerPool *pool = nullptr;

} // namespace

WorkerPool &megaslide::cpu::processPool() {
  static WorkerPool *const first = [] {
    pool = new WorkerPool;
    pthread_atfork(nullptr, nullptr, [] { pool = new WorkerPool; });
    return pool;
  }();
  (void)first;
  return *pool;
}
