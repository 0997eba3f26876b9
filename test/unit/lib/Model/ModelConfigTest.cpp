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

/// kMinimalWan made image-conditioned (Wan 2.1 I2V's keys) with `extra`
/// keys appended, which override earlier ones as JSON's last value wins.
std::string imageConfig(llvm::StringRef extra) {
  std::string json = kMinimalWan;
  json.replace(json.find("\"in_channels\": 16"), 17, "\"in_channels\": 36");
  json.insert(json.size() - 1, R"(, "image_dim": 1280,
    "added_kv_proj_dim": 64, "out_channels": 16)");
  if (!extra.empty())
    json.insert(json.size() - 1, ", " + extra.str());
  return json;
}

TEST(ModelConfig, ImageConditioningParsesAsDiffusersBuildsIt) {
  llvm::Expected<ModelConfig> i2v = parseModelConfig(imageConfig(""), "t");
  ASSERT_TRUE(static_cast<bool>(i2v)) << llvm::toString(i2v.takeError());
  EXPECT_EQ(i2v->imageDim, 1280);
  EXPECT_EQ(i2v->imageLen, 257); // one CLIP ViT-H/14 image
  EXPECT_FALSE(i2v->imagePosEmbed);
  EXPECT_EQ(i2v->latentChannels(), 16);
  EXPECT_EQ(i2v->imageConditionChannels(), 20);
  llvm::Expected<ModelConfig> flf2v =
      parseModelConfig(imageConfig(R"("pos_embed_seq_len": 514)"), "t");
  ASSERT_TRUE(static_cast<bool>(flf2v)) << llvm::toString(flf2v.takeError());
  EXPECT_EQ(flf2v->imageLen, 514);
  EXPECT_TRUE(flf2v->imagePosEmbed);
  // diffusers' null for a text-to-video model.
  std::string t2v = kMinimalWan;
  t2v.insert(t2v.size() - 1, R"(, "image_dim": null,
    "added_kv_proj_dim": null, "pos_embed_seq_len": null)");
  llvm::Expected<ModelConfig> plain = parseModelConfig(t2v, "t");
  ASSERT_TRUE(static_cast<bool>(plain)) << llvm::toString(plain.takeError());
  EXPECT_EQ(plain->imageDim, 0);
  EXPECT_EQ(plain->latentChannels(), 16);
}

TEST(ModelConfig, ImageConditioningErrorsNameTheField) {
  struct Case {
    std::string json;
    const char *expected;
  };
  std::string noImage = kMinimalWan;
  noImage.insert(noImage.size() - 1, R"(, "added_kv_proj_dim": 64)");
  const Case cases[] = {
      {noImage, "'added_kv_proj_dim': needs image conditioning: give "
                "image_dim"},
      {imageConfig(R"("added_kv_proj_dim": 32)"),
       "'added_kv_proj_dim': 32 differs from the model dim 64"},
      {imageConfig(R"("in_channels": 32)"),
       "'in_channels': 32, but image conditioning takes the latents "
       "(out_channels 16), a mask of vae_stride[0] = 4 channels and the "
       "conditioning frames' latents (16): 36"},
      {imageConfig(R"("text_len": 226)"),
       "'text_len': 226, but diffusers' Wan attention takes the last 512 "
       "context tokens"},
      {imageConfig(R"("pos_embed_seq_len": 514, "image_len": 257)"),
       "'image_len': 257 differs from pos_embed_seq_len 514"},
      {imageConfig(R"("image_dim": 0)"),
       "'image_dim': must be a positive integer"},
      {imageConfig(R"("image_dim": "big")"), "'image_dim'"},
  };
  for (const Case &c : cases) {
    std::string e = errorOf(c.json);
    EXPECT_NE(e.find(c.expected), std::string::npos)
        << "expected: " << c.expected << "\ngot: " << e;
  }
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
  EXPECT_EQ(names, (std::vector<std::string>{
                       "dit-xl-2", "megaslide-105b", "tiny", "wan2.1-flf2v-14b",
                       "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p",
                       "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-i2v-a14b",
                       "wan2.2-t2v-a14b", "wan2.2-ti2v-5b"}));
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
