//===- DeviceCollectivesTest.cpp - NCCL collectives on fake devices -------===//
//
// cuda::DeviceCollectives over 2 and 4 ranks run as threads, each with its
// own fake device (FakeCuda.h) and the fake NCCL, set up through host
// collectives between the threads: the all-gather and reduce-scatter of
// unequal shards (bf16, f16, f32) give the expected bits on every rank
// under four seeds; work the collective's events do not cover, ranks that
// disagree on a collective, a rank that fails to set up and a rank that
// aborts are reported; device ordinal r is rank r's fake device. The real
// NCCL is only loaded here: without a GPU it cannot make a communicator.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/DeviceCollectives.h"

#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/Testing/FakeCuda.h"
#include "megaslide/Testing/ThreadCollectives.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;

namespace {

/// Runs `body` on `ranks` threads, each on its own fake device (set up
/// without a plan, with `options` for the rank) and with its host
/// collectives.
void runRanks(int ranks,
              const std::function<void(int, dist::Collectives &)> &body,
              const std::function<fake::Options(int)> &options = {}) {
  dist::test::runThreadRanks(ranks, [&](int rank, dist::Collectives &job) {
    fake::useDevice(rank);
    fake::setUp(options ? options(rank) : fake::Options{});
    body(rank, job);
  });
}

/// One rank's stream, device buffer and pinned buffer of `bytes`.
struct Buffers {
  explicit Buffers(size_t bytes) : bytes(bytes) {
    EXPECT_EQ(cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), 0);
    EXPECT_EQ(cu.cuMemAlloc_v2(&data, bytes), 0);
    EXPECT_EQ(cu.cuMemHostAlloc(&host, bytes, 0), 0);
  }
  ~Buffers() {
    cu.cuStreamSynchronize(stream);
    cu.cuMemFreeHost(host);
    cu.cuMemFree_v2(data);
    cu.cuStreamDestroy_v2(stream);
  }
  uint8_t *hostBytes() const { return static_cast<uint8_t *>(host); }
  /// [begin, end) elements of `type` between host and device on `s`.
  void toDevice(int64_t begin, int64_t end, DType type, CUstream s) const {
    int64_t b = exec::dtypeBytes(type);
    if (end > begin) {
      EXPECT_EQ(cu.cuMemcpyHtoDAsync_v2(data + begin * b,
                                        hostBytes() + begin * b,
                                        (end - begin) * b, s),
                0);
    }
  }
  void toHost(int64_t begin, int64_t end, DType type, CUstream s) const {
    int64_t b = exec::dtypeBytes(type);
    if (end > begin) {
      EXPECT_EQ(cu.cuMemcpyDtoHAsync_v2(hostBytes() + begin * b,
                                        data + begin * b, (end - begin) * b, s),
                0);
    }
  }

  const CudaDriverApi &cu = fake::driver();
  size_t bytes;
  CUstream stream = nullptr;
  CUdeviceptr data = 0;
  void *host = nullptr;
};

/// Rank `rank`'s input element `i` under `seed`, as stored in `type`.
float inputOf(uint64_t seed, int rank, int64_t i, DType type) {
  std::mt19937_64 rng(seed * 1000003 + rank * 7919 + i);
  float v = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  uint32_t stored = 0;
  fake::storeAs(&stored, type, 0, v);
  return fake::loadAs(&stored, type, 0);
}

/// `v` rounded to `type`, as bits.
uint32_t bitsOf(float v, DType type) {
  uint32_t stored = 0;
  fake::storeAs(&stored, type, 0, v);
  return stored;
}
uint32_t bitsAt(const uint8_t *p, DType type, int64_t i) {
  uint32_t stored = 0;
  int64_t b = exec::dtypeBytes(type);
  std::memcpy(&stored, p + i * b, b);
  return stored;
}

/// The rank owning element `i` of `count` over `ranks`.
int ownerOf(int64_t i, int64_t count, int ranks) {
  for (int r = 0; r < ranks; ++r)
    if (i < dist::shardRange(count, r, ranks).end)
      return r;
  return ranks;
}

std::string joined(const std::vector<std::string> &errors) {
  return llvm::join(errors, "\n");
}

constexpr int64_t kCounts[] = {1000, 100, 37};
constexpr DType kTypes[] = {DType::BF16, DType::F16, DType::F32};
constexpr uint64_t kSeeds = 4;

