//===- FuzzModelConfig.cpp - Fuzz target: model config parser -------------===//
//
// Arbitrary bytes through megaslide::parseModelConfig (the JSON of
// `--model my-config.json`, diffusers keys included). A config it accepts
// must satisfy what validation promises the builder, and must survive what
// megaslide-plan does next without IR: converting video sizes to latents
// and tokens. A crash, a sanitizer report or a broken promise (abort) is a
// bug.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Model/ModelConfig.h"

#include "llvm/Support/Error.h"

#include <cstdint>
#include <cstdlib>

using namespace megaslide;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  llvm::StringRef text(reinterpret_cast<const char *>(data), size);
  llvm::Expected<ModelConfig> parsed = parseModelConfig(text, "fuzz.json");
  if (!parsed) {
    llvm::consumeError(parsed.takeError());
    return 0;
  }
  const ModelConfig &c = *parsed;
  // What ConfigReader::validate guarantees (docs/ModelConfig.md).
  bool ok = c.numLayers > 0 && c.numHeads > 0 && c.headDim > 0 &&
            c.ffnDim > 0 && c.inChannels > 0 && c.outChannels > 0 &&
            c.freqDim > 0 && c.freqDim % 2 == 0 && c.eps > 0 &&
            c.ropeTheta > 1 && c.dim() > 0 && c.dim() / c.numHeads == c.headDim;
  for (int i = 0; i < 3; ++i)
    ok = ok && c.patch[i] > 0 && c.vaeStride[i] > 0;
  if (c.architecture == Architecture::Wan) {
    ok = ok && c.textDim > 0 && c.textLen > 0 && c.headDim % 2 == 0;
    // More inputs than outputs are image conditioning: the latents, a mask
    // of vae_stride[0] channels and the conditioning frames' latents.
    if (c.inChannels > c.outChannels)
      ok = ok && c.inChannels == 2 * c.outChannels + c.vaeStride[0] &&
           c.imageConditionChannels() == c.outChannels + c.vaeStride[0] &&
           !c.firstFrameConditioning;
    if (c.imageDim > 0)
      ok = ok && c.inChannels > c.outChannels && c.imageLen > 0 &&
           c.textLen == kImageModelTextLen;
    else
      ok = ok && c.imageLen == 0 && !c.imagePosEmbed;
  } else {
    ok = ok && c.numClasses > 0 && c.patch[0] == 1 &&
         c.outChannels >= c.inChannels;
  }
  if (!ok)
    abort();

  // Video sizes in pixels and in latents, small and far too large.
  const VideoShape videos[] = {{1, 256, 256, false},
                               {81, 720, 1280, false},
                               {5, 32, 32, true},
                               {1 + 4 * 1000000, 1 << 20, 1 << 20, false},
                               {INT64_MAX, INT64_MAX, INT64_MAX, true}};
  for (const VideoShape &video : videos) {
    llvm::Expected<Geometry> g = computeGeometry(c, video);
    if (!g) {
      llvm::consumeError(g.takeError());
      continue;
    }
    if (g->tokens() <= 0)
      abort();
  }
  return 0;
}
