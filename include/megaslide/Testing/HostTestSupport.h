//===- HostTestSupport.h - Fixtures of the host I/O tests -------*- C++ -*-===//
//
// Shared by the tests of runtime/host and runtime/support (SafetensorsTest,
// WeightsTest, CheckpointTest, ReadFileTest): a hand-made plan and a host
// state for it, a fresh directory per test, whole-file reads and writes,
// sparse files, and a watch that fails a test whose reader opens a FIFO.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TEST_UNIT_HOSTTESTSUPPORT_H
#define MEGASLIDE_TEST_UNIT_HOSTTESTSUPPORT_H

#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include "gtest/gtest.h"

#include <atomic>
#include <csignal>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

namespace megaslide::host::test {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string role = "master";
};

/// A plan with the given params plus both moments of every master.
exec::ExecPlan makePlan(const std::vector<ParamSpec> &specs);

/// Masters of every rank (a scalar and an empty tensor too) and a frozen
/// buffer.
std::vector<ParamSpec> defaultSpecs();

/// A state for `plan` with every tensor filled from `seed`: values that
/// bf16 cannot hold exactly, signed zeros, subnormals, huge values.
HostState makeState(const exec::ExecPlan &plan, uint32_t seed);

const HostTensor &get(const HostState &s, llvm::StringRef name);
HostTensor &get(HostState &s, llvm::StringRef name);

bool bitEqual(const std::vector<float> &a, const std::vector<float> &b);

/// Error text, or "" on success.
std::string errorText(llvm::Error e);

/// A fresh directory for each test, removed after it.
class ScratchDirTest : public ::testing::Test {
protected:
  void SetUp() override;
  void TearDown() override;
  std::string path(llvm::StringRef name) const;
  std::string dir;
};

std::string readAll(llvm::StringRef path);
void writeAll(llvm::StringRef path, llvm::StringRef bytes);

/// A sparse file of `size` bytes starting with `prefix`: large files cost
/// no disk.
void writeSparse(llvm::StringRef path, llvm::StringRef prefix, uint64_t size);

/// Sees whether anything opens FIFO `path` for reading while in scope:
/// opening the write end without blocking succeeds only while a reader
/// has the FIFO open, and releases a reader blocked in open(), so a
/// reader that would hang makes the test fail instead.
class FifoWatch {
public:
  explicit FifoWatch(std::string fifo);
  ~FifoWatch() { openedByReader(); }
  /// Whether a reader opened the FIFO; stops watching.
  bool openedByReader();

private:
  std::string fifo;
  std::atomic<bool> done{false}, opened{false};
  std::thread watcher;
};

/// The names in `dir`, sorted (temporaries start with '.').
std::vector<std::string> entries(llvm::StringRef dir);

/// Fails the disk after `limit` bytes of any file (RLIMIT_FSIZE) while in
/// scope: writes past it fail with EFBIG, like a full disk.
class FileSizeLimit {
public:
  explicit FileSizeLimit(rlim_t limit) {
    getrlimit(RLIMIT_FSIZE, &saved);
    previous = std::signal(SIGXFSZ, SIG_IGN);
    rlimit l = saved;
    l.rlim_cur = limit;
    setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, previous);
  }

private:
  rlimit saved;
  void (*previous)(int);
};

} // namespace megaslide::host::test

#endif // MEGASLIDE_TEST_UNIT_HOSTTESTSUPPORT_H