/// Every rank gathers every shard, and reduces its own, bit for bit.
void expectExactCollectives(int ranks) {
  runRanks(ranks, [&](int rank, dist::Collectives &job) {
    // The buffers outlive the collectives, whose destructor waits for them.
    Buffers buf(1000 * 4);
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    for (DType type : kTypes)
      for (int64_t count : kCounts)
        for (uint64_t seed = 0; seed < kSeeds; ++seed) {
          SCOPED_TRACE(llvm::formatv("rank {0} of {1}, {2} x {3}, seed {4}",
                                     rank, ranks, count, exec::dtypeName(type),
                                     seed)
                           .str());
          fake::beginStep(seed);
          dist::ShardRange mine = dist::shardRange(count, rank, ranks);
          // All-gather: this rank's shard in, every shard out.
          for (int64_t i = 0; i < count; ++i)
            fake::storeAs(buf.host, type, i, inputOf(seed, rank, i, type));
          buf.toDevice(mine.begin, mine.end, type, buf.stream);
          ASSERT_FALSE(
              (*dc)->allGatherShards(buf.data, count, type, buf.stream));
          buf.toHost(0, count, type, buf.stream);
          ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
          int wrong = 0;
          for (int64_t i = 0; i < count; ++i) {
            float want = inputOf(seed, ownerOf(i, count, ranks), i, type);
            wrong += bitsAt(buf.hostBytes(), type, i) != bitsOf(want, type);
          }
          EXPECT_EQ(wrong, 0) << "elements wrong after the all-gather";
          // Reduce-scatter: every element in, the sum of this rank's shard
          // out (fp32 in rank order, rounded to the type).
          for (int64_t i = 0; i < count; ++i)
            fake::storeAs(buf.host, type, i, inputOf(seed, rank, i, type));
          buf.toDevice(0, count, type, buf.stream);
          ASSERT_FALSE(
              (*dc)->reduceScatterShards(buf.data, count, type, buf.stream));
          buf.toHost(0, count, type, buf.stream);
          ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
          wrong = 0;
          for (int64_t i = mine.begin; i < mine.end; ++i) {
            float sum = 0;
            for (int r = 0; r < ranks; ++r)
              sum += inputOf(seed, r, i, type);
            wrong += bitsAt(buf.hostBytes(), type, i) != bitsOf(sum, type);
          }
          EXPECT_EQ(wrong, 0) << "elements wrong after the reduce-scatter";
          std::vector<std::string> errors = fake::endStep();
          EXPECT_TRUE(errors.empty()) << joined(errors);
        }
  });
}

TEST(DeviceCollectivesTest, UnequalShardsOverTwoRanksAreExact) {
  expectExactCollectives(2);
}

TEST(DeviceCollectivesTest, UnequalShardsOverFourRanksAreExact) {
  expectExactCollectives(4);
}

