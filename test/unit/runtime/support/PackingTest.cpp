//===- PackingTest.cpp - Best-fit packing against a naive checker ---------===//
//
// packSlices (runtime/support/Packing.cpp) is checked on many random slice
// sets against an independent quadratic checker: slices live at the same
// step never share a byte, offsets are aligned, the arena is exactly the
// highest aligned end, and no packing beats the peak of live bytes. Small
// hand cases pin the behaviours the algorithm promises (reuse, best fit,
// coalescing, growth from a free tail, zero-size slices).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/support/Packing.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace megaslide;

namespace {

/// Everything wrong with `p` as a packing of `slices`, one line each; empty
/// when valid. Independent of the solver: every pair, every step.
std::string violations(const std::vector<Slice> &slices, const Packing &p,
                       int64_t alignment) {
  std::ostringstream out;
  if (p.offsets.size() != slices.size()) {
    out << p.offsets.size() << " offsets for " << slices.size() << " slices\n";
    return out.str();
  }
  int64_t highestEnd = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    int64_t size = alignTo(slices[i].size, alignment);
    if (p.offsets[i] < 0 || p.offsets[i] % alignment != 0)
      out << "slice " << i << " offset " << p.offsets[i] << " not aligned\n";
    if (size > 0)
      highestEnd = std::max(highestEnd, p.offsets[i] + size);
  }
  if (p.arenaSize != highestEnd)
    out << "arena " << p.arenaSize << " but highest aligned end " << highestEnd
        << "\n";
  for (size_t i = 0; i < slices.size(); ++i)
    for (size_t j = i + 1; j < slices.size(); ++j) {
      const Slice &a = slices[i], &b = slices[j];
      if (a.size == 0 || b.size == 0)
        continue;
      bool liveTogether = a.start <= b.end && b.start <= a.end;
      int64_t aEnd = p.offsets[i] + alignTo(a.size, alignment);
      int64_t bEnd = p.offsets[j] + alignTo(b.size, alignment);
      bool shareBytes = p.offsets[i] < bEnd && p.offsets[j] < aEnd;
      if (liveTogether && shareBytes)
        out << "slices " << i << " [" << a.start << "," << a.end << "] @"
            << p.offsets[i] << " and " << j << " [" << b.start << "," << b.end
            << "] @" << p.offsets[j] << " overlap\n";
    }
  return out.str();
}

/// The most aligned bytes live at one step, by brute force over steps.
int64_t naivePeak(const std::vector<Slice> &slices, int64_t alignment) {
  int64_t last = 0, peak = 0;
  for (const Slice &s : slices)
    last = std::max(last, s.end);
  for (int64_t t = 0; t <= last; ++t) {
    int64_t live = 0;
    for (const Slice &s : slices)
      if (s.start <= t && t <= s.end)
        live += alignTo(s.size, alignment);
    peak = std::max(peak, live);
  }
  return peak;
}

std::vector<Slice> randomSlices(std::mt19937_64 &rng, int count, int steps,
                                int64_t maxSize, bool allowZero) {
  std::uniform_int_distribution<int64_t> size(allowZero ? 0 : 1, maxSize);
  std::uniform_int_distribution<int64_t> start(0, steps - 1);
  std::uniform_int_distribution<int64_t> length(0, steps / 3);
  std::vector<Slice> slices;
  for (int i = 0; i < count; ++i) {
    int64_t s = start(rng);
    slices.push_back(
        {size(rng), s, std::min<int64_t>(steps - 1, s + length(rng))});
  }
  return slices;
}

std::string describe(const std::vector<Slice> &slices) {
  std::ostringstream out;
  for (const Slice &s : slices)
    out << "{" << s.size << ", " << s.start << ", " << s.end << "} ";
  return out.str();
}

