//===- ModelConfig.cpp - Parse and validate DiT model configs -------------===//

#include "megaslide/Model/ModelConfig.h"

#include <cmath>

#include "megaslide/Support/EmbeddedFile.h"
#include "megaslide/runtime/plan/HyperParameters.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"

#include <functional>

using namespace megaslide;
using llvm::Error;
using llvm::Expected;
using llvm::StringRef;

namespace {

/// The built-in presets, generated from configs/*.json by CMake.
const EmbeddedFile kPresets[] = {
#include "megaslide/Model/Presets.inc"
};

/// Builds the single-line error every config problem ends in.
class ConfigError {
public:
  explicit ConfigError(StringRef source) : source(source.str()) {}
  Error field(StringRef key, const llvm::Twine &problem) const {
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   llvm::formatv("{0}: config field '{1}': {2}",
                                                 source, key, problem.str())
                                       .str());
  }

private:
  std::string source;
};

/// Reads the fields of one JSON object into a ModelConfig.
class ConfigReader {
public:
  ConfigReader(const ConfigError &err) : err(err) {}

  Expected<ModelConfig> read(const llvm::json::Object &obj);

private:
  using Handler = std::function<Error(const llvm::json::Value &)>;

  Error integer(StringRef key, const llvm::json::Value &v, int64_t &out) {
    std::optional<int64_t> i = v.getAsInteger();
    if (!i)
      return err.field(key, "expected an integer");
    out = *i;
    return Error::success();
  }
  Error number(StringRef key, const llvm::json::Value &v, double &out) {
    std::optional<double> d = v.getAsNumber();
    if (!d)
      return err.field(key, "expected a number");
    // llvm::json reads 1e999 as infinity.
    if (!std::isfinite(*d))
      return err.field(key, "expected a finite number");
    out = *d;
    return Error::success();
  }
  Error boolean(StringRef key, const llvm::json::Value &v, bool &out) {
    std::optional<bool> b = v.getAsBoolean();
    if (!b)
      return err.field(key, "expected true or false");
    out = *b;
    return Error::success();
  }
  /// An integer n (meaning (1, n, n) for patches) or a list of three.
  Error triple(StringRef key, const llvm::json::Value &v,
               std::array<int64_t, 3> &out, bool scalarIsSpatial) {
    if (std::optional<int64_t> i = v.getAsInteger()) {
      out = {scalarIsSpatial ? 1 : *i, *i, *i};
      return Error::success();
    }
    const llvm::json::Array *a = v.getAsArray();
    if (!a || a->size() != 3)
      return err.field(key, "expected an integer or a list [t, h, w]");
    for (int i = 0; i < 3; ++i)
      if (Error e = integer(key, (*a)[i], out[i]))
        return e;
    return Error::success();
  }
  Error validate(ModelConfig &c);
  Error validateImageConditioning(ModelConfig &c);
  Error validateVaeStride(const ModelConfig &c);

  const ConfigError &err;
  // Values whose meaning depends on other keys, resolved after reading.
  std::optional<int64_t> hiddenSize, headDim, outChannels;
  /// Image conditioning: null and absent keys stay unset.
  std::optional<int64_t> imageDim, addedKvProjDim, posEmbedSeqLen, imageLen;
  std::optional<double> mlpRatio;
  std::optional<bool> learnSigma;
  std::optional<std::string> architecture, className;
  bool strideGiven = false;
};