TEST(DeviceCollectivesTest, WorkTheEventsDoNotCoverIsAMissingWait) {
  constexpr int64_t count = 1000;
  std::vector<std::vector<std::string>> errors(4);
  runRanks(4, [&](int rank, dist::Collectives &job) {
    // Streams: #1 `stream`, #2 the collectives', #3 `other`.
    Buffers buf(count * 2);
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    CUstream other = nullptr;
    ASSERT_EQ(buf.cu.cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), 0);
    fake::beginStep(0);
    for (int64_t i = 0; i < count; ++i)
      fake::storeAs(buf.host, DType::BF16, i, 1.0f);
    // The shard is copied on `other`, which `stream` does not wait for:
    // the gather reads it unordered.
    dist::ShardRange mine = dist::shardRange(count, rank, 4);
    buf.toDevice(mine.begin, mine.end, DType::BF16, other);
    EXPECT_FALSE(
        (*dc)->allGatherShards(buf.data, count, DType::BF16, buf.stream));
    ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
    ASSERT_EQ(buf.cu.cuStreamSynchronize(other), 0);
    // The reduced shard is read on `other`, which does not wait for the
    // collective's event on `stream`.
    buf.toDevice(0, count, DType::BF16, buf.stream);
    EXPECT_FALSE(
        (*dc)->reduceScatterShards(buf.data, count, DType::BF16, buf.stream));
    buf.toHost(mine.begin, mine.end, DType::BF16, other);
    ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
    ASSERT_EQ(buf.cu.cuStreamSynchronize(other), 0);
    errors[rank] = fake::endStep();
    buf.cu.cuStreamDestroy_v2(other);
  });
  for (int rank = 0; rank < 4; ++rank) {
    std::string all = joined(errors[rank]);
    SCOPED_TRACE("rank " + std::to_string(rank) + ":\n" + all);
    dist::ShardRange mine = dist::shardRange(count, rank, 4);
    std::string bytes = llvm::formatv("device allocation #0 bytes [{0}, {1})",
                                      mine.begin * 2, mine.end * 2);
    std::string unordered =
        "no event orders that write before it (a missing wait)";
    EXPECT_NE(all.find(llvm::formatv("a group of 4 ncclBroadcast (collective "
                                     "#1 of rank {0}) on stream #2 (the "
                                     "backend's own) reads {1} that "
                                     "cuMemcpyHtoDAsync on stream #3 (the "
                                     "backend's own) writes, and {2}",
                                     rank, bytes, unordered)
                           .str()),
              std::string::npos);
    EXPECT_NE(all.find(llvm::formatv("cuMemcpyDtoHAsync on stream #3 (the "
                                     "backend's own) reads {0} that a group "
                                     "of 4 ncclReduce (collective #2 of rank "
                                     "{1}) on stream #2 (the backend's own) "
                                     "writes, and {2}",
                                     bytes, rank, unordered)
                           .str()),
              std::string::npos);
  }
}

TEST(DeviceCollectivesTest, RanksThatDisagreeOnACountAreNamed) {
  std::vector<std::vector<std::string>> errors(4);
  runRanks(4, [&](int rank, dist::Collectives &job) {
    // Rank 3 has one element more: its last shard is one longer.
    int64_t count = rank == 3 ? 1001 : 1000;
    Buffers buf(count * 2);
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    fake::beginStep(0);
    for (int64_t i = 0; i < count; ++i)
      fake::storeAs(buf.host, DType::BF16, i, 1.0f);
    buf.toDevice(0, count, DType::BF16, buf.stream);
    EXPECT_FALSE(
        (*dc)->allGatherShards(buf.data, count, DType::BF16, buf.stream));
    ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
    errors[rank] = fake::endStep();
  });
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(joined(errors[rank]),
              "a group of 4 ncclBroadcast (collective #1 of rank " +
                  std::to_string(rank) +
                  "): rank 0 issued ncclBroadcast of 232 bf16 from root 3, "
                  "rank 3 ncclBroadcast of 233 bf16 from root 3 (call 4 of "
                  "the group)");
}

TEST(DeviceCollectivesTest, ARankThatFailsToSetUpFailsEveryRank) {
  std::vector<std::string> messages(2);
  runRanks(
      2,
      [&](int rank, dist::Collectives &job) {
        auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
        ASSERT_FALSE(!!dc);
        messages[rank] = llvm::toString(dc.takeError());
        fake::endStep();
      },
      [](int rank) {
        fake::Options o;
        if (rank == 1)
          o.fault = fake::Fault{"cuStreamCreate"};
        return o;
      });
  EXPECT_EQ(messages[0], "the NCCL communicator was not made: rank(s) 1 "
                         "failed to set up (their own errors say why)");
  EXPECT_EQ(messages[1].find("cuStreamCreate (the NCCL stream): "), 0u)
      << messages[1];
}

TEST(DeviceCollectivesTest, AnAbortingRankReleasesTheOthers) {
  std::vector<std::string> errors(2);
  auto start = std::chrono::steady_clock::now();
  runRanks(2, [&](int rank, dist::Collectives &job) {
    Buffers buf(64 * 4);
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    fake::beginStep(0);
    buf.toDevice(0, 64, DType::F32, buf.stream);
    if (rank == 1) {
      (*dc)->abort();
      std::string msg = llvm::toString(
          (*dc)->allGatherShards(buf.data, 64, DType::F32, buf.stream));
      EXPECT_EQ(msg, "ncclBroadcast: the NCCL communicator was aborted");
    } else {
      EXPECT_FALSE(
          (*dc)->allGatherShards(buf.data, 64, DType::F32, buf.stream));
    }
    ASSERT_EQ(buf.cu.cuStreamSynchronize(buf.stream), 0);
    errors[rank] = joined(fake::endStep());
  });
  EXPECT_EQ(errors[0], "a group of 2 ncclBroadcast (collective #1 of rank "
                       "0): rank 1 aborted its communicator");
  EXPECT_EQ(errors[1], "");
  auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  EXPECT_LT(waited.count(),
            std::chrono::milliseconds(fake::kNcclTimeout).count());
}

