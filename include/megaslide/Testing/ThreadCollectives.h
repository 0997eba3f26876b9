//===- ThreadCollectives.h - A job's ranks as threads -----------*- C++ -*-===//
//
// The host collectives of a job whose ranks are threads of one test
// process (dist::Collectives without MPI): every collective is one gather
// of byte strings through a shared hub, then computed alike on every rank,
// so the results are the same bits on every rank and the sums are in rank
// order. Simple rather than fast: for tests of a few ranks and small
// tensors. A rank that calls another collective than the others, or gives
// a tensor of another size, fails on every rank with the same error.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TESTING_THREADCOLLECTIVES_H
#define MEGASLIDE_TESTING_THREADCOLLECTIVES_H

#include "megaslide/runtime/dist/Collectives.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>

namespace megaslide::dist::test {

/// What the ranks' threads share: one gather at a time.
class ThreadHub {
public:
  explicit ThreadHub(int size) : size(size), slots(size) {}

  /// Every rank's `mine` in rank order, once all have called. An error
  /// once a rank has waited `timeout` for the others or has aborted: the
  /// hub then fails every gather (a test fails, it does not hang).
  llvm::Expected<std::vector<std::string>>
  gather(int rank, llvm::StringRef mine, std::chrono::milliseconds timeout);
  /// Fails every gather in progress and to come with `why`.
  void fail(const std::string &why);

  const int size;

private:
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> slots, result;
  int arrived = 0;
  int64_t rounds = 0;
  std::optional<std::string> failure;
};

/// Rank `rank` of the hub's job (its local rank too: one node, host
/// "localhost"). Every virtual of dist::Collectives does what
/// Collectives.h documents and MPI does (runtime/dist/MpiCollectives.cpp),
/// but for those that end processes: abort fails the hub's gathers
/// instead, so the other ranks' collectives return an error naming this
/// rank, and returns; a collective past setTimeout returns an error
/// instead of ending the process; endJob fails the hub too, keeps the
/// message (endings()) and returns.
class ThreadRank final : public Collectives {
public:
  ThreadRank(ThreadHub &hub, int rank);

  llvm::Error allReduceSum(llvm::MutableArrayRef<float> data) override;
  llvm::Error allReduceSum(llvm::MutableArrayRef<double> data) override;
  llvm::Error barrier() override;
  llvm::Error allGatherShards(void *data, int64_t count,
                              int elementBytes) override;
  llvm::Error reduceScatterShards(llvm::MutableArrayRef<float> data) override;
  llvm::Error gatherShardsToRank0(llvm::ArrayRef<float> mine, int64_t count,
                                  float *all) override;
  void abort(int code) override;
  void endJob(const std::string &message) override;
  /// The messages endJob was given, in order.
  std::vector<std::string> endings() const;

protected:
  llvm::Expected<std::vector<std::string>> gatherStrings(llvm::StringRef mine,
                                                         bool timed) override;
  void timeoutChanged() override;

private:
  /// Every rank's `payload` in rank order, once every rank has called the
  /// collective `what` (its name and sizes): an error on every rank when
  /// one called another.
  llvm::Expected<std::vector<std::string>>
  exchange(const std::string &what, llvm::StringRef payload, bool timed = true);

  ThreadHub &hub;
  std::chrono::milliseconds timeout{std::chrono::minutes(1)};
  mutable std::mutex endedMu;
  std::vector<std::string> ended;
};

/// Runs `body` on `ranks` threads, each with its rank of one job, and
/// joins them.
void runThreadRanks(int ranks,
                    const std::function<void(int rank, Collectives &)> &body);

} // namespace megaslide::dist::test

#endif // MEGASLIDE_TESTING_THREADCOLLECTIVES_H