Expected<ModelConfig> ConfigReader::read(const llvm::json::Object &obj) {
  ModelConfig c;
  std::optional<int64_t> textLen, freqDim;
  std::optional<std::array<int64_t, 3>> vaeStride;
  llvm::StringMap<Handler> handlers;
  auto intField = [&](StringRef key, int64_t &out) {
    handlers[key] = [&, key](const llvm::json::Value &v) -> Error {
      return integer(key, v, out);
    };
  };
  auto optIntField = [&](StringRef key, std::optional<int64_t> &out) {
    handlers[key] = [&, key](const llvm::json::Value &v) -> Error {
      int64_t i = 0;
      if (Error e = integer(key, v, i))
        return e;
      out = i;
      return Error::success();
    };
  };
  auto stringField = [&](StringRef key, std::optional<std::string> &out) {
    handlers[key] = [&, key](const llvm::json::Value &v) -> Error {
      std::optional<StringRef> s = v.getAsString();
      if (!s)
        return err.field(key, "expected a string");
      out = s->str();
      return Error::success();
    };
  };

  std::optional<std::string> name;
  stringField("name", name);
  stringField("architecture", architecture);
  stringField("_class_name", className);
  // Bookkeeping diffusers writes into a config.json it saves (a loaded
  // model's folder, the defaults it filled in); the model does not depend
  // on it.
  for (StringRef key : {"_diffusers_version", "_name_or_path",
                        "_use_default_values"})
    handlers[key] = [](const llvm::json::Value &) -> Error {
      return Error::success();
    };
  // What a run recorded about its attention in the config.json it saved
  // (docs/Runtime.md, "Weights"); the model does not depend on it, and the
  // next save writes its own.
  handlers["_megaslide"] = [&](const llvm::json::Value &v) -> Error {
    if (!v.getAsObject())
      return err.field("_megaslide", "must be an object (what "
                                     "--save-weights records)");
    return Error::success();
  };
  intField("num_layers", c.numLayers);
  handlers["depth"] = handlers["num_layers"];
  intField("num_attention_heads", c.numHeads);
  handlers["num_heads"] = handlers["num_attention_heads"];
  optIntField("attention_head_dim", headDim);
  optIntField("hidden_size", hiddenSize);
  intField("ffn_dim", c.ffnDim);
  handlers["mlp_ratio"] = [&](const llvm::json::Value &v) -> Error {
    double r = 0;
    if (Error e = number("mlp_ratio", v, r))
      return e;
    mlpRatio = r;
    return Error::success();
  };
  intField("in_channels", c.inChannels);
  optIntField("out_channels", outChannels);
  handlers["learn_sigma"] = [&](const llvm::json::Value &v) -> Error {
    bool b = false;
    if (Error e = boolean("learn_sigma", v, b))
      return e;
    learnSigma = b;
    return Error::success();
  };
  handlers["patch_size"] = [&](const llvm::json::Value &v) -> Error {
    return triple("patch_size", v, c.patch, /*scalarIsSpatial=*/true);
  };
  handlers["vae_stride"] = [&](const llvm::json::Value &v) -> Error {
    std::array<int64_t, 3> s = {};
    if (Error e = triple("vae_stride", v, s, /*scalarIsSpatial=*/false))
      return e;
    vaeStride = s;
    return Error::success();
  };
  intField("text_dim", c.textDim);
  optIntField("text_len", textLen);
  optIntField("freq_dim", freqDim);
  handlers["qk_norm"] = [&](const llvm::json::Value &v) -> Error {
    if (v.kind() == llvm::json::Value::Null) {
      c.qkNorm = false;
      return Error::success();
    }
    if (std::optional<bool> b = v.getAsBoolean()) {
      c.qkNorm = *b;
      return Error::success();
    }
    std::optional<StringRef> s = v.getAsString();
    if (s && *s == "rms_norm_across_heads") {
      c.qkNorm = true;
      return Error::success();
    }
    return err.field("qk_norm", "only \"rms_norm_across_heads\", true, false "
                                "or null are supported");
  };
  handlers["first_frame_conditioning"] =
      [&](const llvm::json::Value &v) -> Error {
    return boolean("first_frame_conditioning", v, c.firstFrameConditioning);
  };
  handlers["cross_attn_norm"] = [&](const llvm::json::Value &v) -> Error {
    return boolean("cross_attn_norm", v, c.crossAttnNorm);
  };
  handlers["eps"] = [&](const llvm::json::Value &v) -> Error {
    return number("eps", v, c.eps);
  };
  handlers["learning_rate"] = [&](const llvm::json::Value &v) -> Error {
    double lr = 0;
    if (Error e = number("learning_rate", v, lr))
      return e;
    // The rule of --lr and of loaded plans.
    if (std::optional<std::string> problem =
            exec::checkAdamWHyperParameter("lr", lr))
      return err.field("learning_rate", *problem);
    c.learningRate = lr;
    return Error::success();
  };
  handlers["rope_theta"] = [&](const llvm::json::Value &v) -> Error {
    return number("rope_theta", v, c.ropeTheta);
  };
  // RoPE angles are computed from positions, so the table length of
  // diffusers is only checked for sanity.
  handlers["rope_max_seq_len"] = [&](const llvm::json::Value &v) -> Error {
    int64_t n = 0;
    if (Error e = integer("rope_max_seq_len", v, n))
      return e;
    if (n <= 0)
      return err.field("rope_max_seq_len", "must be positive");
    return Error::success();
  };
  intField("num_classes", c.numClasses);
  handlers["class_dropout_prob"] = [&](const llvm::json::Value &v) -> Error {
    double p = 0;
    if (Error e = number("class_dropout_prob", v, p))
      return e;
    if (p < 0 || p >= 1)
      return err.field("class_dropout_prob", "must lie in [0, 1)");
    c.classDropout = p > 0;
    return Error::success();
  };
  // diffusers writes null for a model without image conditioning.
  for (const auto &field :
       {std::pair<StringRef, std::optional<int64_t> *>{"image_dim", &imageDim},
        {"added_kv_proj_dim", &addedKvProjDim},
        {"pos_embed_seq_len", &posEmbedSeqLen}})
    handlers[field.first] = [this, key = field.first, out = field.second](
                                const llvm::json::Value &v) -> Error {
      if (v.kind() == llvm::json::Value::Null)
        return Error::success();
      int64_t i = 0;
      if (Error e = integer(key, v, i))
        return e;
      *out = i;
      return Error::success();
    };
  optIntField("image_len", imageLen);

  for (const auto &[key, value] : obj) {
    auto it = handlers.find(key);
    if (it == handlers.end()) {
      std::string best;
      unsigned bestDistance = 4;
      for (const auto &h : handlers) {
        unsigned d = StringRef(key).edit_distance(h.getKey());
        if (d < bestDistance) {
          bestDistance = d;
          best = h.getKey().str();
        }
      }
      return err.field(key,
                       best.empty()
                           ? std::string("unknown key; see docs/ModelConfig.md")
                           : "unknown key; did you mean '" + best + "'?");
    }
    if (Error e = it->second(value))
      return std::move(e);
  }

  for (auto [a, b] : {std::pair<StringRef, StringRef>{"num_layers", "depth"},
                      {"num_attention_heads", "num_heads"}})
    if (obj.get(a) && obj.get(b))
      return err.field(b, "'" + a.str() +
                              "' is given too; give only one of "
                              "the two");
  if (name)
    c.name = *name;
  bool isDiT =
      architecture ? *architecture == "dit" : className && *className == "DiT";
  if (architecture && *architecture != "wan" && *architecture != "dit")
    return err.field("architecture", "must be \"wan\" or \"dit\", got \"" +
                                         *architecture + "\"");
  if (!architecture && className && *className != "WanTransformer3DModel" &&
      *className != "DiT")
    return err.field("_class_name",
                     "'" + *className +
                         "' is not supported; use WanTransformer3DModel or "
                         "set \"architecture\" to \"wan\" or \"dit\"");
  c.architecture = isDiT ? Architecture::DiT : Architecture::Wan;
  // Keys of the other family would be silently ignored: refuse them.
  static const char *ditOnly[] = {"num_classes", "class_dropout_prob",
                                  "learn_sigma"};
  static const char *wanOnly[] = {"text_dim",
                                  "text_len",
                                  "qk_norm",
                                  "cross_attn_norm",
                                  "rope_theta",
                                  "rope_max_seq_len",
                                  "added_kv_proj_dim",
                                  "image_dim",
                                  "pos_embed_seq_len",
                                  "image_len",
                                  "first_frame_conditioning"};
  for (const char *key :
       isDiT ? llvm::ArrayRef(wanOnly) : llvm::ArrayRef(ditOnly))
    if (obj.get(key))
      return err.field(key, llvm::formatv("only applies to {0} models; remove "
                                          "it or set \"architecture\"",
                                          isDiT ? "Wan" : "DiT"));
  strideGiven = vaeStride.has_value();
  c.vaeStride = vaeStride ? *vaeStride
                          : (isDiT ? std::array<int64_t, 3>{1, 8, 8}
                                   : std::array<int64_t, 3>{4, 8, 8});
  c.textLen = textLen ? *textLen : (isDiT ? 0 : 512);
  c.freqDim = freqDim ? *freqDim : 256;
  if (Error e = validate(c))
    return std::move(e);
  return c;
}

