//===- ModelBuilder.h - Training-step IR from a model config ----*- C++ -*-===//

#ifndef MEGASLIDE_MODEL_MODELBUILDER_H
#define MEGASLIDE_MODEL_MODELBUILDER_H

#include "megaslide/Model/ModelConfig.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

namespace megaslide {

/// What a training step is run on and with, beyond the architecture.
struct TrainingOptions {
  int64_t batch = 1;
  /// Text tokens per prompt; the config's `text_len` when unset.
  std::optional<int64_t> textLen;
  double learningRate = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double adamEps = 1e-8;
  double weightDecay = 0.0;
};

/// Name of the training-step function in built modules.
inline constexpr llvm::StringLiteral kTrainStepName = "train_step";

/// Builds the complete training step of `config` on videos of `geometry`:
/// declarations of all persistent state (fp32 master weights and AdamW
/// moments, frozen buffers) and `func.func @train_step`, which computes the
/// flow-matching forward, the loss, the backward of every trainable
/// parameter and its AdamW update, and returns the loss. The module is
/// verified before it is returned.
llvm::Expected<mlir::OwningOpRef<mlir::ModuleOp>>
buildTrainingStep(mlir::MLIRContext &context, const ModelConfig &config,
                  const Geometry &geometry, const TrainingOptions &options);

} // namespace megaslide

#endif // MEGASLIDE_MODEL_MODELBUILDER_H
