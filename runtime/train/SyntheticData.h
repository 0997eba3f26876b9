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

/// Where a run's batches come from. Every batch draws its samples, its
/// timesteps and its noise from one generator, so the generator's state is
/// all a checkpoint needs to continue the same sequence.
class DataSource {
public:
  virtual ~DataSource() = default;
  /// The next batch; advances the sampling state.
  exec::StepInputs next();

  uint64_t state() const { return rng.state; }
  void setState(uint64_t s) { rng.state = s; }

protected:
  DataSource(const InputShapes &shapes, uint64_t seed)
      : shapes(shapes), rng(seed) {}
  InputShapes shapes;
  /// Clean latents [C, T, H, W] and conditions per sample.
  std::vector<std::vector<float>> latents, conditions;
  Random rng;
};

class SyntheticData : public DataSource {
public:
  static constexpr int kPrototypes = 8;
  SyntheticData(const InputShapes &shapes, uint64_t seed);
};

/// Samples from files (docs/Runtime.md, "Data files"): every
/// `*.safetensors` in a directory holds one sample, `latents` [C, T, H, W]
/// and `condition` [L, D] (text embeddings; DiT: a one-element class
/// label), in f32, bf16 or f16.
class FileData : public DataSource {
public:
  static llvm::Expected<std::unique_ptr<FileData>>
  open(llvm::StringRef dir, const InputShapes &shapes, uint64_t seed);

private:
  using DataSource::DataSource;
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H