TEST(PackingChecker, CatchesWhatItLooksFor) {
  // The checker itself: a valid packing passes, each kind of mistake fails.
  std::vector<Slice> slices = {{256, 0, 2}, {256, 2, 3}, {256, 3, 4}};
  EXPECT_EQ(violations(slices, Packing{{0, 256, 0}, 512}, 256), "");
  EXPECT_NE(violations(slices, Packing{{0, 0, 256}, 512}, 256),
            ""); // live at 2
  EXPECT_NE(violations(slices, Packing{{0, 255, 0}, 511}, 256),
            ""); // misaligned
  EXPECT_NE(violations(slices, Packing{{0, 256, 0}, 768}, 256), ""); // arena
  EXPECT_NE(violations(slices, Packing{{0, 256}, 512}, 256), "");    // count
  EXPECT_EQ(naivePeak(slices, 256), 512);
}

struct RandomCase {
  uint64_t seed;
  int count;
  int steps;
  int64_t maxSize;
  int64_t alignment;
  bool allowZero;
};

class PackingRandomTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(PackingRandomTest, ValidAgainstNaiveChecker) {
  const RandomCase &c = GetParam();
  std::mt19937_64 rng(c.seed);
  for (int round = 0; round < 200; ++round) {
    std::vector<Slice> slices =
        randomSlices(rng, c.count, c.steps, c.maxSize, c.allowZero);
    Packing p = packSlices(slices, c.alignment);
    std::string bad = violations(slices, p, c.alignment);
    ASSERT_TRUE(bad.empty()) << "seed " << c.seed << " round " << round << "\n"
                             << bad << describe(slices);
    int64_t peak = naivePeak(slices, c.alignment);
    ASSERT_EQ(peakLiveBytes(slices, c.alignment), peak)
        << "seed " << c.seed << " round " << round << "\n"
        << describe(slices);
    ASSERT_GE(p.arenaSize, peak) << describe(slices);
    // Deterministic: the same problem packs the same way.
    Packing again = packSlices(slices, c.alignment);
    ASSERT_EQ(again.offsets, p.offsets);
    ASSERT_EQ(again.arenaSize, p.arenaSize);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, PackingRandomTest,
    ::testing::Values(
        // Few long-lived slices, byte-sized (heavy rounding to alignment).
        RandomCase{1, 8, 10, 300, 256, false},
        // Many short-lived slices: lots of freeing, reuse and coalescing.
        RandomCase{2, 60, 40, 4096, 256, false},
        RandomCase{3, 120, 200, 1 << 20, 256, false},
        // Sizes already multiples of a small alignment; zero sizes mixed in.
        RandomCase{4, 50, 30, 64, 1, true},
        RandomCase{5, 80, 25, 10000, 512, true},
        // Everything starting at the same few steps (ties in start order).
        RandomCase{6, 40, 3, 2048, 256, false},
        RandomCase{7, 200, 500, 1 << 16, 4096, true}),
    [](const ::testing::TestParamInfo<RandomCase> &info) {
      return "seed" + std::to_string(info.param.seed);
    });

//===----------------------------------------------------------------------===//
// Hand cases
//===----------------------------------------------------------------------===//

TEST(Packing, EmptyProblemHasEmptyArena) {
  Packing p = packSlices({}, 256);
  EXPECT_TRUE(p.offsets.empty());
  EXPECT_EQ(p.arenaSize, 0);
  EXPECT_EQ(peakLiveBytes({}, 256), 0);
}

TEST(Packing, DisjointLifetimesReuseOffsetZero) {
  // Each slice dies before the next starts: all at 0, the arena is the
  // largest aligned slice.
  std::vector<Slice> slices = {{1000, 0, 1}, {300, 2, 3}, {1024, 4, 4}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(p.arenaSize, 1024);
  EXPECT_EQ(peakLiveBytes(slices, 256), 1024);
}

TEST(Packing, EndsAreInclusive) {
  // The second slice starts at the step the first one ends: live together.
  std::vector<Slice> slices = {{256, 0, 2}, {256, 2, 3}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 256}));
  EXPECT_EQ(p.arenaSize, 512);
  EXPECT_EQ(peakLiveBytes(slices, 256), 512);
}

TEST(Packing, SameStartPlacesLargestFirst) {
  std::vector<Slice> slices = {{256, 0, 5}, {1024, 0, 5}, {512, 0, 5}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{1536, 0, 1024}));
  EXPECT_EQ(p.arenaSize, 1792);
}

