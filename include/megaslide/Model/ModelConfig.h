//===- ModelConfig.h - DiT model configuration ------------------*- C++ -*-===//
//
// The architecture of a video (or image) Diffusion Transformer, parsed from
// JSON or a diffusers folder (docs/ModelConfig.md). Diffusers' Wan
// `config.json` keys (Wan 2.1 and 2.2, image conditioning included) are
// accepted as they are.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_MODEL_MODELCONFIG_H
#define MEGASLIDE_MODEL_MODELCONFIG_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace megaslide {

/// The two block families the builder knows.
enum class Architecture {
  /// Wan (2.1, 2.2): text cross-attention, shared time projection plus a
  /// learned per-block modulation table, QK-norm, 3D RoPE; optionally image
  /// conditioning.
  Wan,
  /// DiT (Peebles & Xie): class-conditional adaLN-Zero blocks, fixed
  /// sin-cos position embedding, fused qkv.
  DiT,
};

/// Upper bounds of config fields, far above any real model (the 105B
/// preset has 52 layers of width 12288): they keep parameter and byte
/// counts, which are int64, from overflowing, and a typo from building a
/// graph for hours. Widths cover heads, head dim, model dim, ffn_dim,
/// channels, text_dim, text_len, freq_dim and num_classes.
inline constexpr int64_t kMaxModelLayers = 1024;
inline constexpr int64_t kMaxModelWidth = int64_t(1) << 17;
inline constexpr int64_t kMaxPatchExtent = 64;
/// Prompt tokens of an image-conditioned Wan model: diffusers'
/// WanAttnProcessor takes the last 512 context tokens as the prompt's.
inline constexpr int64_t kImageModelTextLen = 512;

struct ModelConfig {
  std::string name;
  Architecture architecture = Architecture::Wan;
  int64_t numLayers = 0;
  int64_t numHeads = 0;
  int64_t headDim = 0;
  int64_t ffnDim = 0;
  int64_t inChannels = 0;
  int64_t outChannels = 0;
  std::array<int64_t, 3> patch = {1, 2, 2};
  /// Width of the text encoder's embeddings (Wan) and tokens per prompt.
  int64_t textDim = 0;
  int64_t textLen = 0;
  int64_t freqDim = 256;
  bool qkNorm = true;
  bool crossAttnNorm = true;
  double eps = 1e-6;
  double ropeTheta = 10000.0;
  /// Pixels per latent element along (frames, height, width).
  std::array<int64_t, 3> vaeStride = {4, 8, 8};
  /// Image conditioning (Wan 2.1 I2V and FLF2V; diffusers `image_dim`):
  /// the width of the CLIP image embeddings, 0 for none; `imageLen` image
  /// tokens per sample (MegaSlide key `image_len`; 257, or FLF2V's
  /// `pos_embed_seq_len` of two images), with a learned position embedding
  /// when `imagePosEmbed`. in_channels then holds the latents, the mask
  /// and the conditioning frames' latents; so it does without image
  /// embeddings in Wan 2.2 I2V-A14B (in_channels 36, image_dim null).
  int64_t imageDim = 0;
  int64_t imageLen = 0;
  bool imagePosEmbed = false;
  /// Wan 2.2 TI2V image-to-video (MegaSlide key `first_frame_conditioning`):
  /// the first latent frame is the clean image, its tokens at time 0 (the
  /// pipeline's expand_timesteps) and outside the loss.
  bool firstFrameConditioning = false;
  /// DiT: class count; the label table has one more row when classifier-
  /// free guidance dropout is on (the "null" class).
  int64_t numClasses = 0;
  bool classDropout = false;

  /// AdamW learning rate the model trains with unless the run says
  /// otherwise (MegaSlide key `learning_rate`; exec::kDefaultLr when
  /// absent).
  std::optional<double> learningRate;
  /// The JSON text it was parsed from (diffusers keys as written), which
  /// saved weights carry as their config.json.
  std::string sourceJson;

  int64_t dim() const { return numHeads * headDim; }
  int64_t patchVolume() const { return patch[0] * patch[1] * patch[2]; }
  /// Channels of the clean latents and noise (the velocity's): a Wan model
  /// with more input channels takes image-conditioning latents beside
  /// them, a DiT with more output channels predicts a variance too.
  int64_t latentChannels() const { return std::min(inChannels, outChannels); }
  /// Channels of the mask and conditioning latents beside them (Wan I2V).
  int64_t imageConditionChannels() const {
    return inChannels - latentChannels();
  }
};

/// Parses a JSON model config; errors are one line naming the field and
/// the fix. `source` names the config in messages.
llvm::Expected<ModelConfig> parseModelConfig(llvm::StringRef json,
                                             llvm::StringRef source);

/// Loads a built-in preset by name (see `presetNames`) or a JSON file.
llvm::Expected<ModelConfig> loadModelConfig(llvm::StringRef nameOrPath);

/// Names of the built-in presets (configs/*.json, compiled in).
std::vector<std::string> presetNames();

/// A video size: in pixels (converted with the VAE stride) or in latent
/// elements.
struct VideoShape {
  int64_t frames = 0;
  int64_t height = 0;
  int64_t width = 0;
  bool latentUnits = false;
};

/// Latent and token extents of one sample.
struct Geometry {
  std::array<int64_t, 3> latent; ///< (T, H, W) latent elements
  std::array<int64_t, 3> grid;   ///< (T, Y, X) tokens after patchify
  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
};

/// Converts a video size to latents and tokens, or explains which size
/// does not divide and what would.
llvm::Expected<Geometry> computeGeometry(const ModelConfig &config,
                                         const VideoShape &video);

} // namespace megaslide

#endif // MEGASLIDE_MODEL_MODELCONFIG_H
