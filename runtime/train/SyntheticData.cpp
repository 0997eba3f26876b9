//===- SyntheticData.cpp - A learnable flow-matching task -----------------===//

#include "train/SyntheticData.h"

#include <cmath>

using namespace megaslide;
using namespace megaslide::train;

static int64_t product(llvm::ArrayRef<int64_t> shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i)
    n *= shape[i];
  return n;
}

llvm::Expected<InputShapes> InputShapes::of(const exec::ExecPlan &plan) {
  InputShapes s;
  for (int64_t id : plan.inputs) {
    const exec::Value &v = plan.values[id];
    if (v.name == "latents")
      s.latents = v.type.shape;
    else if (v.name == "timesteps")
      s.timesteps = v.type.shape;
    else if (v.name == "condition") {
      s.condition = v.type.shape;
      s.conditionIsLabel = v.type.dtype == exec::DType::I64 ||
                           v.type.dtype == exec::DType::I32;
    }
  }
  if (s.latents.size() != 5 || s.timesteps.size() != 1 || s.condition.empty())
    return llvm::createStringError(
        "the plan's step does not take latents [B, C, T, H, W], timesteps "
        "[B] and a condition; it cannot be fed flow-matching batches");
  return s;
}

SyntheticData::SyntheticData(const InputShapes &shapes, uint64_t seed)
    : shapes(shapes), rng(seed) {
  int64_t C = shapes.latents[1], T = shapes.latents[2], H = shapes.latents[3],
          W = shapes.latents[4];
  Random setup(seed ^ hashName("synthetic-prototypes"));
  for (int k = 0; k < kPrototypes; ++k) {
    // A level per channel (what the condition must be mapped to) plus a
    // plane wave drifting over time: smooth in space, moving in time,
    // different per prototype. The model has no absolute positions, so the
    // level is the part it can learn from the condition alone.
    double fy = 0.5 + 1.5 * setup.uniform(), fx = 0.5 + 1.5 * setup.uniform();
    double speed = 0.3 + 0.7 * setup.uniform();
    std::vector<float> x(C * T * H * W);
    for (int64_t c = 0; c < C; ++c) {
      double phase = 6.283185307179586 * setup.uniform();
      double level = 1.2 * setup.normal();
      double amplitude = 0.3;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t w = 0; w < W; ++w)
            x[((c * T + t) * H + h) * W + w] = static_cast<float>(
                level + amplitude *
                std::sin(6.283185307179586 * (fy * h / H + fx * w / W) +
                         speed * t + phase));
    }
    latents.push_back(std::move(x));
    std::vector<float> cond(shapes.conditionIsLabel
                                ? 1
                                : product(shapes.condition, 1));
    for (float &e : cond)
      e = shapes.conditionIsLabel ? static_cast<float>(k) : setup.normal();
    conditions.push_back(std::move(cond));
  }
}

exec::StepInputs SyntheticData::next() {
  int64_t B = shapes.latents[0];
  int64_t sample = product(shapes.latents, 1);
  exec::StepInputs in;
  std::vector<float> &x0 = in["latents"], &noise = in["noise"],
                     &t = in["timesteps"], &cond = in["condition"];
  x0.reserve(B * sample);
  for (int64_t b = 0; b < B; ++b) {
    int k = static_cast<int>(rng.next() % kPrototypes);
    x0.insert(x0.end(), latents[k].begin(), latents[k].end());
    cond.insert(cond.end(), conditions[k].begin(), conditions[k].end());
    t.push_back(static_cast<float>(rng.uniform()));
  }
  noise.resize(B * sample);
  for (float &n : noise)
    n = rng.normal();
  return in;
}
