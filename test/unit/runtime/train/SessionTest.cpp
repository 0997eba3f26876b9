//===- SessionTest.cpp - The training recipe's optimizer side -------------===//
//
// The deferred update against the streaming one (docs/Training.md): without
// clipping both apply the same AdamW to the same gradients, so the state
// after a few steps must be bitwise the same whichever applies them, and
// the EMA with it; clipping makes them differ. The recipe's numerics
// against an independent implementation are test/python/test_recipe.py's.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/Session.h"

#include "megaslide/Testing/TestPlans.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"

#include <gtest/gtest.h>

using namespace megaslide;

namespace {

std::unique_ptr<train::Session> session(bool deferred,
                                        const train::Recipe &recipe) {
  std::string why;
  const exec::ExecPlan *saved = savedTestPlan("tiny", why);
  if (!saved) {
    ADD_FAILURE() << why;
    return nullptr;
  }
  exec::ExecPlan plan = *saved;
  exec::setDeferredUpdates(plan, deferred);
  train::SessionOptions options;
  options.seed = 7;
  options.recipe = recipe;
  auto s = train::Session::create(std::move(plan), options);
  if (!s) {
    ADD_FAILURE() << llvm::toString(s.takeError());
    return nullptr;
  }
  EXPECT_EQ((*s)->deferredUpdates(), deferred);
  return std::move(*s);
}

/// Runs `steps` recipe steps; the state's tensors by name.
std::map<std::string, std::vector<float>> train3(train::Session &s, int steps) {
  for (int k = 0; k < steps; ++k) {
    auto r = s.trainStep(exec::StepOptions());
    EXPECT_TRUE(!!r) << llvm::toString(r.takeError());
    EXPECT_FALSE(r->result.skipped);
  }
  std::map<std::string, std::vector<float>> out;
  for (const host::HostTensor &t : s.state().tensors)
    out[t.param->name] = t.data;
  return out;
}

TEST(SessionTest, DeferredUpdateWithoutClippingIsTheStreamingOneBitwise) {
  train::Recipe recipe;
  recipe.lrSchedule = train::LrSchedule::WarmupCosine;
  recipe.warmupSteps = 1;
  recipe.decaySteps = 4;
  recipe.emaDecay = 0.9;
  auto deferred = session(true, recipe), streaming = session(false, recipe);
  ASSERT_TRUE(deferred && streaming);
  auto a = train3(*deferred, 4), b = train3(*streaming, 4);
  ASSERT_EQ(a.size(), b.size());
  int emas = 0;
  for (const auto &[name, values] : a) {
    EXPECT_EQ(values, b[name]) << name;
    emas += llvm::StringRef(name).ends_with(".ema");
  }
  EXPECT_GT(emas, 0);
  EXPECT_EQ(deferred->state().step, 4);
}

TEST(SessionTest, ExactClippingDiffersFromThePreviousNorms) {
  train::Recipe recipe;
  recipe.maxGradNorm = 0.1; // clips every step of the tiny task
  auto deferred = session(true, recipe), streaming = session(false, recipe);
  ASSERT_TRUE(deferred && streaming);
  auto a = train3(*deferred, 2), b = train3(*streaming, 2);
  int differ = 0;
  for (const auto &[name, values] : a)
    differ += values != b[name];
  EXPECT_GT(differ, 0) << "the first step clips only when deferred";
}

/// The error of a session over two buckets of `a` and `b`.
std::string bucketError(exec::ExecPlan a, exec::ExecPlan b) {
  std::vector<train::BucketPlan> plans;
  plans.push_back({"17x128x128", std::move(a), 0});
  plans.push_back({"17x128x64", std::move(b), 0});
  auto s = train::Session::create(std::move(plans), train::SessionOptions());
  if (s) {
    ADD_FAILURE() << "the session was made";
    return "";
  }
  return llvm::toString(s.takeError());
}

TEST(SessionTest, BucketPlansMustShareTheirParametersAndUpdate) {
  std::string why;
  const exec::ExecPlan *saved = savedTestPlan("tiny", why);
  ASSERT_TRUE(saved) << why;
  exec::ExecPlan renamed = *saved;
  std::string name = renamed.params[0].name;
  renamed.params[0].name += ".other";
  EXPECT_NE(bucketError(*saved, renamed)
                .find("the plans of bucket 17x128x128 and bucket 17x128x64 do "
                      "not share their parameters (parameter '" +
                      name + "'"),
            std::string::npos);
  exec::ExecPlan streaming = *saved, deferred = *saved;
  exec::setDeferredUpdates(streaming, false);
  exec::setDeferredUpdates(deferred, true);
  EXPECT_NE(bucketError(deferred, streaming)
                .find("differ in their update (deferred in one, streaming "
                      "in the other)"),
            std::string::npos);
  // Alike, they need sample files.
  EXPECT_NE(bucketError(deferred, deferred)
                .find("a run over buckets trains on sample files"),
            std::string::npos);
}

} // namespace
