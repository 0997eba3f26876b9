//===- Recipe.cpp - The fine-tuning recipe around the optimizer -----------===//

#include "megaslide/runtime/train/Recipe.h"

#include "megaslide/runtime/plan/ExecPlan.h"

#include "megaslide/runtime/train/Random.h"

#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <iterator>

using namespace megaslide;
using namespace megaslide::train;

namespace {
struct Named {
  const char *name;
  int value;
};
constexpr Named kSchedules[] = {
    {"constant", int(LrSchedule::Constant)},
    {"warmup-constant", int(LrSchedule::WarmupConstant)},
    {"warmup-cosine", int(LrSchedule::WarmupCosine)},
    {"warmup-linear", int(LrSchedule::WarmupLinear)}};
constexpr Named kSamplings[] = {
    {"uniform", int(TimestepSampling::Uniform)},
    {"logit-normal", int(TimestepSampling::LogitNormal)}};
constexpr Named kWeightings[] = {
    {"none", int(LossWeighting::None)},
    {"sigma_sqrt", int(LossWeighting::SigmaSqrt)},
    {"cosmap", int(LossWeighting::CosMap)},
    {"logit-normal", int(LossWeighting::LogitNormal)}};

template <size_t N>
std::optional<int> lookup(const Named (&table)[N], llvm::StringRef name) {
  for (const Named &n : table)
    if (name == n.name)
      return n.value;
  return std::nullopt;
}
template <size_t N> llvm::StringRef nameOf(const Named (&table)[N], int v) {
  for (const Named &n : table)
    if (n.value == v)
      return n.name;
  return "?";
}
} // namespace

std::optional<LrSchedule> train::parseLrSchedule(llvm::StringRef name) {
  if (std::optional<int> v = lookup(kSchedules, name))
    return LrSchedule(*v);
  return std::nullopt;
}
llvm::StringRef train::lrScheduleName(LrSchedule schedule) {
  return nameOf(kSchedules, int(schedule));
}
std::optional<TimestepSampling>
train::parseTimestepSampling(llvm::StringRef name) {
  if (std::optional<int> v = lookup(kSamplings, name))
    return TimestepSampling(*v);
  return std::nullopt;
}
llvm::StringRef train::timestepSamplingName(TimestepSampling sampling) {
  return nameOf(kSamplings, int(sampling));
}

std::optional<LossWeighting> train::parseLossWeighting(llvm::StringRef name) {
  if (std::optional<int> v = lookup(kWeightings, name))
    return LossWeighting(*v);
  return std::nullopt;
}
llvm::StringRef train::lossWeightingName(LossWeighting weighting) {
  return nameOf(kWeightings, int(weighting));
}
std::string train::lossWeightingNames() {
  std::string names;
  size_t n = std::size(kWeightings);
  for (size_t i = 0; i < n; ++i)
    names += std::string(i == 0       ? ""
                         : i + 1 == n ? " or "
                                      : ", ") +
             kWeightings[i].name;
  return names;
}

llvm::Error train::checkRecipe(const Recipe &r, double baseLr) {
  auto fail = [](const llvm::Twine &what) {
    return llvm::createStringError(what);
  };
  if (r.warmupSteps < 0)
    return fail("--warmup-steps must be >= 0, got " +
                llvm::Twine(r.warmupSteps));
  if (r.warmupSteps > 0 && r.lrSchedule == LrSchedule::Constant)
    return fail("--warmup-steps needs a warmup schedule: --lr-schedule "
                "warmup-constant, warmup-cosine or warmup-linear");
  // %g: a learning rate of 1e-4 is not "0.00"; before the plan is known
  // the bound is unknown (infinite), not "INF".
  if (!std::isfinite(r.minLr) || r.minLr < 0 || r.minLr > baseLr)
    return fail(std::isfinite(baseLr)
                    ? llvm::formatv("--min-lr must be in [0, lr = {0}], got "
                                    "{1}",
                                    llvm::format("%g", baseLr),
                                    llvm::format("%g", r.minLr))
                          .str()
                    : llvm::formatv("--min-lr must be a finite number in "
                                    "[0, lr], got {0}",
                                    llvm::format("%g", r.minLr))
                          .str());
  if (r.decaySteps < 0)
    return fail("--lr-decay-steps must be >= 0, got " +
                llvm::Twine(r.decaySteps));
  if (r.decaySteps > 0 && r.decaySteps < r.warmupSteps)
    return fail(llvm::formatv("--lr-decay-steps ({0}) must be at least "
                              "--warmup-steps ({1})",
                              r.decaySteps, r.warmupSteps));
  if (!std::isfinite(r.maxGradNorm) || r.maxGradNorm < 0)
    return fail(llvm::formatv("--max-grad-norm must be a positive number "
                              "(0: no clipping), got {0}",
                              r.maxGradNorm));
  if (r.gradAccum < 1 || r.gradAccum > exec::kMaxGradAccum)
    return fail("--grad-accum must be in [1, " +
                llvm::Twine(exec::kMaxGradAccum) +
                "], got " + llvm::Twine(r.gradAccum));
  if (!(r.emaDecay >= 0 && r.emaDecay < 1))
    return fail(llvm::formatv("--ema-decay must be in [0, 1) (0: no EMA), "
                              "got {0}",
                              r.emaDecay));
  if (!std::isfinite(r.logitMean))
    return fail("--logit-mean must be finite");
  if (!(std::isfinite(r.logitStd) && r.logitStd > 0))
    return fail(
        llvm::formatv("--logit-std must be positive, got {0}", r.logitStd));
  if (!(std::isfinite(r.flowShift) && r.flowShift > 0))
    return fail(
        llvm::formatv("--flow-shift must be positive, got {0}", r.flowShift));
  return llvm::Error::success();
}