constexpr int64_t kMaxLayers = kMaxModelLayers, kMaxWidth = kMaxModelWidth,
                  kMaxPatch = kMaxPatchExtent;

Error ConfigReader::validate(ModelConfig &c) {
  auto positive = [&](StringRef key, int64_t v,
                      int64_t max = kMaxWidth) -> Error {
    if (v > 0 && v <= max)
      return Error::success();
    if (v > max)
      return err.field(key, llvm::formatv("{0} is larger than {1}, the most "
                                          "MegaSlide plans for",
                                          v, max));
    return err.field(key, llvm::formatv("must be a positive integer, got {0}"
                                        " (missing keys count as 0)",
                                        v));
  };
  if (Error e = positive("num_layers", c.numLayers, kMaxLayers))
    return e;
  if (Error e = positive("num_attention_heads", c.numHeads))
    return e;
  if (hiddenSize) {
    if (Error e = positive("hidden_size", *hiddenSize))
      return e;
    if (*hiddenSize % c.numHeads != 0)
      return err.field("num_attention_heads",
                       llvm::formatv("{0} heads do not divide hidden_size {1}; "
                                     "choose a head count that divides it",
                                     c.numHeads, *hiddenSize));
    int64_t derived = *hiddenSize / c.numHeads;
    if (headDim && *headDim != derived)
      return err.field("attention_head_dim",
                       llvm::formatv("{0} contradicts hidden_size / heads = "
                                     "{1}; give only one of them",
                                     *headDim, derived));
    headDim = derived;
  }
  if (!headDim)
    return err.field("attention_head_dim",
                     "missing; give attention_head_dim or hidden_size");
  c.headDim = *headDim;
  if (Error e = positive("attention_head_dim", c.headDim))
    return e;
  if (c.dim() > kMaxWidth)
    return err.field("attention_head_dim",
                     llvm::formatv("{0} heads x {1} = model dim {2} is larger "
                                   "than {3}, the most MegaSlide plans for",
                                   c.numHeads, c.headDim, c.dim(), kMaxWidth));
  if (c.architecture == Architecture::Wan && c.headDim % 2 != 0)
    return err.field("attention_head_dim",
                     llvm::formatv("{0} is odd; 3D RoPE rotates channel "
                                   "pairs, use an even head dim",
                                   c.headDim));
  if (mlpRatio) {
    if (c.ffnDim)
      return err.field("mlp_ratio",
                       "give either ffn_dim or mlp_ratio, not both");
    double ffn = *mlpRatio * c.dim();
    // Checked before the cast: a double beyond int64 does not convert.
    if (*mlpRatio > 0 && ffn > kMaxWidth)
      return err.field("mlp_ratio",
                       llvm::formatv("{0} x dim {1} = ffn_dim {2} is larger "
                                     "than {3}, the most MegaSlide plans for",
                                     *mlpRatio, c.dim(), ffn, kMaxWidth));
    if (*mlpRatio <= 0 || ffn != static_cast<double>(static_cast<int64_t>(ffn)))
      return err.field("mlp_ratio",
                       llvm::formatv("{0} x dim {1} is not a positive integer",
                                     *mlpRatio, c.dim()));
    c.ffnDim = static_cast<int64_t>(ffn);
  }
  if (Error e = positive("ffn_dim", c.ffnDim))
    return e;
  if (Error e = positive("in_channels", c.inChannels))
    return e;
  c.outChannels = outChannels
                      ? *outChannels
                      : (learnSigma.value_or(false) ? 2 : 1) * c.inChannels;
  if (outChannels && learnSigma)
    return err.field("learn_sigma", "give either out_channels or learn_sigma");
  if (Error e = positive("out_channels", c.outChannels))
    return e;
  // Wan: more input than output channels are image-conditioning latents
  // (validateImageConditioning).
  if (c.outChannels < c.inChannels && c.architecture == Architecture::DiT)
    return err.field("out_channels",
                     llvm::formatv("{0} is fewer than in_channels {1}; the "
                                   "velocity needs one output per latent "
                                   "channel",
                                   c.outChannels, c.inChannels));
  for (int i = 0; i < 3; ++i) {
    if (c.patch[i] <= 0)
      return err.field("patch_size", "every extent must be positive");
    if (c.vaeStride[i] <= 0)
      return err.field("vae_stride", "every stride must be positive");
    if (c.patch[i] > kMaxPatch)
      return err.field("patch_size",
                       llvm::formatv("extent {0} is larger than {1}, the most "
                                     "MegaSlide plans for",
                                     c.patch[i], kMaxPatch));
    if (c.vaeStride[i] > kMaxPatch)
      return err.field("vae_stride",
                       llvm::formatv("stride {0} is larger than {1}, the most "
                                     "MegaSlide plans for",
                                     c.vaeStride[i], kMaxPatch));
  }
  if (c.freqDim > kMaxWidth)
    return positive("freq_dim", c.freqDim);
  if (c.freqDim <= 0 || c.freqDim % 2 != 0)
    return err.field("freq_dim",
                     llvm::formatv("{0} must be positive and even", c.freqDim));
  if (c.eps <= 0)
    return err.field("eps", "must be positive");
  if (c.ropeTheta <= 1)
    return err.field("rope_theta", "must exceed 1");
  if (c.architecture == Architecture::Wan) {
    if (Error e = positive("text_dim", c.textDim))
      return e;
    if (Error e = positive("text_len", c.textLen))
      return e;
    if (Error e = validateImageConditioning(c))
      return e;
    if (Error e = validateVaeStride(c))
      return e;
    if (c.firstFrameConditioning && c.imageConditionChannels())
      return err.field("first_frame_conditioning",
                       "a model with image-conditioning input channels takes "
                       "its image through them (Wan 2.1 I2V, Wan 2.2 "
                       "I2V-A14B); the clean first frame is Wan 2.2 TI2V's "
                       "way, for in_channels = out_channels");
    if (c.firstFrameConditioning && c.patch[0] != 1)
      return err.field("first_frame_conditioning",
                       llvm::formatv("needs a temporal patch of 1, so that "
                                     "the first latent frame is whole tokens; "
                                     "patch_size is {0}x{1}x{2}",
                                     c.patch[0], c.patch[1], c.patch[2]));
  } else {
    if (Error e = positive("num_classes", c.numClasses))
      return e;
    if (c.patch[0] != 1)
      return err.field("patch_size", "DiT patches images: use a temporal "
                                     "patch of 1");
  }
  return Error::success();
}

