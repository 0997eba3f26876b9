//===- SyntheticData.cpp - A learnable flow-matching task -----------------===//

#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/runtime/cpu/Finite.h"
#include "megaslide/runtime/host/Safetensors.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/xxhash.h"

#include <algorithm>
#include <cmath>
#include <tuple>

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
      s.conditionIsLabel =
          v.type.dtype == exec::DType::I64 || v.type.dtype == exec::DType::I32;
    } else if (v.name != "noise" && v.name != "step" &&
               v.name != exec::kLossWeightsInput) // the session's
      s.extras.push_back({v.name, v.type.shape});
  }
  if (s.latents.size() != 5 || s.timesteps.size() != 1 || s.condition.empty())
    return llvm::createStringError(
        "the plan's step does not take latents [B, C, T, H, W], timesteps "
        "[B] and a condition; it cannot be fed flow-matching batches");
  for (const auto &[name, shape] : s.extras)
    if (shape.empty() || shape[0] != s.latents[0])
      return llvm::createStringError(
          "the plan's step input '" + name +
          "' is not one tensor per sample of the batch; it cannot be fed "
          "from samples");
  return s;
}

std::vector<std::pair<std::string, std::vector<int64_t>>>
InputShapes::sampleTensors() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors;
  tensors.push_back({"condition", conditionIsLabel ? std::vector<int64_t>{1}
                                                   : std::vector<int64_t>(
                                                         condition.begin() + 1,
                                                         condition.end())});
  for (const auto &[name, shape] : extras)
    tensors.push_back(
        {name, std::vector<int64_t>(shape.begin() + 1, shape.end())});
  return tensors;
}

int64_t InputShapes::conditioningElements() const {
  int64_t n = 0;
  for (const auto &[name, shape] : sampleTensors())
    n += product(shape);
  return n;
}

void InputShapes::putConditioning(exec::StepInputs &inputs, int64_t b,
                                  const float *block) const {
  int64_t B = latents[0];
  for (const auto &[name, shape] : sampleTensors()) {
    int64_t n = product(shape);
    std::vector<float> &batch = inputs[name];
    if (b == 0)
      batch.resize(B * n);
    std::copy(block, block + n, batch.data() + b * n);
    block += n;
  }
}

SyntheticData::SyntheticData(const InputShapes &shapes, uint64_t seed)
    : DataSource({shapes}, seed, /*readAhead=*/0) {
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
                level + amplitude * std::sin(6.283185307179586 *
                                                 (fy * h / H + fx * w / W) +
                                             speed * t + phase));
    }
    latents.push_back(std::move(x));
    // The label, or text embeddings (and image conditioning) of normals.
    std::vector<float> cond(shapes.conditioningElements());
    for (float &e : cond)
      e = shapes.conditionIsLabel ? static_cast<float>(k) : setup.normal();
    conditions.push_back(std::move(cond));
  }
}

llvm::Error SyntheticData::readSample(size_t k, float *x, float *c) {
  std::copy(latents[k].begin(), latents[k].end(), x);
  std::copy(conditions[k].begin(), conditions[k].end(), c);
  return llvm::Error::success();
}

uint64_t SyntheticData::bytesKept() const {
  uint64_t bytes = 0;
  for (size_t k = 0; k < latents.size(); ++k)
    bytes += (latents[k].size() + conditions[k].size()) * sizeof(float);
  return bytes;
}

//===----------------------------------------------------------------------===//
// Batches, made in order, optionally ahead
//===----------------------------------------------------------------------===//

DataSource::DataSource(std::vector<InputShapes> shapesOf, uint64_t seed,
                       int readAhead)
    : shapes(shapesOf.front()), bucketShapes(std::move(shapesOf)),
      consumedState(seed), readAhead(readAhead), producedState(seed) {}

DataSource::~DataSource() {
  stopReadAhead();
  for (Made &m : ready)
    if (!m.inputs)
      llvm::consumeError(m.inputs.takeError());
}

void DataSource::stopReadAhead() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  if (worker.joinable())
    worker.join();
}

size_t DataSource::drawBucket(Random &rng) const {
  // Several buckets: the batch's bucket first, with probability n_b / N (a
  // uniform sample index names it), then its samples within it, with
  // replacement (docs/Runtime.md, "Buckets"). One shape draws no bucket,
  // so its sequence is what it always was.
  size_t bucket = 0;
  if (bucketSamples.size() > 1) {
    uint64_t u = rng.next() % numSamples();
    while (u >= bucketSamples[bucket].size())
      u -= bucketSamples[bucket++].size();
  }
  return bucket;
}

