//===- TwoExpertsTest.cpp - Wan 2.2's two experts in one run --------------===//
//
// docs/Training.md, "Two experts in one run": each step's expert is drawn
// so that each gets the distribution's mass on its side of the boundary,
// its times stay in its range, and a step leaves the other expert's state
// bitwise as it was.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/Session.h"

#include "megaslide/Testing/TestPlans.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"

#include <gtest/gtest.h>

using namespace megaslide;

namespace {

train::Recipe wanRecipe() {
  train::Recipe r;
  r.timesteps = train::TimestepSampling::LogitNormal;
  r.flowShift = 3;
  r.boundary = 0.875;
  return r;
}

TEST(TwoExpertsTest, EachExpertGetsItsSidesMassAndTimesInItsRange) {
  train::Recipe r = wanRecipe();
  train::Recipe whole = r;
  whole.boundary = 0;
  const int64_t steps = 20000;
  // The mass of [boundary, 1) under the whole distribution.
  std::vector<float> all = train::sampleSigmas(whole, 3, 0, steps);
  double mass = 0;
  for (float t : all)
    mass += t >= r.boundary;
  mass /= double(steps);
  int64_t high = 0;
  for (int64_t s = 0; s < steps; ++s) {
    int64_t e = train::stepExpert(r, 11, s);
    high += e == 0;
    train::Recipe own = train::expertRecipe(r, e);
    for (float t : train::sampleSigmas(own, 11, s, 4)) {
      if (e == 0)
        ASSERT_TRUE(t >= 0.875f && t < 1.0f) << t << " at step " << s;
      else
        ASSERT_TRUE(t >= 0.0f && t < 0.875f) << t << " at step " << s;
    }
  }
  // Binomial: 5 standard deviations of the share over `steps` steps.
  double share = double(high) / double(steps);
  double sd = std::sqrt(mass * (1 - mass) / double(steps));
  EXPECT_NEAR(share, mass, 5 * sd * std::sqrt(2.0))
      << "high-noise steps " << high;
  EXPECT_GT(mass, 0.2); // the shift puts much of the mass at high noise
}

/// Both experts' tensors, by expert, then name.
std::vector<std::map<std::string, std::vector<float>>>
snapshot(train::Session &s) {
  std::vector<std::map<std::string, std::vector<float>>> out;
  for (int64_t e = 0; e < s.numExperts(); ++e) {
    auto &one = out.emplace_back();
    for (const host::HostTensor &t : s.expertState(e).tensors)
      one[t.param->name] = t.data;
  }
  return out;
}

void onlyTheSteppingExpertChanges(bool deferred) {
  std::string why;
  const exec::ExecPlan *saved = savedTestPlan("tiny", why);
  ASSERT_TRUE(saved) << why;
  exec::ExecPlan plan = *saved;
  exec::setDeferredUpdates(plan, deferred);
  train::SessionOptions options;
  options.seed = 5;
  options.recipe = wanRecipe();
  options.recipe.boundary = 0.75; // the shifted median: both experts step
  options.recipe.emaDecay = 0.9;
  auto created = train::Session::create(std::move(plan), options);
  ASSERT_TRUE(!!created) << llvm::toString(created.takeError());
  train::Session &s = **created;
  ASSERT_EQ(s.numExperts(), 2);
  std::vector<int64_t> stepsOf(2, 0);
  for (int k = 0; k < 8; ++k) {
    auto before = snapshot(s);
    auto r = s.trainStep(exec::StepOptions());
    ASSERT_TRUE(!!r) << llvm::toString(r.takeError());
    ASSERT_TRUE(r->expert.has_value());
    int64_t e = *r->expert, other = 1 - e;
    ++stepsOf[e];
    auto after = snapshot(s);
    EXPECT_EQ(after[other], before[other]) << "step " << k + 1;
    EXPECT_NE(after[e], before[e]) << "step " << k + 1;
    // Each expert counts its own steps (its AdamW bias correction).
    EXPECT_EQ(s.expertState(e).step, stepsOf[e]);
    EXPECT_EQ(s.step(), k + 1);
  }
  EXPECT_GT(stepsOf[0], 0);
  EXPECT_GT(stepsOf[1], 0);
}

TEST(TwoExpertsTest, AStepLeavesTheOtherExpertBitwiseDeferred) {
  onlyTheSteppingExpertChanges(true);
}

TEST(TwoExpertsTest, AStepLeavesTheOtherExpertBitwiseStreaming) {
  onlyTheSteppingExpertChanges(false);
}

} // namespace
