//===- ScopedThreads.h - A thread count for one test scope ------*- C++ -*-===//
//
// The CPU kernels read MEGASLIDE_NUM_THREADS at every call (cpuThreads() in
// cpu/WorkerPool.h), so the tests that compare thread counts set it for a
// scope and put back what was there.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TESTING_SCOPEDTHREADS_H
#define MEGASLIDE_TESTING_SCOPEDTHREADS_H

#include <cstdlib>
#include <optional>
#include <string>

namespace megaslide::cpu::test {

/// Sets MEGASLIDE_NUM_THREADS for the object's lifetime.
class ScopedThreads {
public:
  explicit ScopedThreads(const std::string &threads) {
    if (const char *old = std::getenv("MEGASLIDE_NUM_THREADS"))
      saved = old;
    setenv("MEGASLIDE_NUM_THREADS", threads.c_str(), 1);
  }
  explicit ScopedThreads(int threads)
      : ScopedThreads(std::to_string(threads)) {}
  ScopedThreads(const ScopedThreads &) = delete;
  ScopedThreads &operator=(const ScopedThreads &) = delete;
  ~ScopedThreads() {
    if (saved)
      setenv("MEGASLIDE_NUM_THREADS", saved->c_str(), 1);
    else
      unsetenv("MEGASLIDE_NUM_THREADS");
  }

private:
  std::optional<std::string> saved;
};

} // namespace megaslide::cpu::test

#endif // MEGASLIDE_TESTING_SCOPEDTHREADS_H