Error ConfigReader::validateImageConditioning(ModelConfig &c) {
  // WanImageToVideoPipeline feeds the noisy latents, a mask of one channel
  // per frame of a latent frame and the conditioning frames' latents (Wan
  // 2.1 I2V and FLF2V, and Wan 2.2 I2V-A14B, which has no image_dim).
  int64_t conditioned = 2 * c.outChannels + c.vaeStride[0];
  auto checkChannels = [&]() -> Error {
    if (c.inChannels == conditioned)
      return Error::success();
    return err.field(
        "in_channels",
        llvm::formatv("{0}, but image conditioning takes the latents "
                      "(out_channels {1}), a mask of vae_stride[0] = {2} "
                      "channels and the conditioning frames' latents ({1}): "
                      "{3}",
                      c.inChannels, c.outChannels, c.vaeStride[0],
                      conditioned));
  };
  // diffusers' WanTransformer3DModel: image_dim builds the image embedder,
  // added_kv_proj_dim the cross-attention's image keys and values, which
  // read the embedder's output of the model's width.
  if (!imageDim) {
    for (auto [key, v] : {std::pair<StringRef, std::optional<int64_t> &>{
                              "added_kv_proj_dim", addedKvProjDim},
                          {"pos_embed_seq_len", posEmbedSeqLen},
                          {"image_len", imageLen}})
      if (v)
        return err.field(key, "needs image conditioning: give image_dim (the "
                              "image encoder's width, 1280 for Wan 2.1 I2V)");
    if (c.inChannels > c.outChannels && c.inChannels != conditioned)
      return err.field(
          "out_channels",
          llvm::formatv("{0} is fewer than in_channels {1}; the velocity "
                        "needs one output per latent channel, and image "
                        "conditioning takes 2 x out_channels + vae_stride[0] "
                        "= {2} input channels",
                        c.outChannels, c.inChannels, conditioned));
    return Error::success();
  }
  auto positive = [&](StringRef key, int64_t v) -> Error {
    if (v > 0 && v <= kMaxWidth)
      return Error::success();
    return err.field(key, llvm::formatv("must be a positive integer of at most "
                                        "{0}, got {1}",
                                        kMaxWidth, v));
  };
  if (Error e = positive("image_dim", *imageDim))
    return e;
  if (!addedKvProjDim)
    return err.field("added_kv_proj_dim",
                     llvm::formatv("missing; image conditioning needs the "
                                   "cross-attention's image keys and values: "
                                   "set it to the model dim {0}",
                                   c.dim()));
  if (*addedKvProjDim != c.dim())
    return err.field("added_kv_proj_dim",
                     llvm::formatv("{0} differs from the model dim {1} "
                                   "(heads x attention_head_dim), the width of "
                                   "the image embedder's output it projects",
                                   *addedKvProjDim, c.dim()));
  if (posEmbedSeqLen) {
    if (Error e = positive("pos_embed_seq_len", *posEmbedSeqLen))
      return e;
    if (imageLen && *imageLen != *posEmbedSeqLen)
      return err.field("image_len",
                       llvm::formatv("{0} differs from pos_embed_seq_len {1}, "
                                     "the image tokens the position embedding "
                                     "is added to",
                                     *imageLen, *posEmbedSeqLen));
  }
  // CLIP ViT-H/14 at 224 px: 257 tokens per image; FLF2V's two images.
  c.imageDim = *imageDim;
  c.imageLen = imageLen ? *imageLen : posEmbedSeqLen.value_or(257);
  c.imagePosEmbed = posEmbedSeqLen.has_value();
  if (Error e = positive("image_len", c.imageLen))
    return e;
  if (Error e = checkChannels())
    return e;
  // WanAttnProcessor splits the context as [image tokens, 512 text tokens].
  if (c.textLen != kImageModelTextLen)
    return err.field("text_len",
                     llvm::formatv("{0}, but diffusers' Wan attention takes "
                                   "the last {1} context tokens as the prompt "
                                   "of an image-conditioned model; use {1}",
                                   c.textLen, kImageModelTextLen));
  return Error::success();
}