DataSource::Made DataSource::make(uint64_t state) {
  Random rng(state);
  size_t bucket = drawBucket(rng);
  const InputShapes &s = bucketShapes[bucket];
  int64_t latent = product(s.latents, 1);
  int64_t B = s.latents[0];
  exec::StepInputs in;
  std::vector<float> &x0 = in["latents"], &noise = in["noise"],
                     &t = in["timesteps"];
  x0.resize(B * latent);
  std::vector<float> block(s.conditioningElements());
  for (int64_t b = 0; b < B; ++b) {
    size_t k =
        bucketSamples.size() > 1
            ? bucketSamples[bucket][rng.next() % bucketSamples[bucket].size()]
            : rng.next() % numSamples();
    if (llvm::Error e = readSample(k, x0.data() + b * latent, block.data()))
      return {std::move(e), state};
    s.putConditioning(in, b, block.data());
    t.push_back(static_cast<float>(rng.uniform()));
  }
  noise.resize(B * latent);
  for (float &n : noise)
    n = rng.normal();
  return {std::move(in), rng.state, bucket};
}

uint64_t DataSource::stateAfter(uint64_t state, int64_t batches) const {
  // As make() draws: the bucket (where there are several), then per sample
  // its index and timestep, then two uniforms per element of noise.
  for (int64_t n = 0; n < batches; ++n) {
    Random rng(state);
    const InputShapes &s = bucketShapes[drawBucket(rng)];
    uint64_t B = s.latents[0];
    uint64_t draws = 2 * B + 2 * B * product(s.latents, 1);
    state = rng.state + draws * Random::kGamma;
  }
  return state;
}

llvm::Expected<exec::StepInputs> DataSource::next(size_t *bucket) {
  if (readAhead == 0) {
    Made m = make(consumedState);
    if (m.inputs) {
      finishBatch(m, consumedInStep);
      consumedState = m.stateAfter;
      if (m.endsShare)
        jobState = m.jobStateAfter;
    }
    if (bucket)
      *bucket = m.bucket;
    return std::move(m.inputs);
  }
  std::unique_lock<std::mutex> lock(mu);
  if (!worker.joinable())
    worker = std::thread([this] { readAheadLoop(); });
  cv.wait(lock, [&] { return !ready.empty(); });
  Made m = std::move(ready.front());
  ready.pop_front();
  if (!m.inputs) {
    // Made again from the same state when asked again: the same error.
    ready.clear();
    producedState = consumedState;
    producedInStep = consumedInStep;
    ++generation;
  } else {
    consumedState = m.stateAfter;
    consumedInStep = m.endsShare ? 0 : consumedInStep + 1;
    if (m.endsShare)
      jobState = m.jobStateAfter;
  }
  if (bucket)
    *bucket = m.bucket;
  lock.unlock();
  cv.notify_all();
  return std::move(m.inputs);
}

void DataSource::readAheadLoop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    // Nothing is made past an error: the state after it is unknown.
    cv.wait(lock, [&] {
      return stopping || (static_cast<int>(ready.size()) < readAhead &&
                          (ready.empty() || ready.back().ok));
    });
    if (stopping)
      return;
    uint64_t gen = generation, from = producedState;
    int64_t inStep = producedInStep;
    lock.unlock();
    Made m = make(from);
    m.ok = static_cast<bool>(m.inputs);
    if (m.ok)
      finishBatch(m, inStep);
    lock.lock();
    if (gen != generation) { // setState() or an error reset the sequence
      if (!m.ok)
        llvm::consumeError(m.inputs.takeError());
      continue;
    }
    producedState = m.stateAfter;
    producedInStep = inStep;
    ready.push_back(std::move(m));
    cv.notify_all();
  }
}

void DataSource::setState(uint64_t s) {
  // With a share, the job's state: this rank starts its share of the step.
  uint64_t local = s;
  if (shareRanks > 1) {
    jobState = s;
    local = stateAfter(s, shareRank * sharePerStep);
  }
  if (local == consumedState && consumedInStep == 0)
    return; // what is read ahead is still the sequence's next
  {
    std::lock_guard<std::mutex> lock(mu);
    for (Made &m : ready)
      if (!m.ok)
        llvm::consumeError(m.inputs.takeError());
    ready.clear();
    ++generation;
    producedState = consumedState = local;
    producedInStep = consumedInStep = 0;
  }
  cv.notify_all();
}

