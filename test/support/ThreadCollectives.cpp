//===- ThreadCollectives.cpp - A job's ranks as threads -------------------===//

#include "megaslide/Testing/ThreadCollectives.h"

#include "llvm/Support/FormatVariadic.h"

#include <cstring>
#include <thread>

using namespace megaslide;
using namespace megaslide::dist;
using namespace megaslide::dist::test;
using llvm::Error;
using llvm::Expected;

Expected<std::vector<std::string>>
ThreadHub::gather(int rank, llvm::StringRef mine,
                  std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu);
  if (failure)
    return llvm::createStringError(*failure);
  int64_t round = rounds;
  slots[rank] = mine.str();
  if (++arrived == size) {
    result = slots;
    arrived = 0;
    ++rounds;
    cv.notify_all();
    return result;
  }
  if (!cv.wait_for(lock, timeout, [&] { return rounds != round || failure; })) {
    failure = llvm::formatv("rank {0} waited {1} ms for the other ranks", rank,
                            timeout.count())
                  .str();
    cv.notify_all();
  }
  if (rounds == round)
    return llvm::createStringError(*failure);
  // The next round cannot complete before this rank joins it.
  return result;
}

void ThreadHub::fail(const std::string &why) {
  std::lock_guard<std::mutex> lock(mu);
  if (!failure)
    failure = why;
  cv.notify_all();
}

ThreadRank::ThreadRank(ThreadHub &hub, int rank)
    : Collectives(World{rank, hub.size, rank, hub.size, ""}, "localhost"),
      hub(hub) {}

Expected<std::vector<std::string>> ThreadRank::exchange(const std::string &what,
                                                        llvm::StringRef payload,
                                                        bool timed) {
  // The untimed gather of a checkpoint still ends a test that hangs.
  std::chrono::milliseconds limit =
      timed ? timeout : std::max(timeout, std::chrono::milliseconds(60000));
  Expected<std::vector<std::string>> all =
      hub.gather(rank(), what + '\0' + payload.str(), limit);
  if (!all)
    return all.takeError();
  std::vector<std::string> payloads;
  std::string calls;
  bool same = true;
  for (auto [r, message] : llvm::enumerate(*all)) {
    auto [called, data] = llvm::StringRef(message).split('\0');
    same &= called == what;
    calls += llvm::formatv("{0}rank {1}: {2}", r ? "; " : "", r, called).str();
    payloads.push_back(data.str());
  }
  if (!same)
    return llvm::createStringError("the ranks called different collectives (" +
                                   calls + ")");
  return payloads;
}

namespace {

/// The bytes of `data`, as one rank's payload.
template <typename T> llvm::StringRef bytesOf(llvm::ArrayRef<T> data) {
  return llvm::StringRef(reinterpret_cast<const char *>(data.data()),
                         data.size() * sizeof(T));
}

/// `out` becomes the element-wise sum of every rank's `T`s, added in rank
/// order (rank 0's plus rank 1's, plus rank 2's, ...).
template <typename T>
Error sumInRankOrder(const std::vector<std::string> &payloads,
                     llvm::MutableArrayRef<T> out) {
  for (size_t i = 0; i < out.size(); ++i) {
    T sum;
    std::memcpy(&sum, payloads[0].data() + i * sizeof(T), sizeof(T));
    for (size_t r = 1; r < payloads.size(); ++r) {
      T v;
      std::memcpy(&v, payloads[r].data() + i * sizeof(T), sizeof(T));
      sum += v;
    }
    out[i] = sum;
  }
  return Error::success();
}

} // namespace

Error ThreadRank::allReduceSum(llvm::MutableArrayRef<float> data) {
  Expected<std::vector<std::string>> all = exchange(
      llvm::formatv("allreduce of {0} f32", data.size()), bytesOf<float>(data));
  if (!all)
    return all.takeError();
  return sumInRankOrder(*all, data);
}

