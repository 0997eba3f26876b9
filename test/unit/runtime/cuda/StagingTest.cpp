//===- StagingTest.cpp - The weight-staging ring and thread ---------------===//

#include "megaslide/runtime/cuda/Staging.h"
#include "megaslide/runtime/cpu/HalfFloat.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>

using namespace megaslide;
using namespace megaslide::cuda;

namespace {

TEST(StagingRingTest, PlacesAtTheHeadAndWrapsPastTheOldest) {
  StagingRing ring(10);
  EXPECT_EQ(ring.place(4, 0), 0);
  EXPECT_EQ(ring.place(4, 1), 4);
  EXPECT_EQ(ring.place(4, 2), std::nullopt); // 2 bytes left at the end
  ring.releaseOldest();                       // [0, 4) free
  EXPECT_EQ(ring.oldest(), 1);
  EXPECT_EQ(ring.place(4, 2), 0); // wraps
  // Wrapped: in use [4, 8) and [0, 4); nothing fits between.
  EXPECT_EQ(ring.place(1, 3), std::nullopt);
  ring.releaseOldest(); // [4, 10) free, 2 in use at [0, 4)
  EXPECT_EQ(ring.place(6, 3), 4);
  EXPECT_EQ(ring.place(1, 4), std::nullopt);
  ring.releaseOldest();
  ring.releaseOldest();
  EXPECT_TRUE(ring.empty());
  EXPECT_EQ(ring.place(10, 5), 0); // empty: the whole ring
}

TEST(StagingRingTest, NeverHandsOutBytesInUse) {
  // Random sizes through a small ring: no two regions in use overlap and
  // each lies inside the ring.
  StagingRing ring(1000);
  std::vector<std::pair<int64_t, int64_t>> used; // oldest first
  uint32_t seed = 7;
  for (int64_t owner = 0; owner < 5000; ++owner) {
    seed = seed * 1664525u + 1013904223u;
    int64_t bytes = 1 + (seed >> 8) % 400;
    std::optional<int64_t> at;
    while (!(at = ring.place(bytes, owner))) {
      ASSERT_FALSE(ring.empty());
      ring.releaseOldest();
      used.erase(used.begin());
    }
    ASSERT_GE(*at, 0);
    ASSERT_LE(*at + bytes, 1000);
    for (auto [o, b] : used)
      ASSERT_TRUE(*at + bytes <= o || o + b <= *at)
          << "[" << *at << ", " << *at + bytes << ") overlaps [" << o << ", "
          << o + b << ")";
    used.push_back({*at, bytes});
  }
}

/// The thread casts in program order into the ring, reuses a region only
/// after its copy completed, casts an updated master only once released,
/// and stops at the first failing copy wait.
TEST(WeightStagerTest, CastsAheadWithinTheRingAndStops) {
  constexpr int64_t kCount = 4096; // 8 KiB in bf16: two per 16 KiB ring
  std::vector<std::vector<float>> masters(6, std::vector<float>(kCount));
  for (size_t j = 0; j < masters.size(); ++j)
    std::iota(masters[j].begin(), masters[j].end(), float(j * kCount));
  std::vector<uint8_t> ring(16384);
  std::atomic<int64_t> completedCopies{0};
  std::atomic<int64_t> failAt{-1};
  WeightStager stager;
  stager.start([] {}, ring.data(), ring.size(), [&](int64_t k) -> std::string {
    if (k == failAt)
      return "copy " + std::to_string(k) + " failed";
    EXPECT_LT(k, completedCopies.load()) << "waited for a copy not issued";
    return {};
  });
  for (int round = 0; round < 2; ++round) {
    std::vector<WeightStager::Job> jobs;
    for (size_t j = 0; j < masters.size(); ++j)
      jobs.push_back({masters[j].data(), kCount, exec::DType::BF16, j == 3, {}});
    stager.begin(jobs);
    for (int64_t k = 0; k < 6; ++k) {
      if (k == 3)
        stager.release(k);
      uint8_t *staged = stager.staged(k);
      ASSERT_NE(staged, nullptr);
      EXPECT_EQ(staged, ring.data() + (k % 2) * 8192) << k;
      const uint16_t *bits = reinterpret_cast<const uint16_t *>(staged);
      for (int64_t e : {int64_t(0), int64_t(255), kCount - 1})
        EXPECT_EQ(cpu::bf16ToFloat(bits[e]),
                  cpu::bf16ToFloat(cpu::floatToBf16(masters[k][e])));
      completedCopies = k + 1; // "the copy ran"
      stager.copyIssued(k);
    }
    stager.stop();
    stager.finish();
    EXPECT_EQ(stager.error(), "");
    completedCopies = 0;
  }
  // A failing wait stops the step: job 3 never gets bytes.
  failAt = 1;
  std::vector<WeightStager::Job> jobs;
  for (size_t j = 0; j < 4; ++j)
    jobs.push_back({masters[j].data(), kCount, exec::DType::BF16, false, {}});
  stager.begin(jobs);
  for (int64_t k = 0; k < 2; ++k) {
    ASSERT_NE(stager.staged(k), nullptr);
    completedCopies = k + 1;
    stager.copyIssued(k);
  }
  EXPECT_NE(stager.staged(2), nullptr); // placed after job 0's copy
  stager.copyIssued(2);
  EXPECT_EQ(stager.staged(3), nullptr); // needs job 1's, which failed
  EXPECT_EQ(stager.error(), "copy 1 failed");
  stager.stop();
  stager.finish();
  stager.shutdown();
}

} // namespace
