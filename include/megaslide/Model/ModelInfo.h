//===- ModelInfo.h - Parameter, token and FLOP report -----------*- C++ -*-===//
//
// What `megaslide-plan` and `megaslide.model_info` report about a model at
// a video size, derived from the built training-step module (never typed
// in). The JSON schema is documented in docs/PlanSchema.md.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_MODEL_MODELINFO_H
#define MEGASLIDE_MODEL_MODELINFO_H

#include "dialects/Graph/GraphOps.h"
#include "megaslide/Model/ModelBuilder.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

namespace megaslide {

/// Version of the JSON schema; bumped on incompatible changes.
inline constexpr int kInfoSchemaVersion = 1;

struct ModelInfo {
  ModelConfig config;
  VideoShape video;
  Geometry geometry;
  TrainingOptions options;

  uint64_t totalParams = 0;     ///< trainable + frozen elements
  uint64_t trainableParams = 0; ///< elements with an fp32 master
  uint64_t frozenParams = 0;
  /// Host bytes of the model state under each host-state policy (indexed
  /// by it): schedule::trainableStateBytes of every trainable parameter
  /// plus 4 B per frozen one.
  std::vector<uint64_t> hostStateBytes;
  uint64_t embeddingParams = 0, blockParams = 0, headParams = 0;
  std::vector<uint64_t> perBlock;
  /// Parameters of block 0 by submodule ("attn1", "ffn", ...), in order.
  std::vector<std::pair<std::string, uint64_t>> blockBreakdown;

  graph::FlopCount forward, backward;
  uint64_t optimizerFlops = 0;
  uint64_t numOps = 0;
  double buildSeconds = 0;
};

/// Sums parameters and FLOPs over a built training-step module.
ModelInfo analyzeTrainingStep(mlir::ModuleOp module);

/// Loads `model` (preset or file), builds its training step in `context`
/// and analyses it; hands the module to `module` when given. Errors are
/// single lines naming the bad field.
llvm::Expected<ModelInfo>
computeModelInfo(mlir::MLIRContext &context, llvm::StringRef model,
                 const VideoShape &video, const TrainingOptions &options,
                 mlir::OwningOpRef<mlir::ModuleOp> *module = nullptr);

llvm::json::Value toJson(const ModelInfo &info);
void printText(const ModelInfo &info, llvm::raw_ostream &os);

} // namespace megaslide

#endif // MEGASLIDE_MODEL_MODELINFO_H