/// The watchdog: rank 1 never issues the collective rank 0 waits in, as
/// if hung; past the job's timeout rank 0 ends the job (endJob, which
/// exits a process and here fails the ranks' host collectives) naming
/// itself and the limit, and its wait returns (the communicator aborted).
TEST(DeviceCollectivesTest, ARankWaitingPastTheTimeoutEndsTheJob) {
  std::vector<std::vector<std::string>> endings(2);
  auto start = std::chrono::steady_clock::now();
  runRanks(2, [&](int rank, dist::Collectives &job) {
    Buffers buf(64 * 4);
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    // Once both have joined: the setup's own waits keep the default.
    job.setTimeout(0.5);
    fake::beginStep(0);
    buf.toDevice(0, 64, DType::F32, buf.stream);
    if (rank == 0) {
      EXPECT_FALSE(
          (*dc)->allGatherShards(buf.data, 64, DType::F32, buf.stream));
      buf.cu.cuStreamSynchronize(buf.stream);
    } else {
      // Hung: until the job ends.
      llvm::consumeError(job.untimedAllGather("").takeError());
    }
    fake::endStep();
    endings[rank] = static_cast<dist::test::ThreadRank &>(job).endings();
  });
  ASSERT_EQ(endings[0].size(), 1u);
  EXPECT_NE(endings[0][0].find("megaslide: error: rank 0 on localhost: its "
                               "device collectives have waited "),
            std::string::npos)
      << endings[0][0];
  EXPECT_NE(endings[0][0].find("(--collective-timeout 0.5): a rank has hung "
                               "or died"),
            std::string::npos)
      << endings[0][0];
  EXPECT_TRUE(endings[1].empty());
  EXPECT_LT(std::chrono::steady_clock::now() - start, fake::kNcclTimeout);
}