double train::scheduledLr(const Recipe &r, double lr, int64_t s) {
  if (r.lrSchedule == LrSchedule::Constant)
    return lr;
  if (s < r.warmupSteps)
    return lr * double(s) / double(r.warmupSteps);
  if (r.lrSchedule == LrSchedule::WarmupConstant)
    return lr;
  int64_t span = r.decaySteps - r.warmupSteps;
  double p =
      span > 0 ? std::clamp(double(s - r.warmupSteps) / double(span), 0.0, 1.0)
               : 1.0;
  double keep = r.lrSchedule == LrSchedule::WarmupCosine
                    ? 0.5 * (1.0 + std::cos(M_PI * p))
                    : 1.0 - p;
  return r.minLr + (lr - r.minLr) * keep;
}

double train::shiftSigma(double sigma, double shift) {
  return shift * sigma / (1.0 + (shift - 1.0) * sigma);
}

float train::sampleSigma(const Recipe &r, Random &rng) {
  double sigma;
  if (r.timesteps == TimestepSampling::LogitNormal) {
    double z = r.logitMean + r.logitStd * double(rng.normal());
    sigma = 1.0 / (1.0 + std::exp(-z));
  } else {
    sigma = rng.uniform();
  }
  if (r.flowShift != 1.0)
    sigma = shiftSigma(sigma, r.flowShift);
  return static_cast<float>(sigma);
}

int64_t train::sigmaDraws(const Recipe &r) {
  // Random::normal takes two uniforms, Random::uniform one.
  return r.timesteps == TimestepSampling::LogitNormal ? 2 : 1;
}

float train::lossWeight(const Recipe &r, float sigma) {
  double s = sigma;
  switch (r.weighting) {
  case LossWeighting::None:
    return 1.0f;
  case LossWeighting::SigmaSqrt:
    return static_cast<float>(1.0 / (s * s));
  case LossWeighting::CosMap:
    return static_cast<float>(2.0 / (M_PI * (1.0 - 2.0 * s + 2.0 * s * s)));
  case LossWeighting::LogitNormal: {
    // The density vanishes at both ends (its limit; the formula is 0/0).
    if (!(s > 0.0 && s < 1.0))
      return 0.0f;
    double z = (std::log(s / (1.0 - s)) - r.logitMean) / r.logitStd;
    return static_cast<float>(
        std::exp(-0.5 * z * z) /
        (r.logitStd * std::sqrt(2.0 * M_PI) * s * (1.0 - s)));
  }
  }
  return 1.0f;
}

std::vector<float> train::lossWeights(const Recipe &r,
                                      llvm::ArrayRef<float> sigmas) {
  std::vector<float> weights;
  weights.reserve(sigmas.size());
  for (float sigma : sigmas)
    weights.push_back(lossWeight(r, sigma));
  return weights;
}

static uint64_t sigmaSeed(uint64_t seed, int64_t step) {
  Random mix(seed ^ hashName("timesteps"));
  return mix.next() ^ (static_cast<uint64_t>(step) * 0xD1B54A32D192ED03ull);
}

train::SigmaStream::SigmaStream(const Recipe &recipe, uint64_t seed,
                                int64_t step)
    : recipe(recipe), rng(sigmaSeed(seed, step)) {}

std::vector<float> train::SigmaStream::next(int64_t count) {
  std::vector<float> sigmas(count);
  for (float &sigma : sigmas)
    sigma = sampleSigma(recipe, rng);
  return sigmas;
}

void train::SigmaStream::skip(int64_t count) {
  rng.state += count * sigmaDraws(recipe) * Random::kGamma;
}

std::vector<float> train::sampleSigmas(const Recipe &r, uint64_t seed,
                                       int64_t step, int64_t count) {
  return SigmaStream(r, seed, step).next(count);
}
