//===- ModelConfigTest.cpp - Config parsing and video geometry ------------===//

#include "megaslide/Model/ModelConfig.h"

#include "gtest/gtest.h"

using namespace megaslide;

namespace {

std::string errorOf(llvm::StringRef json) {
  llvm::Expected<ModelConfig> c = parseModelConfig(json, "test.json");
  if (c)
    return "";
  return llvm::toString(c.takeError());
}

const char *kMinimalWan = R"({"num_layers": 2, "num_attention_heads": 4,
  "attention_head_dim": 16, "ffn_dim": 128, "in_channels": 16,
  "text_dim": 32})";

TEST(ModelConfig, ParsesDiffusersWanConfigWithDefaults) {
  llvm::Expected<ModelConfig> c = parseModelConfig(kMinimalWan, "t");
  ASSERT_TRUE(static_cast<bool>(c)) << llvm::toString(c.takeError());
  EXPECT_EQ(c->architecture, Architecture::Wan);
  EXPECT_EQ(c->dim(), 64);
  EXPECT_EQ(c->outChannels, 16);
  EXPECT_EQ(c->textLen, 512);
  EXPECT_EQ(c->vaeStride, (std::array<int64_t, 3>{4, 8, 8}));
}

TEST(ModelConfig, UnknownKeySuggestsTheNearestKnownOne) {
  std::string e = errorOf(R"({"num_layer": 2})");
  EXPECT_NE(e.find("config field 'num_layer'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'num_layers'"), std::string::npos) << e;
}

TEST(ModelConfig, HeadsMustDivideHiddenSize) {
  std::string e = errorOf(R"({"architecture": "dit", "hidden_size": 64,
    "num_heads": 5, "depth": 1, "mlp_ratio": 4.0, "in_channels": 4,
    "num_classes": 10})");
  EXPECT_NE(e.find("'num_attention_heads'"), std::string::npos) << e;
  EXPECT_NE(e.find("do not divide hidden_size 64"), std::string::npos) << e;
}

TEST(ModelConfig, NonPositiveSizesNameTheField) {
  std::string json = kMinimalWan;
  json.replace(json.find("\"ffn_dim\": 128"), 14, "\"ffn_dim\": -1");
  std::string e = errorOf(json);
  EXPECT_NE(e.find("'ffn_dim': must be a positive integer"), std::string::npos)
      << e;
}

TEST(ModelConfig, ImageConditioningIsRejected) {
  std::string json = kMinimalWan;
  json.insert(json.size() - 1, R"(, "image_dim": 1280)");
  EXPECT_NE(errorOf(json).find("'image_dim'"), std::string::npos);
}

TEST(ModelConfig, MalformedJsonIsOneClearError) {
  EXPECT_NE(errorOf("{").find("test.json: invalid JSON"), std::string::npos);
  EXPECT_NE(errorOf("[1]").find("must be a JSON object"), std::string::npos);
}

TEST(ModelConfig, UnknownPresetListsThePresets) {
  llvm::Expected<ModelConfig> c = loadModelConfig("nope");
  ASSERT_FALSE(static_cast<bool>(c));
  std::string e = llvm::toString(c.takeError());
  EXPECT_NE(e.find("unknown model preset 'nope'"), std::string::npos) << e;
  EXPECT_NE(e.find("megaslide-105b"), std::string::npos) << e;
}

TEST(ModelConfig, AllPresetsLoad) {
  std::vector<std::string> names = presetNames();
  EXPECT_EQ(names,
            (std::vector<std::string>{"dit-xl-2", "megaslide-105b", "tiny",
                                      "wan2.1-t2v-1.3b", "wan2.1-t2v-14b"}));
  for (const std::string &name : names) {
    llvm::Expected<ModelConfig> c = loadModelConfig(name);
    EXPECT_TRUE(static_cast<bool>(c))
        << name << ": " << llvm::toString(c.takeError());
  }
}

TEST(Geometry, WanVideoUsesTheCausalVaeStride) {
  llvm::Expected<ModelConfig> c = loadModelConfig("megaslide-105b");
  ASSERT_TRUE(static_cast<bool>(c));
  llvm::Expected<Geometry> g = computeGeometry(*c, {81, 720, 1280, false});
  ASSERT_TRUE(static_cast<bool>(g)) << llvm::toString(g.takeError());
  EXPECT_EQ(g->latent, (std::array<int64_t, 3>{21, 90, 160}));
  EXPECT_EQ(g->grid, (std::array<int64_t, 3>{21, 45, 80}));
  EXPECT_EQ(g->tokens(), 75600);
}

TEST(Geometry, IndivisibleSizesSuggestValidOnes) {
  llvm::Expected<ModelConfig> c = loadModelConfig("megaslide-105b");
  ASSERT_TRUE(static_cast<bool>(c));
  auto errorFor = [&](VideoShape v) {
    llvm::Expected<Geometry> g = computeGeometry(*c, v);
    return g ? std::string() : llvm::toString(g.takeError());
  };
  std::string frames = errorFor({80, 720, 1280, false});
  EXPECT_NE(frames.find("'frames'"), std::string::npos) << frames;
  EXPECT_NE(frames.find("use 77 or 81"), std::string::npos) << frames;
  std::string height = errorFor({81, 724, 1280, false});
  EXPECT_NE(height.find("'height'"), std::string::npos) << height;
  std::string patch = errorFor({81, 712, 1280, false});
  EXPECT_NE(patch.find("use 704 or 720"), std::string::npos) << patch;
  EXPECT_NE(errorFor({0, 720, 1280, false}).find("must be positive"),
            std::string::npos);
}

TEST(Geometry, LatentUnitsSkipTheVae) {
  llvm::Expected<ModelConfig> c = loadModelConfig("tiny");
  ASSERT_TRUE(static_cast<bool>(c));
  llvm::Expected<Geometry> g = computeGeometry(*c, {2, 4, 6, true});
  ASSERT_TRUE(static_cast<bool>(g));
  EXPECT_EQ(g->grid, (std::array<int64_t, 3>{2, 2, 3}));
}

} // namespace
