//===- ModelBuilder.h - Training-step IR from a model config ----*- C++ -*-===//

#ifndef MEGASLIDE_MODEL_MODELBUILDER_H
#define MEGASLIDE_MODEL_MODELBUILDER_H

#include "megaslide/Model/ModelConfig.h"
#include "megaslide/runtime/plan/HyperParameters.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

namespace megaslide {

/// Element type of the compute of a training step: activations, the
/// working copies of the weights and the gradients. Persistent state
/// (masters, AdamW moments) is fp32 either way.
enum class ComputeType { BF16, F32 };

/// "bf16" or "f32", as the `precision` option spells it.
llvm::StringRef computeTypeName(ComputeType type);

/// Parses the `precision` option; the error names the option and the
/// valid values.
llvm::Expected<ComputeType> parseComputeType(llvm::StringRef value);

/// What a training step is run on and with, beyond the architecture.
struct TrainingOptions {
  int64_t batch = 1;
  /// bf16 compute (the default) or an all-fp32 step, e.g. for parity
  /// tests against a reference implementation.
  ComputeType computeType = ComputeType::BF16;
  /// Text tokens per prompt; the config's `text_len` when unset.
  std::optional<int64_t> textLen;
  /// AdamW learning rate; 0 means the config's `learning_rate`, else
  /// exec::kDefaultLr.
  double learningRate = 0;
  double beta1 = exec::kDefaultBeta1;
  double beta2 = exec::kDefaultBeta2;
  double adamEps = exec::kDefaultEps;
  double weightDecay = exec::kDefaultWeightDecay;
  /// The loss weights each sample: the step takes exec::kLossWeightsInput
  /// [B] (fp32) and returns the unweighted loss after the loss.
  bool weightedLoss = false;
};

/// Name of the training-step function in built modules.
inline constexpr llvm::StringLiteral kTrainStepName = "train_step";

/// Builds the complete training step of `config` on videos of `geometry`:
/// declarations of all persistent state (fp32 master weights and AdamW
/// moments, frozen buffers) and `func.func @train_step`, which computes the
/// flow-matching forward, the loss, the backward of every trainable
/// parameter and its AdamW update, and returns the loss. Compute runs on
/// working copies of `options.computeType` cast from the masters. The module is
/// verified before it is returned.
llvm::Expected<mlir::OwningOpRef<mlir::ModuleOp>>
buildTrainingStep(mlir::MLIRContext &context, const ModelConfig &config,
                  const Geometry &geometry, const TrainingOptions &options);

} // namespace megaslide

#endif // MEGASLIDE_MODEL_MODELBUILDER_H
