//===- WorkerPoolTest.cpp - The CPU kernels' persistent worker pool -------===//
//
// runOnWorkers (include/megaslide/runtime/cpu/WorkerPool.h): every worker index runs exactly
// once per call and the call returns only after all of them; worker 0 is
// the caller; a call from inside a worker, or from another thread while
// the pool is busy, still runs every index (on its own thread); thousands
// of small calls in a row and calls from several threads at once neither
// lose work nor hang; a forked child gets workers of its own.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cpu/WorkerPool.h"
#include "megaslide/Testing/ScopedThreads.h"

#include "gtest/gtest.h"

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

using namespace megaslide::cpu;

namespace {

TEST(WorkerPoolTest, EveryWorkerRunsOnceAndTheCallerIsWorkerZero) {
  for (int64_t n : {1, 2, 3, 8, 17}) {
    std::vector<std::atomic<int>> runs(n);
    std::thread::id caller = std::this_thread::get_id(), zero;
    runOnWorkers(n, [&](int64_t w) {
      runs[w].fetch_add(1);
      if (w == 0)
        zero = std::this_thread::get_id();
    });
    for (int64_t w = 0; w < n; ++w)
      EXPECT_EQ(runs[w].load(), 1) << "worker " << w << " of " << n;
    EXPECT_EQ(zero, caller);
  }
}

TEST(WorkerPoolTest, WorkersRunOnDistinctThreads) {
  std::mutex mutex;
  std::set<std::thread::id> ids;
  runOnWorkers(4, [&](int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 4u);
}

TEST(WorkerPoolTest, ZeroWorkersRunNothing) {
  int runs = 0;
  runOnWorkers(0, [&](int64_t) { ++runs; });
  EXPECT_EQ(runs, 0);
}

TEST(WorkerPoolTest, NestedCallsRunInline) {
  std::atomic<int> inner{0};
  runOnWorkers(3, [&](int64_t) {
    std::thread::id self = std::this_thread::get_id();
    runOnWorkers(4, [&](int64_t) {
      EXPECT_EQ(std::this_thread::get_id(), self);
      inner.fetch_add(1);
    });
  });
  EXPECT_EQ(inner.load(), 12);
}

TEST(WorkerPoolTest, ManyCallsFromSeveralThreadsLoseNoWork) {
  constexpr int kThreads = 4, kCalls = 2000, kWorkers = 3;
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < kThreads; ++t)
    callers.emplace_back([&] {
      for (int c = 0; c < kCalls; ++c)
        runOnWorkers(kWorkers, [&](int64_t w) { total.fetch_add(w + 1); });
    });
  for (std::thread &t : callers)
    t.join();
  EXPECT_EQ(total.load(), int64_t(kThreads) * kCalls * (1 + 2 + 3));
}

TEST(WorkerPoolTest, ForkedChildGetsWorkersOfItsOwn) {
  runOnWorkers(3, [](int64_t) {}); // the parent's pool exists
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::atomic<int> runs{0};
    runOnWorkers(3, [&](int64_t) { runs.fetch_add(1); });
    _exit(runs.load() == 3 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(WorkerPoolTest, ABadThreadCountIsReportedNotIgnoredSilently) {
  using megaslide::cpu::test::ScopedThreads;
  for (const char *good : {"1", "7", "1024"}) {
    ScopedThreads scoped(good);
    EXPECT_EQ(cpuThreadsSettingError(), nullptr) << good;
    EXPECT_EQ(cpuThreads(), std::stoi(good));
  }
  for (const char *bad :
       {"0", "-1", "", "two", "3x", "1025", "99999999999999999999"}) {
    ScopedThreads scoped(bad);
    const char *error = cpuThreadsSettingError();
    ASSERT_NE(error, nullptr) << bad;
    EXPECT_NE(std::string(error).find(
                  std::string("MEGASLIDE_NUM_THREADS is '") + bad + "'"),
              std::string::npos)
        << error;
    // The kernels themselves fall back to every core.
    EXPECT_GE(cpuThreads(), 1);
  }
}

} // namespace
