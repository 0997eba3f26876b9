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
  // The time t of x_t = (1 - t) x0 + t noise, where trainers such as
  // musubi-tuner count timesteps 0..1000: say so for a value past 1.
  for (auto [flag, v] :
       {std::pair<const char *, double>{"--min-timestep", r.minTimestep},
        {"--max-timestep", r.maxTimestep}})
    if (!(v >= 0 && v <= 1))
      return fail(llvm::formatv(
          "{0} must be in [0, 1], got {1}: the flow-matching time t of x_t = "
          "(1 - t) x0 + t noise (a timestep of 0..1000 divided by 1000)",
          flag, llvm::format("%g", v)));
  if (!(r.minTimestep < r.maxTimestep))
    return fail(llvm::formatv("--min-timestep ({0}) must be below "
                              "--max-timestep ({1})",
                              llvm::format("%g", r.minTimestep),
                              llvm::format("%g", r.maxTimestep)));
  if (!(r.boundary >= 0 && r.boundary < 1))
    return fail(llvm::formatv(
        "--boundary must be in (0, 1), got {0}: the flow-matching time "
        "where the high-noise expert hands over to the low-noise one "
        "(diffusers' boundary_ratio)",
        llvm::format("%g", r.boundary)));
  if (r.twoExperts() && r.hasTimestepRange())
    return fail("--boundary trains both experts, each on its side of the "
                "boundary: give it or --min-timestep/--max-timestep (one "
                "expert), not both");
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

namespace {
double unshiftSigma(double shifted, double shift) {
  return shifted / (shift - (shift - 1.0) * shifted);
}

double normalCdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

/// The standard normal's quantile: Acklam's rational approximation (1e-9
/// relative), then Halley steps on erfc to double precision.
double normalQuantile(double p) {
  if (p <= 0)
    return -INFINITY;
  if (p >= 1)
    return INFINITY;
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                             -2.759285104469687e+02, 1.383577518672690e+02,
                             -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                             -1.556989798598866e+02, 6.680131188771972e+01,
                             -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                             -2.400758277161838e+00, -2.549732539343734e+00,
                             4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                             2.445134137142996e+00, 3.754408661907416e+00};
  double z;
  if (p < 0.02425 || p > 1 - 0.02425) {
    double q = std::sqrt(-2 * std::log(p < 0.5 ? p : 1 - p));
    z = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    if (p > 0.5)
      z = -z;
  } else {
    double q = p - 0.5, s = q * q;
    z = (((((a[0] * s + a[1]) * s + a[2]) * s + a[3]) * s + a[4]) * s + a[5]) *
        q / (((((b[0] * s + b[1]) * s + b[2]) * s + b[3]) * s + b[4]) * s + 1);
  }
  for (int i = 0; i < 2; ++i) {
    double e = normalCdf(z) - p;
    double u = e * std::sqrt(2 * M_PI) * std::exp(z * z / 2);
    z -= u / (1 + z * u / 2);
  }
  return z;
}

/// sampleSigma within [minTimestep, maxTimestep): the draws' uniforms
/// mapped into the range's share of the distribution's CDF (the same
/// number of draws as without a range).
float sampleSigmaInRange(const Recipe &r, Random &rng) {
  // The range of the shifted time, in the unshifted time (shift is
  // monotonic), then in the uniform or the normal the time is made of.
  double lo = unshiftSigma(r.minTimestep, r.flowShift);
  double hi = unshiftSigma(r.maxTimestep, r.flowShift);
  double sigma;
  if (r.timesteps == TimestepSampling::LogitNormal) {
    auto cdf = [&](double s) {
      if (s <= 0)
        return 0.0;
      if (s >= 1)
        return 1.0;
      return normalCdf((std::log(s / (1 - s)) - r.logitMean) / r.logitStd);
    };
    double pLo = cdf(lo), pHi = cdf(hi);
    double p = pLo + rng.uniform() * (pHi - pLo);
    (void)rng.uniform(); // normal()'s second draw
    double z = r.logitMean + r.logitStd * normalQuantile(p);
    sigma = 1.0 / (1.0 + std::exp(-z));
  } else {
    sigma = lo + rng.uniform() * (hi - lo);
  }
  if (r.flowShift != 1.0)
    sigma = shiftSigma(sigma, r.flowShift);
  // In float, within the range: a time rounded up to the boundary would
  // belong to the other expert.
  float f = static_cast<float>(sigma);
  float fLo = static_cast<float>(r.minTimestep);
  if (f < fLo)
    f = fLo < r.minTimestep ? std::nextafter(fLo, 2.0f) : fLo;
  if (static_cast<double>(f) >= r.maxTimestep)
    f = std::nextafter(static_cast<float>(r.maxTimestep), -1.0f);
  if (static_cast<double>(f) >= r.maxTimestep)
    f = std::nextafter(f, -1.0f);
  return f;
}
} // namespace

float train::sampleSigma(const Recipe &r, Random &rng) {
  if (r.hasTimestepRange())
    return sampleSigmaInRange(r, rng);
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

llvm::StringRef train::expertName(int64_t expert) {
  return expert == 0 ? "high" : "low";
}

Recipe train::expertRecipe(const Recipe &recipe, int64_t expert) {
  Recipe r = recipe;
  r.boundary = 0;
  (expert == 0 ? r.minTimestep : r.maxTimestep) = recipe.boundary;
  return r;
}

int64_t train::stepExpert(const Recipe &recipe, uint64_t seed, int64_t step) {
  Recipe whole = recipe;
  whole.boundary = 0;
  SigmaStream choice(whole, seed ^ hashName("expert"), step);
  return choice.next(1)[0] >= recipe.boundary ? 0 : 1;
}

std::vector<float> train::sampleSigmas(const Recipe &r, uint64_t seed,
                                       int64_t step, int64_t count) {
  return SigmaStream(r, seed, step).next(count);
}