/// A peer that aborts its communicator is what NCCL reports as a remote
/// error (a peer's connection lost): the watchdog ends the job at once,
/// with no timeout set.
TEST(DeviceCollectivesTest, NcclsAsyncErrorEndsTheJob) {
  std::vector<std::vector<std::string>> endings(2);
  runRanks(2, [&](int rank, dist::Collectives &job) {
    auto dc = DeviceCollectives::create(fake::driver(), fake::nccl(), job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    if (rank == 1)
      (*dc)->abort();
    else
      for (int i = 0; i < 100 && endings[0].empty(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        endings[0] = static_cast<dist::test::ThreadRank &>(job).endings();
      }
  });
  ASSERT_EQ(endings[0].size(), 1u);
  EXPECT_NE(endings[0][0].find("rank 0 on localhost: NCCL reports "),
            std::string::npos)
      << endings[0][0];
  EXPECT_NE(endings[0][0].find("a rank died or its connection failed"),
            std::string::npos)
      << endings[0][0];
}

TEST(DeviceCollectivesTest, OrdinalRIsRankRsFakeDevice) {
  runRanks(2, [&](int rank, dist::Collectives &) {
    const CudaDriverApi &cu = fake::driver();
    auto info = initCudaDevice(cu, rank);
    ASSERT_TRUE(!!info) << llvm::toString(info.takeError());
    CUcontext ctx = nullptr;
    ASSERT_EQ(cu.cuDevicePrimaryCtxRetain(&ctx, info->device), 0);
    // A thread of the backend's, made current as the backend does.
    std::thread([&] {
      CUdeviceptr p = 0;
      EXPECT_EQ(cu.cuCtxSetCurrent(ctx), 0);
      EXPECT_EQ(cu.cuMemAlloc_v2(&p, 256), 0);
      EXPECT_EQ(cu.cuMemFree_v2(p), 0);
    }).join();
    EXPECT_EQ(fake::stats().calls["cuMemAlloc_v2"], 1);
    EXPECT_EQ(cu.cuDevicePrimaryCtxRelease_v2(info->device), 0);
    EXPECT_TRUE(fake::endStep().empty());
  });
}

TEST(DeviceCollectivesTest, RealNcclWithoutAGpuFailsToMakeTheCommunicator) {
  auto nccl = loadNccl();
  if (!nccl)
    GTEST_SKIP() << llvm::toString(nccl.takeError());
  if (cudaDeviceAvailable())
    GTEST_SKIP() << "a CUDA device is present";
  runRanks(1, [&](int, dist::Collectives &job) {
    auto dc = DeviceCollectives::create(fake::driver(), **nccl, job);
    ASSERT_FALSE(!!dc);
    std::string msg = llvm::toString(dc.takeError());
    EXPECT_NE(msg.find(": NCCL error "), std::string::npos) << msg;
    EXPECT_TRUE(msg.find("ncclGetUniqueId") == 0 ||
                msg.find("ncclCommInitRank") == 0)
        << msg;
    EXPECT_TRUE(fake::endStep().empty());
  });
}

/// On a GPU (the device check): the real NCCL in a job of one, its
/// communicator made through the host collectives, both collectives run
/// (for one rank they leave the buffer as it was), and the watchdog, on
/// with a timeout, finds them complete rather than ending the job.
TEST(DeviceCollectivesGpuTest, WorldOfOneOnTheRealNccl) {
  std::string why;
  if (!cudaDeviceAvailable(&why))
    GTEST_SKIP() << why;
  auto nccl = loadNccl();
  ASSERT_TRUE(!!nccl) << "a GPU machine without NCCL: "
                      << llvm::toString(nccl.takeError());
  auto driver = loadCudaDriver();
  ASSERT_TRUE(!!driver) << llvm::toString(driver.takeError());
  const CudaDriverApi &cu = **driver;
  auto info = initCudaDevice(cu, 0);
  ASSERT_TRUE(!!info) << llvm::toString(info.takeError());
  CUcontext ctx = nullptr;
  ASSERT_EQ(cu.cuDevicePrimaryCtxRetain(&ctx, info->device), 0);
  ASSERT_EQ(cu.cuCtxSetCurrent(ctx), 0);
  dist::test::runThreadRanks(1, [&](int, dist::Collectives &job) {
    ASSERT_EQ(cu.cuCtxSetCurrent(ctx), 0);
    auto dc = DeviceCollectives::create(cu, **nccl, job);
    ASSERT_TRUE(!!dc) << llvm::toString(dc.takeError());
    job.setTimeout(1); // after ncclCommInitRank, whose time is NCCL's
    CUstream stream = nullptr;
    ASSERT_EQ(cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), 0);
    constexpr int64_t n = 1000;
    std::vector<float> in(n), out(n, 0);
    for (int64_t i = 0; i < n; ++i)
      in[i] = 0.5f * static_cast<float>(i) - 7;
    CUdeviceptr data = 0;
    void *pinned = nullptr;
    ASSERT_EQ(cu.cuMemAlloc_v2(&data, n * 4), 0);
    ASSERT_EQ(cu.cuMemHostAlloc(&pinned, n * 4, 0), 0);
    std::memcpy(pinned, in.data(), n * 4);
    ASSERT_EQ(cu.cuMemcpyHtoDAsync_v2(data, pinned, n * 4, stream), 0);
    EXPECT_FALSE((*dc)->allGatherShards(data, n, DType::F32, stream));
    EXPECT_FALSE((*dc)->reduceScatterShards(data, n, DType::F32, stream));
    ASSERT_EQ(cu.cuMemcpyDtoHAsync_v2(pinned, data, n * 4, stream), 0);
    ASSERT_EQ(cu.cuStreamSynchronize(stream), 0);
    std::memcpy(out.data(), pinned, n * 4);
    EXPECT_EQ(out, in);
    // Twice the timeout: the watchdog has seen the collectives done.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    EXPECT_TRUE(static_cast<dist::test::ThreadRank &>(job).endings().empty());
    dc->reset();
    cu.cuMemFreeHost(pinned);
    cu.cuMemFree_v2(data);
    cu.cuStreamDestroy_v2(stream);
  });
  cu.cuDevicePrimaryCtxRelease_v2(info->device);
}

} // namespace
