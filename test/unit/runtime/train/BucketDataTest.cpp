//===- BucketDataTest.cpp - Batches drawn over buckets --------------------===//
//
// The sampling policy of a run over buckets (docs/Runtime.md, "Buckets"):
// each batch's bucket with probability n_b / N, its samples within it, all
// from the one generator whose state a checkpoint holds. Against the
// policy itself: counts over many draws within a binomial tolerance, the
// batches re-derived here from the generator (one shape drawing no
// bucket, so its sequence is unchanged), and a state set back that
// continues bitwise.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/Testing/HostTestSupport.h"
#include "megaslide/runtime/host/Safetensors.h"

#include "llvm/Support/FormatVariadic.h"

#include "gtest/gtest.h"

#include <cmath>

using namespace megaslide;
using namespace megaslide::train;

namespace {

class BucketDataTest : public host::test::ScratchDirTest {
protected:
  /// Shapes of a tiny plan with batch 2: latents [2, 4, T, H, W].
  static InputShapes shapes(int64_t T, int64_t H, int64_t W) {
    InputShapes s;
    s.latents = {2, 4, T, H, W};
    s.timesteps = {2};
    s.condition = {2, 3, 5};
    return s;
  }
  /// A sample whose every latent is `value`, with its bucket's name as
  /// metadata unless `named` is false.
  void write(llvm::StringRef file, const InputShapes &s, llvm::StringRef bucket,
             float value, bool named = true) {
    std::vector<int64_t> shape(s.latents.begin() + 1, s.latents.end());
    std::vector<float> latents(4 * s.latents[2] * s.latents[3] * s.latents[4],
                               value);
    std::vector<float> condition(15, value);
    host::SafetensorsWriteOptions options;
    if (named)
      options.metadata["megaslide.bucket"] = bucket.str();
    llvm::Error e = host::writeSafetensors(
        path(file),
        {{"latents", shape, latents.data(), host::StDType::F32},
         {"condition", {3, 5}, condition.data(), host::StDType::F32}},
        options);
    ASSERT_FALSE(!!e) << llvm::toString(std::move(e));
  }
  /// 6 samples of bucket a (values 0..5) and 4 of bucket b (10..13).
  void writeTwoBuckets() {
    for (int k = 0; k < 6; ++k)
      write(llvm::formatv("a{0}.safetensors", k).str(), a, "5x16x16", k);
    for (int k = 0; k < 4; ++k)
      write(llvm::formatv("b{0}.safetensors", k).str(), b, "9x16x24", 10 + k,
            /*named=*/k % 2 == 0);
  }
  std::unique_ptr<FileData> open() {
    auto data = FileData::open(dir, {a, b}, {"5x16x16", "9x16x24"}, 42);
    if (!data) {
      ADD_FAILURE() << llvm::toString(data.takeError());
      return nullptr;
    }
    return std::move(*data);
  }
  InputShapes a = shapes(2, 2, 2), b = shapes(3, 2, 3);
};

TEST_F(BucketDataTest, BucketsAreDrawnInProportionToTheirSamples) {
  writeTwoBuckets();
  std::unique_ptr<FileData> data = open();
  ASSERT_TRUE(data);
  ASSERT_EQ(data->buckets().size(), 2u);
  EXPECT_EQ(data->buckets()[0].size(), 6u);
  EXPECT_EQ(data->buckets()[1].size(), 4u);
  constexpr int kDraws = 4000;
  int inA = 0;
  for (int k = 0; k < kDraws; ++k) {
    size_t bucket = 7;
    auto batch = data->next(&bucket);
    ASSERT_TRUE(!!batch) << llvm::toString(batch.takeError());
    ASSERT_LT(bucket, 2u);
    const InputShapes &s = bucket == 0 ? a : b;
    int64_t latent = 4 * s.latents[2] * s.latents[3] * s.latents[4];
    ASSERT_EQ((*batch)["latents"].size(), size_t(2 * latent));
    ASSERT_EQ((*batch)["noise"].size(), size_t(2 * latent));
    // Both samples of the batch are of its bucket.
    for (int64_t i = 0; i < 2; ++i) {
      float v = (*batch)["latents"][i * latent];
      EXPECT_TRUE(bucket == 0 ? v >= 0 && v <= 5 : v >= 10 && v <= 13) << v;
    }
    inA += bucket == 0;
  }
  // Binomial(4000, 0.6): standard deviation 31; 5 of them.
  double sd = std::sqrt(kDraws * 0.6 * 0.4);
  EXPECT_NEAR(inA, 0.6 * kDraws, 5 * sd);
}

TEST_F(BucketDataTest, StateAfterJumpsAsDrawingWould) {
  // A data-parallel rank jumps over the other ranks' batches: the state it
  // lands on must be the one drawing them would leave, for buckets of
  // different shapes and for one shape.
  writeTwoBuckets();
  for (bool bucketed : {true, false}) {
    std::unique_ptr<DataSource> data;
    if (bucketed)
      data = open();
    else
      data = std::make_unique<SyntheticData>(a, 42);
    ASSERT_TRUE(data);
    uint64_t start = data->state();
    for (int n = 1; n <= 9; ++n) {
      ASSERT_TRUE(!!data->next());
      EXPECT_EQ(data->stateAfter(start, n), data->state())
          << (bucketed ? "buckets, " : "one shape, ") << n << " batches";
    }
    EXPECT_EQ(data->stateAfter(start, 0), start);
  }
}

TEST_F(BucketDataTest, ASharedSourceHandsOutItsRanksBatches) {
  // Three ranks of two micro-batches a step: each hands out exactly its
  // batches of one sequence (the files' source reads ahead), and its
  // state() at each step boundary is the job's.
  writeTwoBuckets();
  constexpr int ranks = 3, perStep = 2, stepsRun = 3;
  std::unique_ptr<FileData> whole = open();
  ASSERT_TRUE(whole);
  std::vector<std::pair<size_t, exec::StepInputs>> sequence;
  std::vector<uint64_t> boundaries{whole->state()};
  for (int k = 0; k < ranks * perStep * stepsRun; ++k) {
    size_t bucket = 0;
    auto batch = whole->next(&bucket);
    ASSERT_TRUE(!!batch);
    sequence.push_back({bucket, std::move(*batch)});
    if ((k + 1) % (ranks * perStep) == 0)
      boundaries.push_back(whole->state());
  }
  for (int rank = 0; rank < ranks; ++rank) {
    std::unique_ptr<FileData> mine = open();
    ASSERT_TRUE(mine);
    mine->setShare(rank, ranks, perStep);
    EXPECT_EQ(mine->state(), boundaries[0]);
    for (int step = 0; step < stepsRun; ++step) {
      for (int k = 0; k < perStep; ++k) {
        size_t bucket = 0;
        auto batch = mine->next(&bucket);
        ASSERT_TRUE(!!batch);
        const auto &want = sequence[(step * ranks + rank) * perStep + k];
        EXPECT_EQ(bucket, want.first) << rank << " " << step << " " << k;
        EXPECT_EQ(*batch, want.second) << rank << " " << step << " " << k;
      }
      EXPECT_EQ(mine->state(), boundaries[step + 1]) << rank << " " << step;
    }
    // A resume at a boundary continues the rank's share.
    std::unique_ptr<FileData> resumed = open();
    ASSERT_TRUE(resumed);
    resumed->setShare(rank, ranks, perStep);
    resumed->setState(boundaries[2]);
    size_t bucket = 0;
    auto batch = resumed->next(&bucket);
    ASSERT_TRUE(!!batch);
    EXPECT_EQ(*batch, sequence[(2 * ranks + rank) * perStep].second) << rank;
  }
}

TEST_F(BucketDataTest, ASetStateContinuesTheSequenceBitwise) {
  writeTwoBuckets();
  std::unique_ptr<FileData> data = open();
  ASSERT_TRUE(data);
  std::vector<std::pair<size_t, exec::StepInputs>> first;
  uint64_t middle = 0;
  for (int k = 0; k < 12; ++k) {
    if (k == 6)
      middle = data->state();
    size_t bucket = 0;
    auto batch = data->next(&bucket);
    ASSERT_TRUE(!!batch);
    first.push_back({bucket, std::move(*batch)});
  }
  std::unique_ptr<FileData> resumed = open();
  ASSERT_TRUE(resumed);
  resumed->setState(middle);
  for (int k = 6; k < 12; ++k) {
    size_t bucket = 0;
    auto batch = resumed->next(&bucket);
    ASSERT_TRUE(!!batch);
    EXPECT_EQ(bucket, first[k].first) << k;
    EXPECT_EQ(*batch, first[k].second) << k; // float ==: bitwise here
  }
}

/// The batches the policy makes from `seed`, derived here from the
/// generator alone: (bucket, latents value of each sample, timesteps,
/// noise). `counts`: samples per bucket, bucket b's sample k holding the
/// value 10 b + k; one bucket draws none.
struct Drawn {
  size_t bucket;
  std::vector<float> values, timesteps, noise;
};
std::vector<Drawn> policy(uint64_t seed, std::vector<int64_t> counts,
                          std::vector<int64_t> latent, int batches) {
  Random rng(seed);
  int64_t total = 0;
  for (int64_t n : counts)
    total += n;
  std::vector<Drawn> out;
  for (int k = 0; k < batches; ++k) {
    Drawn d{0, {}, {}, {}};
    if (counts.size() > 1) {
      int64_t u = static_cast<int64_t>(rng.next() % total);
      while (u >= counts[d.bucket])
        u -= counts[d.bucket++];
    }
    for (int b = 0; b < 2; ++b) {
      d.values.push_back(10.0f * d.bucket + rng.next() % counts[d.bucket]);
      d.timesteps.push_back(static_cast<float>(rng.uniform()));
    }
    for (int64_t i = 0; i < 2 * latent[d.bucket]; ++i)
      d.noise.push_back(rng.normal());
    out.push_back(std::move(d));
  }
  return out;
}

/// What `data` hands out matches `expected` exactly.
void expectDraws(DataSource &data, const std::vector<Drawn> &expected,
                 std::vector<int64_t> latent) {
  for (size_t k = 0; k < expected.size(); ++k) {
    size_t bucket = 9;
    auto batch = data.next(&bucket);
    ASSERT_TRUE(!!batch) << llvm::toString(batch.takeError());
    const Drawn &e = expected[k];
    ASSERT_EQ(bucket, e.bucket) << k;
    EXPECT_EQ((*batch)["latents"][0], e.values[0]) << k;
    EXPECT_EQ((*batch)["latents"][latent[bucket]], e.values[1]) << k;
    EXPECT_EQ((*batch)["timesteps"], e.timesteps) << k;
    EXPECT_EQ((*batch)["noise"], e.noise) << k;
  }
}

TEST_F(BucketDataTest, BatchesAreThePolicysDrawsFromTheGenerator) {
  writeTwoBuckets(); // a: 0..5, b: 10..13
  std::unique_ptr<FileData> data = open();
  ASSERT_TRUE(data);
  std::vector<int64_t> latent = {4 * 2 * 2 * 2, 4 * 3 * 2 * 3};
  expectDraws(*data, policy(42, {6, 4}, latent, 40), latent);
}

TEST_F(BucketDataTest, OneShapeDrawsNoBucket) {
  for (int k = 0; k < 5; ++k)
    write(llvm::formatv("a{0}.safetensors", k).str(), a, "5x16x16", k);
  std::vector<int64_t> latent = {4 * 2 * 2 * 2};
  auto one = FileData::open(dir, a, 42);
  ASSERT_TRUE(!!one) << llvm::toString(one.takeError());
  expectDraws(**one, policy(42, {5}, latent, 20), latent);
  auto bucketed = FileData::open(dir, {a}, {"5x16x16"}, 42);
  ASSERT_TRUE(!!bucketed) << llvm::toString(bucketed.takeError());
  expectDraws(**bucketed, policy(42, {5}, latent, 20), latent);
}

TEST_F(BucketDataTest, ASampleInNoBucketIsNamed) {
  writeTwoBuckets();
  write("stray.safetensors", shapes(2, 2, 4), "", 0, /*named=*/false);
  auto data = FileData::open(dir, {a, b}, {"5x16x16", "9x16x24"}, 42);
  ASSERT_FALSE(!!data);
  std::string why = llvm::toString(data.takeError());
  EXPECT_NE(why.find("stray.safetensors': its latents [4, 2, 2, 4] are in "
                     "no bucket of this run: 5x16x16 (latents [4, 2, 2, 2]), "
                     "9x16x24 (latents [4, 3, 2, 3])"),
            std::string::npos)
      << why;
}

} // namespace