Error ConfigReader::validateVaeStride(const ModelConfig &c) {
  // The latents of Wan's two VAEs: Wan 2.1's 16 channels at 4x8x8 pixels,
  // Wan 2.2's (TI2V-5B) 48 at 4x16x16. A transformer config does not say
  // which it was trained on, so a stride that contradicts its channels
  // (e.g. the 4x8x8 default for a 48-channel model) would plan a video 4x
  // larger than the one the VAE makes.
  struct WanVae {
    int64_t channels;
    std::array<int64_t, 3> stride;
    const char *name;
  };
  static const WanVae kVaes[] = {{16, {4, 8, 8}, "Wan 2.1"},
                                 {48, {4, 16, 16}, "Wan 2.2"}};
  for (const WanVae &vae : kVaes) {
    if (c.latentChannels() != vae.channels || c.vaeStride == vae.stride)
      continue;
    return err.field(
        "vae_stride",
        llvm::formatv("{0}x{1}x{2}{3}, but the {4} latent channels are the "
                      "{5} VAE's, whose stride is {6}x{7}x{8}: set "
                      "\"vae_stride\": [{6}, {7}, {8}], or give the pipeline "
                      "folder, whose vae/config.json says it",
                      c.vaeStride[0], c.vaeStride[1], c.vaeStride[2],
                      strideGiven ? "" : " (the default, as the key is absent)",
                      vae.channels, vae.name, vae.stride[0], vae.stride[1],
                      vae.stride[2]));
  }
  return Error::success();
}

} // namespace

