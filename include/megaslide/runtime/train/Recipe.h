//===- Recipe.h - The fine-tuning recipe around the optimizer --*- C++ -*-===//
//
// What a run does besides the AdamW step itself (docs/Training.md): the
// learning-rate schedule, global-norm gradient clipping, gradient
// accumulation, an EMA of the weights, how flow-matching timesteps are
// sampled and each sample's loss weighted, and validation. The definitions
// follow the field's libraries so results can be compared with them:
// schedules as transformers' get_*_schedule_with_warmup, the timestep
// shift as diffusers' FlowMatchEulerDiscreteScheduler, the loss weights as
// diffusers' compute_loss_weighting_for_sd3; clipping
// (torch.nn.utils.clip_grad_norm_) and the EMA (diffusers' EMAModel) are
// the host optimizer's (host/HostOptimizer.h). No MLIR: the runtime-only
// build and the Python module use it.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_RECIPE_H
#define MEGASLIDE_RUNTIME_TRAIN_RECIPE_H

#include "megaslide/runtime/train/Random.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace megaslide::train {


enum class LrSchedule { Constant, WarmupConstant, WarmupCosine, WarmupLinear };
enum class TimestepSampling { Uniform, LogitNormal };
/// How each sample's loss is weighted by its time sigma (docs/Training.md,
/// "Loss weighting"): sigma_sqrt and cosmap as diffusers'
/// compute_loss_weighting_for_sd3, logit-normal the density of the
/// logit-normal distribution (SD3's weighting).
enum class LossWeighting { None, SigmaSqrt, CosMap, LogitNormal };

struct Recipe {
  /// lr at optimizer step s (0-based: the first update is s = 0) is the
  /// plan's lr times lrFactor(s).
  LrSchedule lrSchedule = LrSchedule::Constant;
  int64_t warmupSteps = 0;
  /// The floor of cosine and linear decay, absolute (not a ratio).
  double minLr = 0;
  /// Optimizer steps over which cosine and linear decay reach minLr; 0
  /// until the run sets it (a fresh run: its --steps).
  int64_t decaySteps = 0;

  /// Clip the global L2 norm of the gradients to this; 0: no clipping.
  double maxGradNorm = 0;
  /// Micro-batches per optimizer step; their gradients are averaged.
  int64_t gradAccum = 1;

  /// EMA of the fp32 masters after every update; 0: none.
  double emaDecay = 0;
  /// diffusers' EMAModel warmup: decay min(emaDecay, (1+k)/(10+k)) at
  /// the k-th update (k = 0 copies the weights).
  bool emaWarmup = false;
  bool emaBf16 = false; ///< keep the EMA in bf16 (2 B/param instead of 4)

  TimestepSampling timesteps = TimestepSampling::Uniform;
  double logitMean = 0, logitStd = 1; ///< of logit-normal sampling
  /// Flow shift s: sigma' = s sigma / (1 + (s - 1) sigma); 1 leaves it.
  double flowShift = 1;
  /// Times are drawn from [minTimestep, maxTimestep) only, with the
  /// distribution above restricted to that range (its density's shape
  /// kept): one expert of Wan 2.2's pair (docs/Training.md, "Timesteps").
  double minTimestep = 0, maxTimestep = 1;
  /// Wan 2.2's two experts in one run (docs/Training.md, "Two experts in
  /// one run"): the high-noise expert (0, diffusers' `transformer`) takes
  /// the times in [boundary, 1), the low-noise one (1, `transformer_2`)
  /// those in [0, boundary); 0: one model.
  double boundary = 0;
  /// Per-sample loss weights; the plan of any other than None takes them
  /// as its step input exec::kLossWeightsInput.
  LossWeighting weighting = LossWeighting::None;

  bool clips() const { return maxGradNorm > 0; }
  bool hasEma() const { return emaDecay > 0; }
  bool hasTimestepRange() const { return minTimestep > 0 || maxTimestep < 1; }
  bool twoExperts() const { return boundary > 0; }
  int64_t numExperts() const { return twoExperts() ? 2 : 1; }
  bool weightsLoss() const { return weighting != LossWeighting::None; }
  /// Whether --logit-mean and --logit-std matter (sampling or weighting).
  bool usesLogitNormal() const {
    return timesteps == TimestepSampling::LogitNormal ||
           weighting == LossWeighting::LogitNormal;
  }
};