TEST(Packing, BestFitPrefersTheSmallestHole) {
  // Holes of 1024 at 0 and of 256 at 1280 open at step 3; a 256-byte slice
  // takes the small one, leaving the large hole for the 1024-byte slice.
  std::vector<Slice> slices = {
      {1024, 0, 2}, // hole [0, 1024)
      {256, 0, 9},  // pinned at 1024
      {256, 0, 2},  // hole [1280, 1536)
      {256, 0, 9},  // pinned at 1536: the arena top is 1792
      {256, 3, 9},  // best fit -> 1280
      {1024, 4, 9}, // the 1024 hole -> 0
  };
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 1024, 1280, 1536, 1280, 0}));
  EXPECT_EQ(p.arenaSize, 1792);
  EXPECT_EQ(peakLiveBytes(slices, 256), 1792);
}

TEST(Packing, FreedNeighboursCoalesce) {
  // Three adjacent 256-byte slices die; a 768-byte slice fits only in
  // their union, so it goes to offset 0 and the arena does not grow.
  std::vector<Slice> slices = {
      {256, 0, 1}, {256, 0, 1}, {256, 0, 1}, {256, 0, 5}, {768, 2, 5}};
  Packing p = packSlices(slices, 256);
  // Same start and size: index order.
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 256, 512, 768, 0}));
  EXPECT_EQ(p.arenaSize, 1024);
}

TEST(Packing, CoalescesWithBothNeighbours) {
  // The outer slices die first (two separate holes), the middle one last:
  // freeing it must merge the hole before and the hole after into one.
  std::vector<Slice> slices = {
      {256, 0, 1}, {256, 0, 3}, {256, 0, 2}, {256, 0, 9}, {768, 4, 9}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 256, 512, 768, 0}));
  EXPECT_EQ(p.arenaSize, 1024);
}

TEST(Packing, GrowsFromAFreeTail) {
  // [512, 1024) is free at the top when a 1024-byte slice arrives: it
  // starts there (not at 1024), so the arena is 1536, not 2048.
  std::vector<Slice> slices = {{512, 0, 9}, {512, 0, 1}, {1024, 2, 9}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 512, 512}));
  EXPECT_EQ(p.arenaSize, 1536);
  EXPECT_EQ(peakLiveBytes(slices, 256), 1536);
}

TEST(Packing, ZeroSizeSlicesTakeNoSpace) {
  std::vector<Slice> slices = {{0, 0, 9}, {256, 0, 9}, {0, 3, 4}, {256, 5, 9}};
  Packing p = packSlices(slices, 256);
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 0, 0, 256}));
  EXPECT_EQ(p.arenaSize, 512);
  EXPECT_EQ(peakLiveBytes(slices, 256), 512);
  // Only zero sizes: nothing to allocate.
  Packing none = packSlices({{0, 0, 1}, {0, 1, 2}}, 256);
  EXPECT_EQ(none.arenaSize, 0);
}

TEST(Packing, SizesRoundUpToTheAlignment) {
  std::vector<Slice> slices = {{1, 0, 3}, {257, 0, 3}, {256, 0, 3}};
  Packing p = packSlices(slices, 256);
  // Same start: larger requested size first (257 -> 0, taking 512 bytes;
  // 256 -> 512; 1 -> 768), each rounded up to 256.
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{768, 0, 512}));
  EXPECT_EQ(p.arenaSize, 1024);
  EXPECT_EQ(peakLiveBytes(slices, 256), 1024);
  EXPECT_EQ(alignTo(0, 256), 0);
  EXPECT_EQ(alignTo(1, 256), 256);
  EXPECT_EQ(alignTo(256, 256), 256);
  EXPECT_EQ(alignTo(7, 1), 7);
}

TEST(Packing, PeakFreesBeforeAllocatingAtTheSameStep) {
  // One slice ends at 1, the next starts at 2: never both live.
  EXPECT_EQ(peakLiveBytes({{512, 0, 1}, {512, 2, 3}}, 256), 512);
  // Overlapping by one step: both live at step 1.
  EXPECT_EQ(peakLiveBytes({{512, 0, 1}, {512, 1, 3}}, 256), 1024);
}

} // namespace
