//===- SyntheticData.cpp - A learnable flow-matching task -----------------===//

#include "train/SyntheticData.h"

#include "host/Safetensors.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <algorithm>
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
    : DataSource(shapes, seed) {
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

exec::StepInputs DataSource::next() {
  int64_t B = shapes.latents[0];
  int64_t sample = product(shapes.latents, 1);
  exec::StepInputs in;
  std::vector<float> &x0 = in["latents"], &noise = in["noise"],
                     &t = in["timesteps"], &cond = in["condition"];
  x0.reserve(B * sample);
  for (int64_t b = 0; b < B; ++b) {
    size_t k = rng.next() % latents.size();
    x0.insert(x0.end(), latents[k].begin(), latents[k].end());
    cond.insert(cond.end(), conditions[k].begin(), conditions[k].end());
    t.push_back(static_cast<float>(rng.uniform()));
  }
  noise.resize(B * sample);
  for (float &n : noise)
    n = rng.normal();
  return in;
}

llvm::Expected<std::unique_ptr<FileData>>
FileData::open(llvm::StringRef dir, const InputShapes &shapes, uint64_t seed) {
  std::vector<std::string> files;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec;
       it.increment(ec))
    if (llvm::sys::path::extension(it->path()) == ".safetensors")
      files.push_back(it->path());
  if (ec)
    return llvm::createStringError("cannot read data directory '" + dir +
                                   "': " + ec.message());
  if (files.empty())
    return llvm::createStringError("data directory '" + dir +
                                   "' has no .safetensors samples (see "
                                   "docs/Runtime.md, \"Data files\")");
  std::sort(files.begin(), files.end()); // the order must not depend on the FS
  std::unique_ptr<FileData> data(new FileData(shapes, seed));
  std::vector<int64_t> latentShape(shapes.latents.begin() + 1,
                                   shapes.latents.end());
  std::vector<int64_t> conditionShape =
      shapes.conditionIsLabel ? std::vector<int64_t>{1}
                              : std::vector<int64_t>(shapes.condition.begin() + 1,
                                                     shapes.condition.end());
  for (const std::string &file : files) {
    auto reader = host::SafetensorsReader::open(file);
    if (!reader)
      return reader.takeError();
    auto read = [&](llvm::StringRef name, const std::vector<int64_t> &shape,
                    std::vector<float> &out) -> llvm::Error {
      const host::StTensorInfo *t = (*reader)->find(name);
      if (!t)
        return llvm::createStringError("'" + file + "' has no tensor '" +
                                       name + "'");
      if (t->shape != shape) {
        std::string want, got;
        for (int64_t d : shape)
          want += (want.empty() ? "" : ", ") + std::to_string(d);
        for (int64_t d : t->shape)
          got += (got.empty() ? "" : ", ") + std::to_string(d);
        return llvm::createStringError("'" + file + "': tensor '" + name +
                                       "' has shape [" + got +
                                       "]; this plan needs [" + want + "]");
      }
      out.resize(t->numElements());
      return (*reader)->readF32(*t, out);
    };
    std::vector<float> x, c;
    if (llvm::Error err = read("latents", latentShape, x))
      return std::move(err);
    if (llvm::Error err = read("condition", conditionShape, c))
      return std::move(err);
    data->latents.push_back(std::move(x));
    data->conditions.push_back(std::move(c));
  }
  return data;
}
