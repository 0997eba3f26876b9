//===- ThreadCollectivesTest.cpp - A job's ranks as threads ---------------===//
//
// Every collective of ThreadCollectives.h over 3 ranks against the values
// computed here directly from what each rank gave: sums in rank order (the
// same bits on every rank), shards where dist::shardRange puts them
// (unequal: 100 elements are 48, 32 and 20), rank 0 alone written by the
// gather; and a rank that calls another collective, aborts or never comes
// fails the others instead of hanging them.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Testing/ThreadCollectives.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

using namespace megaslide::dist;
using megaslide::dist::test::runThreadRanks;

namespace {

constexpr int kRanks = 3;
constexpr int64_t kCount = 100;

/// Rank `rank`'s element `i`: of all magnitudes, so that the order of a
/// sum shows in its bits.
template <typename T> T valueOf(int rank, int64_t i) {
  std::mt19937 rng(static_cast<unsigned>(rank * 1000 + i));
  return static_cast<T>(
      std::ldexp(std::uniform_real_distribution<double>(-1, 1)(rng),
                 std::uniform_int_distribution<int>(-30, 30)(rng)));
}

template <typename T> std::vector<T> valuesOf(int rank, int64_t count) {
  std::vector<T> v(count);
  for (int64_t i = 0; i < count; ++i)
    v[i] = valueOf<T>(rank, i);
  return v;
}

/// Element `i` summed in rank order: ((rank 0's + rank 1's) + rank 2's).
template <typename T> T sumOf(int64_t i) {
  T sum = valueOf<T>(0, i);
  for (int r = 1; r < kRanks; ++r)
    sum += valueOf<T>(r, i);
  return sum;
}

template <typename T> bool sameBits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

TEST(ThreadCollectivesTest, ShardsOf100ElementsAreUnequal) {
  // What the tests below rely on to cover unequal shards.
  EXPECT_EQ(shardRange(kCount, 0, kRanks).size(), 48);
  EXPECT_EQ(shardRange(kCount, 1, kRanks).size(), 32);
  EXPECT_EQ(shardRange(kCount, 2, kRanks).size(), 20);
}

TEST(ThreadCollectivesTest, AllReduceSumAddsInRankOrder) {
  // 1 + 1e8 rounds to 1e8 in fp32: in rank order the sum is 0, where the
  // reverse order (-1e8 + 1e8 + 1) would give 1.
  const float big[kRanks] = {1.0f, 1e8f, -1e8f};
  std::vector<std::vector<float>> floats(kRanks);
  std::vector<std::vector<double>> doubles(kRanks);
  std::vector<float> order(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    floats[rank] = valuesOf<float>(rank, kCount);
    doubles[rank] = valuesOf<double>(rank, kCount);
    std::vector<float> one = {big[rank]};
    EXPECT_FALSE(job.allReduceSum(floats[rank]));
    EXPECT_FALSE(job.allReduceSum(doubles[rank]));
    EXPECT_FALSE(job.allReduceSum(one));
    order[rank] = one[0];
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(order[r], 0.0f) << "rank " << r;
    for (int64_t i = 0; i < kCount; ++i) {
      EXPECT_TRUE(sameBits(floats[r][i], sumOf<float>(i)))
          << "rank " << r << " f32 element " << i;
      EXPECT_TRUE(sameBits(doubles[r][i], sumOf<double>(i)))
          << "rank " << r << " f64 element " << i;
    }
  }
}

TEST(ThreadCollectivesTest, AllGatherShardsCompletesEveryRank) {
  for (int elementBytes : {1, 2, 4}) {
    std::vector<std::vector<uint8_t>> held(kRanks);
    runThreadRanks(kRanks, [&](int rank, Collectives &job) {
      // The rank's shard holds its bytes, the rest garbage.
      std::vector<uint8_t> &bytes = held[rank];
      bytes.assign(kCount * elementBytes, uint8_t(0xee));
      ShardRange s = shardRange(kCount, rank, kRanks);
      for (int64_t i = s.begin * elementBytes; i < s.end * elementBytes; ++i)
        bytes[i] = uint8_t(i * 7 + 1);
      EXPECT_FALSE(job.allGatherShards(bytes.data(), kCount, elementBytes));
    });
    for (int r = 0; r < kRanks; ++r)
      for (int64_t i = 0; i < kCount * elementBytes; ++i)
        ASSERT_EQ(held[r][i], uint8_t(i * 7 + 1))
            << "rank " << r << ", " << elementBytes << "-byte elements, byte "
            << i;
  }
}

TEST(ThreadCollectivesTest, ReduceScatterShardsSumsEachRanksShard) {
  std::vector<std::vector<float>> held(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    held[rank] = valuesOf<float>(rank, kCount);
    EXPECT_FALSE(job.reduceScatterShards(held[rank]));
  });
  for (int r = 0; r < kRanks; ++r) {
    ShardRange s = shardRange(kCount, r, kRanks);
    for (int64_t i = s.begin; i < s.end; ++i)
      EXPECT_TRUE(sameBits(held[r][i], sumOf<float>(i)))
          << "rank " << r << " element " << i;
  }
}