void DataSource::setShare(int64_t rank, int64_t ranks, int64_t perStep) {
  uint64_t job = state();
  shareRank = rank;
  shareRanks = ranks;
  sharePerStep = perStep;
  setState(job);
}

void DataSource::finishBatch(Made &m, int64_t &inStep) const {
  if (shareRanks == 1 || ++inStep < sharePerStep)
    return;
  inStep = 0;
  m.endsShare = true;
  m.jobStateAfter = stateAfter(
      m.stateAfter, (shareRanks - 1 - shareRank) * sharePerStep);
  m.stateAfter = stateAfter(m.jobStateAfter, shareRank * sharePerStep);
}

uint64_t DataSource::bytesHeld() const {
  // Each batch: latents, noise, conditioning and timesteps in fp32; the one
  // handed out plus those made ahead.
  // Buckets: each as large as the largest bucket's.
  uint64_t batch = 0;
  for (const InputShapes &s : bucketShapes)
    batch = std::max<uint64_t>(
        batch, s.latents[0] *
                   (2 * product(s.latents, 1) + s.conditioningElements() + 1) *
                   sizeof(float));
  return bytesKept() + (readAhead + 1) * batch;
}

//===----------------------------------------------------------------------===//
// Sample files
//===----------------------------------------------------------------------===//

namespace {
std::string shapeText(llvm::ArrayRef<int64_t> shape) {
  std::string text;
  for (int64_t d : shape)
    text += (text.empty() ? "" : ", ") + std::to_string(d);
  return "[" + text + "]";
}
} // namespace

/// The `*.safetensors` files of `dir`, sorted; errors name the folder.
static llvm::Expected<std::vector<std::string>>
listSampleFiles(llvm::StringRef dir) {
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
  return files;
}

llvm::Expected<std::unique_ptr<FileData>>
FileData::open(llvm::StringRef dir, const InputShapes &shapes, uint64_t seed) {
  llvm::Expected<std::vector<std::string>> files = listSampleFiles(dir);
  if (!files)
    return files.takeError();
  std::unique_ptr<FileData> data(
      new FileData({shapes}, seed, std::move(*files)));
  // Every header now, so that a wrong file stops the run before its first
  // step rather than hours into it; the tensors are read when drawn.
  for (const std::string &file : data->files) {
    auto reader = host::SafetensorsReader::open(file);
    if (!reader)
      return reader.takeError();
    if (llvm::Error e = data->checkHeader(**reader, 0))
      return std::move(e);
    data->addToDigest(**reader);
  }
  data->bucketSamples.assign(1, {});
  for (size_t k = 0; k < data->files.size(); ++k)
    data->bucketSamples[0].push_back(k);
  return data;
}

llvm::Expected<std::unique_ptr<FileData>>
FileData::open(llvm::StringRef dir, std::vector<InputShapes> shapes,
               llvm::ArrayRef<std::string> names, uint64_t seed) {
  llvm::Expected<std::vector<std::string>> files = listSampleFiles(dir);
  if (!files)
    return files.takeError();
  size_t numBuckets = shapes.size();
  std::unique_ptr<FileData> data(new FileData(shapes, seed, std::move(*files)));
  auto latentShape = [&](size_t b) {
    return std::vector<int64_t>(shapes[b].latents.begin() + 1,
                                shapes[b].latents.end());
  };
  std::string known;
  for (size_t b = 0; b < numBuckets; ++b)
    known += (b ? ", " : "") + names[b] + " (latents " +
             shapeText(latentShape(b)) + ")";
  data->bucketSamples.assign(numBuckets, {});
  for (size_t k = 0; k < data->files.size(); ++k) {
    const std::string &file = data->files[k];
    auto reader = host::SafetensorsReader::open(file);
    if (!reader)
      return reader.takeError();
    const host::StTensorInfo *latents = (*reader)->find("latents");
    if (!latents)
      return llvm::createStringError("'" + file + "' has no tensor 'latents'");
    const auto &meta = (*reader)->metadata();
    auto named = meta.find("megaslide.bucket");
    size_t bucket = numBuckets;
    if (named != meta.end()) {
      bucket = llvm::find(names, named->second) - names.begin();
      if (bucket == numBuckets)
        return llvm::createStringError(
            "'" + file + "': its bucket " + named->second + " (latents " +
            shapeText(latents->shape) + ") is not one of this run's: " + known +
            "; add it to the bucket file or remove the sample");
      if (latents->shape != latentShape(bucket))
        return llvm::createStringError(
            "'" + file + "': its megaslide.bucket metadata says " +
            named->second + ", whose latents are " +
            shapeText(latentShape(bucket)) + ", but its latents are " +
            shapeText(latents->shape) + "; rewrite the sample");
    } else {
      for (bucket = 0; bucket < numBuckets; ++bucket)
        if (latents->shape == latentShape(bucket))
          break;
      if (bucket == numBuckets)
        return llvm::createStringError(
            "'" + file + "': its latents " + shapeText(latents->shape) +
            " are in no bucket of this run: " + known +
            "; add its shape to the bucket file or remove the sample");
    }
    if (llvm::Error e = data->checkHeader(**reader, bucket))
      return std::move(e);
    data->addToDigest(**reader);
    data->fileBucket[k] = bucket;
    data->bucketSamples[bucket].push_back(k);
  }
  return data;
}