Expected<ModelConfig> megaslide::parseModelConfig(StringRef json,
                                                  StringRef source) {
  ConfigError err(source);
  Expected<llvm::json::Object> obj =
      parseJsonObject(json, source, "a model config");
  if (!obj)
    return obj.takeError();
  ConfigReader reader(err);
  Expected<ModelConfig> config = reader.read(*obj);
  if (config)
    config->sourceJson = json.str();
  return config;
}

std::vector<std::string> megaslide::presetNames() {
  std::vector<std::string> names;
  for (const EmbeddedFile &p : kPresets)
    names.push_back(p.name);
  return names;
}

namespace {
std::string joinPath(StringRef dir, StringRef name) {
  llvm::SmallString<256> path(dir);
  llvm::sys::path::append(path, name);
  return std::string(path);
}

/// A diffusers folder's model config: a pipeline's (model_index.json) its
/// transformer's config.json with the stride of its VAE (vae/config.json's
/// scale factors, as the pipelines read them, diffusers' defaults where
/// absent), whose latent channels must be the transformer's; a
/// transformer folder's its config.json.
Expected<ModelConfig> loadModelFolder(StringRef dir) {
  auto fail = [&](const llvm::Twine &what) {
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "model folder '" + dir + "': " + what);
  };
  auto readObject = [&](const std::string &path,
                        StringRef what) -> Expected<llvm::json::Object> {
    Expected<std::string> text =
        readBoundedFile(path, kMaxModelConfigBytes, what);
    if (!text)
      return text.takeError();
    return parseJsonObject(*text, path, what);
  };
  bool pipeline = llvm::sys::fs::exists(joinPath(dir, "model_index.json"));
  std::string transformer = dir.str();
  if (pipeline) {
    transformer = joinPath(dir, "transformer");
    // Wan 2.2 A14B: two experts of one architecture.
    if (!llvm::sys::fs::is_directory(transformer))
      transformer = joinPath(dir, "transformer_2");
  }
  std::string configPath = joinPath(transformer, "config.json");
  if (!llvm::sys::fs::exists(configPath))
    return fail(pipeline ? "its pipeline has no transformer/config.json"
                         : "it has neither model_index.json (a diffusers "
                           "pipeline) nor config.json (a transformer)");
  Expected<llvm::json::Object> config = readObject(configPath, "model config");
  if (!config)
    return config.takeError();
  std::optional<int64_t> zDim;
  if (pipeline) {
    std::string vaePath = joinPath(joinPath(dir, "vae"), "config.json");
    if (!llvm::sys::fs::exists(vaePath))
      return fail("its pipeline has no vae/config.json, which gives the "
                  "latents' stride");
    Expected<llvm::json::Object> vae = readObject(vaePath, "VAE config");
    if (!vae)
      return vae.takeError();
    // AutoencoderKLWan's defaults: Wan 2.1's VAE.
    int64_t temporal = vae->getInteger("scale_factor_temporal").value_or(4);
    int64_t spatial = vae->getInteger("scale_factor_spatial").value_or(8);
    zDim = vae->getInteger("z_dim").value_or(16);
    llvm::json::Value stride = llvm::json::Array{temporal, spatial, spatial};
    if (const llvm::json::Value *given = config->get("vae_stride");
        given && *given != stride)
      return fail(llvm::formatv("{0} sets vae_stride {1}, but the VAE's "
                                "scale factors are {2}x{3}x{3} ({4})",
                                configPath, *given, temporal, spatial, vaePath)
                      .str());
    (*config)["vae_stride"] = std::move(stride);
  }
  std::string text =
      llvm::formatv("{0:2}", llvm::json::Value(std::move(*config))).str();
  Expected<ModelConfig> c = parseModelConfig(text, configPath);
  if (!c)
    return c.takeError();
  if (c->name.empty())
    c->name = dir.rtrim('/').str();
  if (zDim && *zDim != c->latentChannels())
    return fail(llvm::formatv("the VAE makes latents of z_dim {0} channels, "
                              "but the transformer's latents have {1} "
                              "(out_channels)",
                              *zDim, c->latentChannels())
                    .str());
  return c;
}
} // namespace

