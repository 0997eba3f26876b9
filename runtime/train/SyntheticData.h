//===- SyntheticData.h - A learnable flow-matching task ---------*- C++ -*-===//
//
// The default data of megaslide-run: a fixed-seed set of smooth moving
// latent videos ("prototypes"), each with its own condition (text
// embeddings, or a class label for DiT). Every step draws a prototype per
// sample, a timestep t ~ U(0, 1) and Gaussian noise. Because the clean
// latents are a function of the condition, the velocity target is
// predictable and the loss falls well below its starting value; with
// random latents it could not.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H
#define MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H

#include "plan/Backend.h"
#include "train/Random.h"

namespace megaslide::train {

/// The shapes of a plan's step inputs, by name.
struct InputShapes {
  std::vector<int64_t> latents, timesteps, condition;
  bool conditionIsLabel = false; ///< DiT: integer class labels
  /// Reads them from the plan's inputs; errors name what is missing.
  static llvm::Expected<InputShapes> of(const exec::ExecPlan &plan);
};

class SyntheticData {
public:
  static constexpr int kPrototypes = 8;

  SyntheticData(const InputShapes &shapes, uint64_t seed);
  /// The next batch; advances the sampling state.
  exec::StepInputs next();

  /// The state that determines every later batch (saved in checkpoints).
  uint64_t state() const { return rng.state; }
  void setState(uint64_t s) { rng.state = s; }

private:
  InputShapes shapes;
  std::vector<std::vector<float>> latents, conditions;
  Random rng;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H