void FileData::addToDigest(const host::SafetensorsReader &reader) {
  std::string text = llvm::sys::path::filename(reader.path()).str();
  text += '\0' + std::to_string(reader.fileSize());
  for (const host::StTensorInfo &t : reader.tensors()) {
    text += '\0' + t.name + '\0' + std::to_string(static_cast<int>(t.dtype));
    for (int64_t d : t.shape)
      text += ',' + std::to_string(d);
  }
  for (const auto &[key, value] : reader.metadata())
    text += '\0' + key + '=' + value;
  digestText += llvm::formatv("{0:x16}", llvm::xxh3_64bits(text)).str();
}

std::string FileData::digest() const {
  return llvm::formatv("{0} samples, xxh3 {1:x16}", files.size(),
                       llvm::xxh3_64bits(digestText))
      .str();
}

llvm::Error FileData::checkHeader(const host::SafetensorsReader &reader,
                                  size_t bucket) const {
  const InputShapes &shapes = bucketShapes[bucket];
  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"latents",
       std::vector<int64_t>(shapes.latents.begin() + 1, shapes.latents.end())}};
  for (auto &tensor : shapes.sampleTensors())
    tensors.push_back(std::move(tensor));
  for (const auto &[name, shape] : tensors) {
    const host::StTensorInfo *t = reader.find(name);
    if (!t)
      return llvm::createStringError(
          "'" + reader.path() + "' has no tensor '" + name + "'" +
          (name.rfind("image_", 0) == 0
               ? "; an image-conditioned model needs each sample's "
                 "image_embeds and image_condition (megaslide-prepare "
                 "writes them for an image-to-video model)"
               : ""));
    if (t->shape != shape)
      return llvm::createStringError(
          "'" + reader.path() + "': tensor '" + name + "' has shape " +
          shapeText(t->shape) + "; this plan needs " + shapeText(shape));
    if (t->dtype != host::StDType::F32 && t->dtype != host::StDType::BF16 &&
        t->dtype != host::StDType::F16)
      return llvm::createStringError(
          "'" + reader.path() + "': tensor '" + name + "' has dtype " +
          host::stDTypeName(t->dtype) + "; samples are F32, BF16 or F16");
  }
  return llvm::Error::success();
}

llvm::Error FileData::readSample(size_t k, float *x, float *c) {
  auto reader = host::SafetensorsReader::open(files[k]);
  if (!reader)
    return reader.takeError();
  // The file may have changed since open(): its header is checked again.
  const InputShapes &s = bucketShapes[fileBucket[k]];
  if (llvm::Error e = checkHeader(**reader, fileBucket[k]))
    return e;
  std::vector<std::tuple<std::string, float *, int64_t>> tensors = {
      {"latents", x, product(s.latents, 1)}};
  for (const auto &[name, shape] : s.sampleTensors()) {
    tensors.push_back({name, c, product(shape)});
    c += product(shape);
  }
  for (const auto &[name, out, n] : tensors) {
    const host::StTensorInfo *t = (*reader)->find(name);
    if (llvm::Error e = (*reader)->readF32(*t, {out, static_cast<size_t>(n)}))
      return e;
    if (std::optional<int64_t> bad = cpu::firstNonFinite(out, n))
      return llvm::createStringError(
          "data sample '" + files[k] + "': tensor '" + name + "' holds " +
          (std::isnan(out[*bad]) ? "nan" : "inf") + " at element " +
          llvm::Twine(*bad) + "; remove or fix the file");
  }
  return llvm::Error::success();
}