Expected<ModelConfig> megaslide::loadModelConfig(StringRef nameOrPath) {
  for (const EmbeddedFile &p : kPresets)
    if (nameOrPath == p.name) {
      Expected<ModelConfig> c = parseModelConfig(p.text, p.name);
      if (c && c->name.empty())
        c->name = p.name;
      return c;
    }
  if (llvm::sys::fs::is_directory(nameOrPath))
    return loadModelFolder(nameOrPath);
  if (!nameOrPath.ends_with(".json")) {
    std::string names;
    for (const EmbeddedFile &p : kPresets)
      names += std::string(names.empty() ? "" : ", ") + p.name;
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "unknown model preset '%s'; use one of %s, or a path to a .json "
        "config",
        nameOrPath.str().c_str(), names.c_str());
  }
  Expected<std::string> text =
      readBoundedFile(nameOrPath, kMaxModelConfigBytes, "model config");
  if (!text)
    return text.takeError();
  Expected<ModelConfig> c = parseModelConfig(*text, nameOrPath);
  if (c && c->name.empty())
    c->name = nameOrPath.str();
  return c;
}

namespace {

/// Latent elements of `pixels` along one axis, if the VAE and the patch
/// divide it: a causal video VAE keeps the first frame, F = 1 + s (T - 1).
std::optional<int64_t> latentExtent(int64_t pixels, int64_t stride,
                                    int64_t patch, bool causal,
                                    bool latentUnits) {
  if (pixels <= 0)
    return std::nullopt;
  int64_t latent = pixels;
  if (!latentUnits) {
    int64_t offset = causal ? 1 : 0;
    if ((pixels - offset) % stride != 0)
      return std::nullopt;
    latent = (pixels - offset) / stride + offset;
  }
  if (latent % patch != 0)
    return std::nullopt;
  return latent;
}

/// Converts one extent to latents, or names the nearest sizes that work.
Expected<int64_t> toLatent(StringRef field, int64_t pixels, int64_t stride,
                           int64_t patch, bool causal, bool latentUnits) {
  if (std::optional<int64_t> latent =
          latentExtent(pixels, stride, patch, causal, latentUnits))
    return *latent;
  auto valid = [&](int64_t p) {
    return latentExtent(p, stride, patch, causal, latentUnits).has_value();
  };
  std::string rule =
      latentUnits ? llvm::formatv("a multiple of the patch {0}", patch).str()
      : causal
          ? llvm::formatv("1 + {0} k with (k + 1) divisible by the patch {1}",
                          stride, patch)
                .str()
          : llvm::formatv("a multiple of the VAE stride {0} x patch {1}",
                          stride, patch)
                .str();
  int64_t period = (latentUnits ? 1 : stride) * patch;
  std::string suggestion;
  if (pixels > 0) {
    int64_t lower = pixels, upper = pixels;
    // Near INT64_MAX there may be no larger size at all.
    int64_t limit =
        pixels > INT64_MAX - 2 * period ? INT64_MAX : pixels + 2 * period;
    while (lower > 0 && !valid(lower))
      --lower;
    while (!valid(upper) && upper < limit)
      ++upper;
    if (!valid(upper))
      suggestion = llvm::formatv("; use {0}", lower).str();
    else
      suggestion = lower > 0
                       ? llvm::formatv("; use {0} or {1}", lower, upper).str()
                       : llvm::formatv("; use {0}", upper).str();
  }
  std::string problem =
      pixels <= 0 ? llvm::formatv("must be positive, got {0}", pixels).str()
      : latentUnits
          ? llvm::formatv("{0} latent elements do not fit the patch; it "
                          "must be {1}{2}",
                          pixels, rule, suggestion)
                .str()
          : llvm::formatv("{0} does not fit the VAE and patch; it must be "
                          "{1}{2}",
                          pixels, rule, suggestion)
                .str();
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "video field '%s': %s", field.str().c_str(),
                                 problem.c_str());
}

} // namespace

