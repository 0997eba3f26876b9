//===- SessionValidation.cpp - The validation loss of a session -----------===//

#include "megaslide/runtime/train/SessionParts.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "llvm/Support/FormatVariadic.h"

using namespace megaslide;
using namespace megaslide::train;

llvm::Expected<std::unique_ptr<DataSource>>
train::openValidationData(const SessionOptions &options,
                          llvm::ArrayRef<InputShapes> shapesOf,
                          llvm::ArrayRef<std::string> names) {
  const InputShapes &first = shapesOf.front();
  bool bucketed = !names.front().empty();
  uint64_t valSeed = options.seed ^ hashName("validation");
  auto files = bucketed ? FileData::open(options.valDataDir, shapesOf.vec(),
                                         names, valSeed)
                        : FileData::open(options.valDataDir, first, valSeed);
  if (!files)
    return files.takeError();
  // Validation batches are whole and of one bucket each.
  int64_t B = first.latents[0], batches = 0;
  for (const std::vector<size_t> &samples : (*files)->buckets())
    batches += static_cast<int64_t>(samples.size()) / B;
  if (batches == 0)
    return llvm::createStringError(llvm::formatv(
        "validation data '{0}' has {1} samples; a validation batch takes "
        "{2} (the plan's batch){3}",
        options.valDataDir, (*files)->size(), B,
        bucketed ? " of one bucket" : ""));
  return std::unique_ptr<DataSource>(std::move(*files));
}

llvm::Expected<float> Session::validationLoss() {
  if (!valData)
    return llvm::createStringError("no validation data (--val-data)");
  flushUpdates();
  // The same noise and timesteps at every call: drawn from one seed.
  Random rng(seed ^ hashName("validation"));
  int64_t batches = 0, mine = 0;
  double sum = 0;
  // A job's ranks share the batches (rank r those of index r mod N) and
  // jump over the others' draws: the same loss, N times sooner.
  dist::Collectives *job = options.collectives;
  int64_t ranks = job ? job->size() : 1, rank = job ? job->rank() : 0;
  // Bucket by bucket, in order: whole batches of one bucket each.
  const std::vector<std::vector<size_t>> &buckets = valData->buckets();
  for (size_t g = 0; g < buckets.size(); ++g) {
    const InputShapes &shapes = shapesOf[g];
    int64_t B = shapes.latents[0];
    int64_t latent = 1;
    for (size_t d = 1; d < shapes.latents.size(); ++d)
      latent *= shapes.latents[d];
    std::vector<float> block(shapes.conditioningElements());
    for (size_t k = 0; k + B <= buckets[g].size(); k += B, ++batches) {
      if (batches % ranks != rank) {
        rng.state +=
            (B * sigmaDraws(options.recipe) + 2 * B * latent) * Random::kGamma;
        continue;
      }
      exec::StepInputs in;
      std::vector<float> &x0 = in["latents"], &noise = in["noise"],
                         &t = in["timesteps"];
      x0.resize(B * latent);
      for (int64_t b = 0; b < B; ++b) {
        if (llvm::Error e = valData->sample(
                buckets[g][k + b], x0.data() + b * latent, block.data()))
          return std::move(e);
        shapes.putConditioning(in, b, block.data());
        t.push_back(sampleSigma(options.recipe, rng));
      }
      noise.resize(B * latent);
      for (float &n : noise)
        n = rng.normal();
      exec::StepOptions gradientsOnly;
      gradientsOnly.applyUpdates = false;
      llvm::Expected<exec::StepResult> one =
          runStepOn(g, std::move(in), gradientsOnly);
      if (!one)
        return one.takeError();
      // Unweighted, whatever the weighting: comparable across schemes.
      sum += one->unweightedLoss.value_or(one->loss);
      ++mine;
    }
  }
  // The ranks with one batch fewer join the others' last gathers.
  if (sharded())
    for (; mine < (batches + ranks - 1) / ranks; ++mine)
      if (llvm::Error e = gatherLikeAStep())
        return std::move(e);
  if (ranks > 1)
    if (llvm::Error e = job->allReduceSum(llvm::MutableArrayRef<double>(sum)))
      return std::move(e);
  return static_cast<float>(sum / double(batches));
}