Error ThreadRank::allReduceSum(llvm::MutableArrayRef<double> data) {
  Expected<std::vector<std::string>> all =
      exchange(llvm::formatv("allreduce of {0} f64", data.size()),
               bytesOf<double>(data));
  if (!all)
    return all.takeError();
  return sumInRankOrder(*all, data);
}

Error ThreadRank::barrier() { return exchange("barrier", "").takeError(); }

Error ThreadRank::allGatherShards(void *data, int64_t count, int elementBytes) {
  if (elementBytes != 1 && elementBytes != 2 && elementBytes != 4)
    return llvm::createStringError(
        llvm::formatv("allGatherShards: {0}-byte elements (1, 2 or 4)",
                      elementBytes)
            .str());
  char *bytes = static_cast<char *>(data);
  ShardRange mine = shardRange(count, rank(), size());
  Expected<std::vector<std::string>> shards = exchange(
      llvm::formatv("allgather of {0} x {1} bytes", count, elementBytes),
      llvm::StringRef(bytes + mine.begin * elementBytes,
                      mine.size() * elementBytes));
  if (!shards)
    return shards.takeError();
  for (int r = 0; r < size(); ++r) {
    ShardRange s = shardRange(count, r, size());
    std::memcpy(bytes + s.begin * elementBytes, (*shards)[r].data(),
                s.size() * elementBytes);
  }
  return Error::success();
}

Error ThreadRank::reduceScatterShards(llvm::MutableArrayRef<float> data) {
  Expected<std::vector<std::string>> all =
      exchange(llvm::formatv("reduce-scatter of {0} f32", data.size()),
               bytesOf<float>(data));
  if (!all)
    return all.takeError();
  ShardRange mine = shardRange(data.size(), rank(), size());
  std::vector<std::string> shards;
  for (const std::string &rankData : *all)
    shards.push_back(rankData.substr(mine.begin * sizeof(float),
                                     mine.size() * sizeof(float)));
  return sumInRankOrder(shards, data.slice(mine.begin, mine.size()));
}

Error ThreadRank::gatherShardsToRank0(llvm::ArrayRef<float> mine, int64_t count,
                                      float *all) {
  Expected<std::vector<std::string>> shards = exchange(
      llvm::formatv("gather to rank 0 of {0} f32", count), bytesOf(mine));
  if (!shards)
    return shards.takeError();
  for (int r = 0; r < size(); ++r) {
    ShardRange s = shardRange(count, r, size());
    if ((*shards)[r].size() != s.size() * sizeof(float))
      return llvm::createStringError(
          llvm::formatv(
              "gather to rank 0 of {0} f32: rank {1} gave {2} elements for its "
              "shard of {3}",
              count, r, (*shards)[r].size() / sizeof(float), s.size())
              .str());
  }
  if (rank() == 0)
    for (int r = 0; r < size(); ++r)
      std::memcpy(all + shardRange(count, r, size()).begin, (*shards)[r].data(),
                  (*shards)[r].size());
  return Error::success();
}

void ThreadRank::abort(int code) {
  hub.fail(
      llvm::formatv("rank {0} aborted the job (exit code {1})", rank(), code));
}

void ThreadRank::endJob(const std::string &message) {
  hub.fail(message);
  std::lock_guard<std::mutex> lock(endedMu);
  ended.push_back(message);
}

std::vector<std::string> ThreadRank::endings() const {
  std::lock_guard<std::mutex> lock(endedMu);
  return ended;
}

void ThreadRank::timeoutChanged() {
  timeout = std::chrono::milliseconds(
      static_cast<int64_t>(Collectives::timeout() * 1000));
}

Expected<std::vector<std::string>>
ThreadRank::gatherStrings(llvm::StringRef mine, bool timed) {
  return exchange("allgather of strings", mine, timed);
}

void dist::test::runThreadRanks(
    int ranks, const std::function<void(int, Collectives &)> &body) {
  ThreadHub hub(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      ThreadRank job(hub, r);
      body(r, job);
    });
  for (std::thread &t : threads)
    t.join();
}
