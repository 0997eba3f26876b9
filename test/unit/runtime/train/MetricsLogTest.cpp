//===- MetricsLogTest.cpp - One JSON line per optimizer step --------------===//

#include "megaslide/runtime/train/MetricsLog.h"

#include "llvm/Support/JSON.h"

#include <gtest/gtest.h>

#include <cmath>

using namespace megaslide::train;

namespace {

TEST(MetricsLogTest, ALineIsCompactJsonWithTheDigitsThatMatter) {
  MetricsRecord r;
  r.step = 7;
  r.loss = 0.123456789f;
  r.lr = 1e-4;
  r.gradNorm = 2.5;
  r.clipped = true;
  r.seconds = 0.25;
  r.samplesPerSecond = 4;
  r.tokensPerSecond = 1280;
  r.hostRssBytes = 1000;
  r.devicePeakBytes = 2000;
  EXPECT_EQ(metricsLine(r),
            "{\"step\":7,\"loss\":0.123456791,\"lr\":0.0001,\"grad_norm\":2.5,"
            "\"clipped\":true,\"skipped\":false,\"micro_batches\":1,"
            "\"seconds\":0.250000,\"samples_per_second\":4,"
            "\"tokens_per_second\":1280,\"host_rss_bytes\":1000,"
            "\"device_peak_bytes\":2000}");
}

TEST(MetricsLogTest, NonFiniteAndMissingNumbersAreNull) {
  MetricsRecord r;
  r.loss = NAN;
  r.gradNorm = INFINITY;
  r.valLoss = NAN;
  llvm::Expected<llvm::json::Value> v = llvm::json::parse(metricsLine(r));
  ASSERT_TRUE(static_cast<bool>(v)) << llvm::toString(v.takeError());
  const llvm::json::Object &o = *v->getAsObject();
  for (const char *key : {"loss", "lr", "grad_norm", "val_loss"})
    EXPECT_EQ(o.get(key)->kind(), llvm::json::Value::Null) << key;
}

TEST(MetricsLogTest, BucketNamesAreEscapedAndListedPerMicroBatch) {
  MetricsRecord r;
  r.buckets = {"17x\"480\"x832"};
  llvm::Expected<llvm::json::Value> one = llvm::json::parse(metricsLine(r));
  ASSERT_TRUE(static_cast<bool>(one)) << llvm::toString(one.takeError());
  EXPECT_EQ(one->getAsObject()->getString("bucket"), "17x\"480\"x832");
  r.buckets = {"a", "b"};
  r.lrDecaySteps = 40;
  llvm::Expected<llvm::json::Value> two = llvm::json::parse(metricsLine(r));
  ASSERT_TRUE(static_cast<bool>(two)) << llvm::toString(two.takeError());
  EXPECT_EQ(two->getAsObject()->getArray("bucket")->size(), 2u);
  EXPECT_EQ(two->getAsObject()->getInteger("lr_decay_steps"), 40);
}

TEST(MetricsLogTest, OptionsAreNamedAsTheCallerSpellsThem) {
  EXPECT_EQ(cliSpelling("checkpoint-dir"), "--checkpoint-dir");
  EXPECT_EQ(pythonSpelling("checkpoint-dir"), "checkpoint_dir=");
  EXPECT_EQ(pythonSpelling("resume"), "Trainer.resume()");
}

} // namespace