Expected<Geometry> megaslide::computeGeometry(const ModelConfig &c,
                                              const VideoShape &v) {
  if (c.architecture == Architecture::DiT && v.frames != 1)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "video field 'frames': %lld frames given, but DiT models images; use "
        "--frames 1",
        static_cast<long long>(v.frames));
  Geometry g;
  const char *fields[] = {"frames", "height", "width"};
  int64_t pixels[] = {v.frames, v.height, v.width};
  for (int i = 0; i < 3; ++i) {
    bool causal = i == 0 && c.vaeStride[0] > 1;
    Expected<int64_t> latent = toLatent(fields[i], pixels[i], c.vaeStride[i],
                                        c.patch[i], causal, v.latentUnits);
    if (!latent)
      return latent.takeError();
    g.latent[i] = *latent;
    g.grid[i] = *latent / c.patch[i];
  }
  // Tensor sizes are int64 byte counts: keep every activation far from
  // overflowing them.
  constexpr int64_t kMaxTokens = int64_t(1) << 31;
  int64_t tokens = 1;
  for (int64_t extent : g.grid)
    if (__builtin_mul_overflow(tokens, extent, &tokens) || tokens > kMaxTokens)
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "video: %lld x %lld x %lld %s give more than 2^31 tokens per "
          "sample; plan a smaller video",
          static_cast<long long>(v.frames), static_cast<long long>(v.height),
          static_cast<long long>(v.width),
          v.latentUnits ? "latent elements" : "pixels");
  return g;
}