TEST(ThreadCollectivesTest, GatherShardsToRank0WritesRank0Only) {
  std::vector<std::vector<float>> all(kRanks,
                                      std::vector<float>(kCount, -1.0f));
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    ShardRange s = shardRange(kCount, rank, kRanks);
    std::vector<float> mine(s.size());
    for (int64_t i = s.begin; i < s.end; ++i)
      mine[i - s.begin] = float(i);
    EXPECT_FALSE(job.gatherShardsToRank0(mine, kCount, all[rank].data()));
  });
  for (int64_t i = 0; i < kCount; ++i) {
    EXPECT_EQ(all[0][i], float(i)) << "element " << i;
    for (int r = 1; r < kRanks; ++r)
      EXPECT_EQ(all[r][i], -1.0f) << "rank " << r << " element " << i;
  }
}

TEST(ThreadCollectivesTest, StringsHostsAndBarrier) {
  std::vector<std::vector<std::string>> gathered(kRanks), hosts(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    EXPECT_EQ(job.rank(), rank);
    EXPECT_EQ(job.size(), kRanks);
    EXPECT_FALSE(job.barrier());
    llvm::Expected<std::vector<std::string>> all =
        job.allGather(std::string(rank, 'x'));
    ASSERT_TRUE(!!all) << llvm::toString(all.takeError());
    gathered[rank] = *all;
    llvm::Expected<const std::vector<std::string> &> h = job.hosts();
    ASSERT_TRUE(!!h) << llvm::toString(h.takeError());
    hosts[rank] = *h;
    EXPECT_FALSE(job.checkSame("the plan", "same"));
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(gathered[r], (std::vector<std::string>{"", "x", "xx"}));
    EXPECT_EQ(hosts[r], std::vector<std::string>(kRanks, "localhost"));
  }
}

TEST(ThreadCollectivesTest, RanksThatDisagreeFailAlike) {
  std::vector<std::string> errors(kRanks), sizes(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    std::vector<float> data(rank == 2 ? 5 : 4);
    errors[rank] =
        llvm::toString(rank == 1 ? job.barrier() : job.allReduceSum(data));
    // A shard of another size than the rank's.
    std::vector<float> mine(rank == 1 ? 1 : 0), all(kCount);
    sizes[rank] = llvm::toString(job.gatherShardsToRank0(
        llvm::ArrayRef<float>(mine), rank == 1 ? kCount : 0, all.data()));
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[r], "the ranks called different collectives (rank 0: "
                         "allreduce of 4 f32; rank 1: barrier; rank 2: "
                         "allreduce of 5 f32)");
    EXPECT_EQ(sizes[r].find("the ranks called different collectives (rank 0: "
                            "gather to rank 0 of 0 f32; rank 1: gather to "
                            "rank 0 of 100 f32"),
              0u)
        << sizes[r];
  }
}

TEST(ThreadCollectivesTest, AShardOfTheWrongSizeIsNamed) {
  std::vector<std::string> errors(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    std::vector<float> mine(shardRange(kCount, rank, kRanks).size() +
                            (rank == 2)),
        all(kCount);
    errors[rank] =
        llvm::toString(job.gatherShardsToRank0(mine, kCount, all.data()));
  });
  for (int r = 0; r < kRanks; ++r)
    EXPECT_EQ(errors[r], "gather to rank 0 of 100 f32: rank 2 gave 21 "
                         "elements for its shard of 20");
}

TEST(ThreadCollectivesTest, AnAbortOrAMissingRankFailsTheOthers) {
  std::vector<std::string> aborted(kRanks), missing(kRanks);
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    if (rank == 1)
      job.abort(7);
    else
      aborted[rank] = llvm::toString(job.barrier());
  });
  runThreadRanks(kRanks, [&](int rank, Collectives &job) {
    job.setTimeout(0.05);
    if (rank != 2)
      missing[rank] = llvm::toString(job.barrier());
  });
  for (int r : {0, 2})
    EXPECT_EQ(aborted[r], "rank 1 aborted the job (exit code 7)");
  // Whichever of ranks 0 and 1 timed out first names itself.
  for (int r : {0, 1})
    EXPECT_TRUE(missing[r] == "rank 0 waited 50 ms for the other ranks" ||
                missing[r] == "rank 1 waited 50 ms for the other ranks")
        << missing[r];
  std::vector<int> badBytes(1);
  runThreadRanks(1, [&](int, Collectives &job) {
    EXPECT_EQ(llvm::toString(job.allGatherShards(badBytes.data(), 1, 8)),
              "allGatherShards: 8-byte elements (1, 2 or 4)");
  });
}

} // namespace
