//===- RecipeFlags.cpp - The training recipe's flags ----------------------===//

#include "megaslide/Tools/RecipeFlags.h"

#include <cmath>

using namespace llvm;
using namespace megaslide;

cl::OptionCategory
    tools::recipeCategory("Training recipe options (docs/Training.md)");

namespace {
using tools::recipeCategory;
cl::opt<std::string>
    lrSchedule("lr-schedule", cl::init("constant"), cl::cat(recipeCategory),
               cl::desc("Learning-rate schedule: constant | warmup-constant | "
                        "warmup-cosine | warmup-linear (decay to --min-lr over "
                        "--lr-decay-steps)"));
cl::opt<int64_t> warmupSteps("warmup-steps", cl::init(0),
                             cl::cat(recipeCategory),
                             cl::desc("Optimizer steps of linear warmup"));
cl::opt<double> minLr("min-lr", cl::init(0.0), cl::cat(recipeCategory),
                      cl::desc("Learning rate cosine and linear decay end at"));
cl::opt<int64_t> lrDecaySteps(
    "lr-decay-steps", cl::init(0), cl::cat(recipeCategory),
    cl::desc("Optimizer steps until the decay reaches --min-lr (default: "
             "a fresh run's --steps; a resumed run keeps its checkpoint's)"));
cl::opt<double> maxGradNorm(
    "max-grad-norm", cl::init(0.0), cl::cat(recipeCategory),
    cl::desc("Clip the global L2 norm of the gradients (0: no clipping)"));
cl::opt<double> emaDecay("ema-decay", cl::init(0.0), cl::cat(recipeCategory),
                         cl::desc("Keep an EMA of the weights with this "
                                  "decay (0: none)"));
cl::opt<bool> emaWarmup("ema-warmup", cl::cat(recipeCategory),
                        cl::desc("EMA decay min(--ema-decay, (1+k)/(10+k)) "
                                 "at update k, as diffusers' EMAModel"));
cl::opt<std::string>
    timestepSampling("timestep-sampling", cl::init("uniform"),
                     cl::cat(recipeCategory),
                     cl::desc("Flow-matching time: uniform | logit-normal"));
cl::opt<double> logitMean("logit-mean", cl::init(0.0), cl::cat(recipeCategory),
                          cl::desc("Mean of logit-normal sampling and "
                                   "weighting"));
cl::opt<double> logitStd("logit-std", cl::init(1.0), cl::cat(recipeCategory),
                         cl::desc("Standard deviation of logit-normal "
                                  "sampling and weighting"));
cl::opt<double> flowShift(
    "flow-shift", cl::init(1.0), cl::cat(recipeCategory),
    cl::desc("Shift s of the sampled time: s t / (1 + (s - 1) t), as Wan "
             "trains (diffusers' FlowMatchEulerDiscreteScheduler shift)"));
cl::opt<std::string> weightingScheme(
    "weighting-scheme", cl::init("none"), cl::cat(recipeCategory),
    cl::desc("Weight each sample's loss by its time t: none | sigma_sqrt "
             "| cosmap (diffusers' compute_loss_weighting_for_sd3) | "
             "logit-normal (the density with --logit-mean, --logit-std)"));

cl::opt<double> minTimestep(
    "min-timestep", cl::init(0.0), cl::cat(recipeCategory),
    cl::desc("Sample times t in [--min-timestep, --max-timestep) only, the "
             "distribution restricted to the range: one expert of Wan 2.2 "
             "(high noise: --min-timestep 0.875; low: --max-timestep 0.875)"));
cl::opt<double> maxTimestep("max-timestep", cl::init(1.0),
                            cl::cat(recipeCategory),
                            cl::desc("Upper end of the sampled times (see "
                                     "--min-timestep)"));
cl::opt<double> boundary(
    "boundary", cl::init(0.0), cl::cat(recipeCategory),
    cl::desc("Train both experts of Wan 2.2 in one run: each step's drawn "
             "time picks the high-noise expert (t >= B, diffusers' "
             "transformer) or the low-noise one (transformer_2); B is the "
             "pipeline's boundary_ratio (T2V 0.875, I2V 0.9)"));

} // namespace

Expected<train::Recipe> tools::readRecipeFlags(double lr) {
  train::Recipe r;
  std::optional<train::LrSchedule> schedule =
      train::parseLrSchedule(lrSchedule);
  if (!schedule)
    return createStringError("--lr-schedule: unknown schedule '" + lrSchedule +
                             "'; use constant, warmup-constant, "
                             "warmup-cosine or warmup-linear");
  r.lrSchedule = *schedule;
  std::optional<train::TimestepSampling> sampling =
      train::parseTimestepSampling(timestepSampling);
  if (!sampling)
    return createStringError("--timestep-sampling: unknown sampling '" +
                             timestepSampling +
                             "'; use uniform or logit-normal");
  r.timesteps = *sampling;
  std::optional<train::LossWeighting> weighting =
      train::parseLossWeighting(weightingScheme);
  if (!weighting)
    return createStringError("--weighting-scheme: unknown scheme '" +
                             weightingScheme + "'; use " +
                             train::lossWeightingNames());
  r.weighting = *weighting;
  r.warmupSteps = warmupSteps;
  r.minLr = minLr;
  r.decaySteps = lrDecaySteps;
  r.maxGradNorm = maxGradNorm;
  r.emaDecay = emaDecay;
  r.emaWarmup = emaWarmup;
  r.logitMean = logitMean;
  r.logitStd = logitStd;
  r.flowShift = flowShift;
  r.minTimestep = minTimestep;
  r.maxTimestep = maxTimestep;
  r.boundary = boundary;
  if (Error err = train::checkRecipe(r, lr))
    return std::move(err);
  return r;
}