/// "high" (expert 0) or "low" (expert 1): what the metrics call them.
llvm::StringRef expertName(int64_t expert);
/// The recipe expert `expert` of a two-expert recipe draws its times
/// with: the timestep range its side of the boundary.
Recipe expertRecipe(const Recipe &recipe, int64_t expert);
/// The expert optimizer step `step` (0-based, the run's) of a two-expert
/// recipe trains: the side of the boundary on which one time drawn from
/// the whole distribution falls (a stream of its own, a function of
/// (seed, step) only). Each expert thus gets the distribution's mass on
/// its side as its share of the steps.
int64_t stepExpert(const Recipe &recipe, uint64_t seed, int64_t step);

/// Parses "constant", "warmup-constant", "warmup-cosine", "warmup-linear".
std::optional<LrSchedule> parseLrSchedule(llvm::StringRef name);
llvm::StringRef lrScheduleName(LrSchedule schedule);
std::optional<TimestepSampling> parseTimestepSampling(llvm::StringRef name);
llvm::StringRef timestepSamplingName(TimestepSampling sampling);
/// Parses "none", "sigma_sqrt", "cosmap", "logit-normal".
std::optional<LossWeighting> parseLossWeighting(llvm::StringRef name);
llvm::StringRef lossWeightingName(LossWeighting weighting);
/// The names parseLossWeighting takes, for messages: "none, sigma_sqrt,
/// cosmap or logit-normal".
std::string lossWeightingNames();

/// An error naming the flag of the first value out of range (baseLr: the
/// plan's lr, which minLr must not exceed).
llvm::Error checkRecipe(const Recipe &recipe, double baseLr);

/// The learning rate of optimizer step `s` (0-based) for base rate `lr`:
///   warmup     s < warmupSteps: lr s / warmupSteps (0 at s = 0, as
///              transformers' schedules)
///   constant   lr
///   cosine     minLr + (lr - minLr) (1 + cos(pi p)) / 2
///   linear     minLr + (lr - minLr) (1 - p)
/// with p = (s - warmupSteps) / (decaySteps - warmupSteps) clamped to
/// [0, 1]: decay reaches minLr at s = decaySteps and stays there.
double scheduledLr(const Recipe &recipe, double lr, int64_t s);

/// sigma' = shift sigma / (1 + (shift - 1) sigma).
double shiftSigma(double sigma, double shift);
/// One sample's flow-matching time sigma in [0, 1] drawn from `rng`:
/// uniform consumes one uniform(), logit-normal one normal() (sigmoid of
/// mean + std z); then the flow shift. With a timestep range, the same
/// draws go through the inverse of the distribution's CDF over the range,
/// so sigma follows the distribution conditioned on the range.
float sampleSigma(const Recipe &recipe, Random &rng);
/// How many draws of the generator one sampleSigma takes (a jump over
/// sigmas not sampled advances the state by as many).
int64_t sigmaDraws(const Recipe &recipe);
/// The sigmas of a run's optimizer step `step` (0-based: completed steps
/// before it), samples 0..count-1 (micro-batch m, sample b at m B + b):
/// a function of (seed, step) only, so any step's timesteps can be
/// reproduced without replaying the run.
std::vector<float> sampleSigmas(const Recipe &recipe, uint64_t seed,
                                int64_t step, int64_t count);
/// The loss weight of a sample at time sigma, computed in double and
/// rounded to fp32:
///   none          1
///   sigma_sqrt    sigma^-2 (infinite at sigma = 0)
///   cosmap        2 / (pi (1 - 2 sigma + 2 sigma^2))
///   logit-normal  exp(-(logit(sigma) - m)^2 / (2 s^2))
///                 / (s sqrt(2 pi) sigma (1 - sigma)), 0 at sigma 0 and 1
/// with m = logitMean, s = logitStd.
float lossWeight(const Recipe &recipe, float sigma);
/// lossWeight of each of `sigmas`.
std::vector<float> lossWeights(const Recipe &recipe,
                               llvm::ArrayRef<float> sigmas);
/// sampleSigmas drawn in pieces: next(n) gives the following n sigmas of
/// step `step`, so the micro-batches of a step need not be drawn at once.
class SigmaStream {
public:
  SigmaStream(const Recipe &recipe, uint64_t seed, int64_t step);
  std::vector<float> next(int64_t count);
  /// Passes over `count` sigmas (those of other ranks' micro-batches).
  void skip(int64_t count);

private:
  const Recipe &recipe;
  Random rng;
};


} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_RECIPE_H
