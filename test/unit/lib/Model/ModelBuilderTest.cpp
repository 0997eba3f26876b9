//===- ModelBuilderTest.cpp - Parameter counts of the presets -------------===//
//
// Expected counts are computed here from the published architectures,
// layer by layer, independently of the builder (docs/ModelPresets.md).
//
//===----------------------------------------------------------------------===//

#include "megaslide/Model/ModelInfo.h"

#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/TypeUtilities.h"

#include "gtest/gtest.h"

#include <map>

using namespace megaslide;

namespace {

uint64_t linear(uint64_t in, uint64_t out, bool bias = true) {
  return in * out + (bias ? out : 0);
}

/// diffusers WanTransformer3DModel, counted from its module definitions.
uint64_t wanParams(uint64_t layers, uint64_t dim, uint64_t ffn,
                   uint64_t textDim, uint64_t channels) {
  uint64_t patchEmbed = channels * dim * 4 + dim;
  uint64_t condition = linear(256, dim) + linear(dim, dim) // time_embedder
                       + linear(dim, 6 * dim)              // time_proj
                       + linear(textDim, dim) + linear(dim, dim);
  uint64_t attention = 4 * linear(dim, dim) + 2 * dim; // q,k,v,out + qk norms
  uint64_t block = 2 * attention + 2 * dim /*norm2*/ + linear(dim, ffn) +
                   linear(ffn, dim) + 6 * dim /*scale_shift_table*/;
  uint64_t head = linear(dim, channels * 4) + 2 * dim;
  return patchEmbed + condition + layers * block + head;
}

ModelInfo infoFor(llvm::StringRef model, VideoShape video,
                  const TrainingOptions &options = TrainingOptions(),
                  mlir::MLIRContext *context = nullptr,
                  mlir::OwningOpRef<mlir::ModuleOp> *module = nullptr) {
  mlir::MLIRContext local;
  llvm::Expected<ModelInfo> info = computeModelInfo(
      context ? *context : local, model, video, options, module);
  EXPECT_TRUE(static_cast<bool>(info)) << llvm::toString(info.takeError());
  return info ? *info : ModelInfo();
}

TEST(ModelBuilder, Wan21T2V14BMatchesTheDiffusersModel) {
  ModelInfo info = infoFor("wan2.1-t2v-14b", {81, 480, 832, false});
  EXPECT_EQ(info.totalParams, wanParams(40, 5120, 13824, 4096, 16));
  EXPECT_EQ(info.totalParams, 14288491584ull);
  EXPECT_EQ(info.frozenParams, 0u);
  EXPECT_EQ(info.perBlock.size(), 40u);
}

TEST(ModelBuilder, DiTXL2MatchesThePaper) {
  ModelInfo info = infoFor("dit-xl-2", {1, 256, 256, false});
  // DiT-XL/2 (Peebles & Xie, 2023): 675,129,632 parameters, of which the
  // fixed sin-cos pos_embed [1, 256, 1152] is frozen.
  EXPECT_EQ(info.totalParams, 675129632ull);
  EXPECT_EQ(info.frozenParams, 256u * 1152u);
  EXPECT_EQ(info.perBlock.size(), 28u);
  EXPECT_EQ(info.perBlock[0], linear(1152, 3 * 1152) + linear(1152, 1152) +
                                  linear(1152, 4608) + linear(4608, 1152) +
                                  linear(1152, 6 * 1152));
}

TEST(ModelBuilder, MegaSlide105BIsAbout106BParameters) {
  ModelInfo info = infoFor("megaslide-105b", {81, 720, 1280, false});
  EXPECT_EQ(info.totalParams, wanParams(52, 12288, 32768, 4096, 16));
  EXPECT_NEAR(info.totalParams / 1e9, 106.0, 0.05);
  EXPECT_EQ(info.embeddingParams + info.blockParams + info.headParams,
            info.totalParams);
}

TEST(ModelBuilder, ForwardMatmulFlopsAreTwicePerParameterPerToken) {
  // Every block GEMM except cross-attention K/V runs once per video token;
  // cross-attention K/V run once per text token.
  ModelInfo info = infoFor("tiny", {5, 32, 32, false});
  uint64_t tokens = 2 * 2 * 2, text = 16, dim = 64, ffn = 256;
  uint64_t perTokenBlockMacs = 4 * dim * dim + 2 * dim * dim + 2 * dim * ffn;
  uint64_t blockMatmul =
      2 * (tokens * perTokenBlockMacs + text * 2 * dim * dim);
  uint64_t embed = 2 * (tokens * 16 * 4 * dim + text * (32 * dim + dim * dim) +
                        (32 * dim + dim * dim + dim * 6 * dim));
  uint64_t head = 2 * tokens * dim * 64;
  EXPECT_EQ(info.forward.matmul, 2 * blockMatmul + embed + head);
  // Backward: input and weight gradients of every GEMM except the
  // patch embedding's and the text/time inputs' data gradients.
  EXPECT_GT(info.backward.matmul, info.forward.matmul);
  EXPECT_LT(info.backward.matmul, 2 * info.forward.matmul);
  // Global attention: 4 * B * N^2 * H * Dh forward (QK^T and PV), and
  // cross-attention over text tokens.
  uint64_t selfAttn = 4 * tokens * tokens * dim;
  uint64_t crossAttn = 4 * tokens * text * dim;
  EXPECT_EQ(info.forward.attention, 2 * (selfAttn + crossAttn));
  EXPECT_EQ(info.backward.attention, 5 * info.forward.attention / 2);
}

/// Element types of every float tensor a step's ops produce, by name
/// ("bf16", "f32"), with how many results have each.
std::map<std::string, int> floatResultTypes(mlir::ModuleOp module) {
  std::map<std::string, int> seen;
  module.walk([&](mlir::Operation *op) {
    for (mlir::Type type : op->getResultTypes()) {
      mlir::Type element = mlir::getElementTypeOrSelf(type);
      if (!llvm::isa<mlir::FloatType>(element))
        continue;
      std::string name;
      llvm::raw_string_ostream os(name);
      element.print(os);
      ++seen[name];
    }
  });
  return seen;
}

TEST(ModelBuilder, F32ComputeBuildsEveryTensorOfTheStepInFp32) {
  for (llvm::StringRef model : {"tiny", "dit-xl-2"}) {
    SCOPED_TRACE(model.str());
    VideoShape video = model == "tiny" ? VideoShape{9, 64, 64, false}
                                       : VideoShape{1, 256, 256, false};
    mlir::MLIRContext context;
    mlir::OwningOpRef<mlir::ModuleOp> bf16Module, f32Module;
    TrainingOptions f32Options;
    f32Options.computeType = ComputeType::F32;
    ModelInfo bf16 = infoFor(model, video, TrainingOptions(), &context,
                             &bf16Module);
    ModelInfo f32 = infoFor(model, video, f32Options, &context, &f32Module);
    ASSERT_TRUE(bf16Module && f32Module);

    // Default: compute in bf16 beside the fp32 loss, masters and moments.
    std::map<std::string, int> bf16Types = floatResultTypes(*bf16Module);
    EXPECT_GT(bf16Types["bf16"], 0);
    EXPECT_GT(bf16Types["f32"], 0);
    // f32: nothing is bf16, and exactly the same ops produce the same
    // number of float results.
    std::map<std::string, int> f32Types = floatResultTypes(*f32Module);
    EXPECT_EQ(f32Types.count("bf16"), 0u);
    EXPECT_EQ(f32Types["f32"], bf16Types["f32"] + bf16Types["bf16"]);
    EXPECT_EQ(f32.numOps, bf16.numOps);

    // The persistent state is declared the same way: fp32 masters and
    // moments (and DiT's fp32 frozen table) whatever the compute type.
    llvm::SmallVector<std::string> bf16Params, f32Params;
    for (auto [m, names] : {std::pair{&bf16Module, &bf16Params},
                            std::pair{&f32Module, &f32Params}})
      for (auto param : (*m)->getOps<graph::ParamOp>()) {
        EXPECT_TRUE(param.getTensorType().getElementType().isF32())
            << param.getSymName().str();
        std::string text;
        llvm::raw_string_ostream os(text);
        os << param.getSymName() << " " << param.getRole() << " "
           << param.getGroup() << " " << param.getType();
        names->push_back(text);
      }
    EXPECT_EQ(f32Params, bf16Params);

    // Same architecture, same work.
    EXPECT_EQ(f32.totalParams, bf16.totalParams);
    EXPECT_EQ(f32.trainableParams, bf16.trainableParams);
    EXPECT_EQ(f32.forward.total(), bf16.forward.total());
    EXPECT_EQ(f32.backward.total(), bf16.backward.total());
    EXPECT_EQ(f32.optimizerFlops, bf16.optimizerFlops);
    EXPECT_EQ(f32.options.computeType, ComputeType::F32);
    EXPECT_EQ(bf16.options.computeType, ComputeType::BF16);
  }
}

TEST(ModelBuilder, PrecisionOptionNamesTheValidValues) {
  for (ComputeType type : {ComputeType::BF16, ComputeType::F32}) {
    llvm::Expected<ComputeType> parsed =
        parseComputeType(computeTypeName(type));
    ASSERT_TRUE(static_cast<bool>(parsed)) << llvm::toString(parsed.takeError());
    EXPECT_EQ(*parsed, type);
  }
  EXPECT_EQ(computeTypeName(TrainingOptions().computeType), "bf16");
  for (llvm::StringRef bad : {"fp32", "BF16", "f16", ""}) {
    llvm::Expected<ComputeType> parsed = parseComputeType(bad);
    ASSERT_FALSE(static_cast<bool>(parsed)) << bad.str();
    EXPECT_EQ(llvm::toString(parsed.takeError()),
              "option 'precision': unknown value '" + bad.str() +
                  "'; use one of bf16, f32");
  }
}

} // namespace
