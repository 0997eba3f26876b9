//===- Session.cpp - A training run over an execution plan ----------------===//

#include "megaslide/runtime/train/Session.h"

#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include <unistd.h>

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/CudaPlan.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/sim/SimBackend.h"
#include "megaslide/runtime/support/Json.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/xxhash.h"

using namespace megaslide;
using namespace megaslide::train;

/// Version of trainerState()'s JSON: 2 adds the settings, 3 the EMA's
/// update count and the previous step's gradient norm.
static constexpr int64_t kTrainerStateVersion = 3;

Session::Session(std::vector<std::unique_ptr<exec::ExecPlan>> plans,
                 std::vector<std::string> names,
                 std::vector<InputShapes> shapes, SessionOptions options,
                 std::unique_ptr<DataSource> data)
    : plans(std::move(plans)), names(std::move(names)),
      shapesOf(std::move(shapes)), options(std::move(options)),
      seed(this->options.seed), data(std::move(data)) {}

Session::~Session() {
  // The cuda backend keeps its pinned pools for the next bucket's backend;
  // a finished session (a Python Trainer going away) gives them back.
  executor.reset();
  cuda::releasePinnedPools();
}

uint64_t HostMemoryNeed::total() const {
  uint64_t sum = 0;
  for (const auto &part : parts)
    sum += part.second;
  return sum;
}

/// What a computing backend holds in host memory for `plan`: upper bounds
/// from the plan's own sizes (docs/Runtime.md, "Host memory").
static HostMemoryNeed hostMemoryNeed(const exec::ExecPlan &plan,
                                     llvm::StringRef backend,
                                     const DataSource &data,
                                     const Recipe &recipe, bool deferred) {
  HostMemoryNeed need;
  uint64_t state = 0;
  for (const exec::Param &p : plan.params)
    if (p.role == "master" || p.role == "moment" || p.role == "frozen")
      state += p.type.numElements() * sizeof(float);
  need.parts.push_back({"host state (fp32 masters, AdamW moments)", state});
  uint64_t hostValues = 0;
  for (const exec::Value &v : plan.values)
    if (v.home != exec::Home::Device)
      hostValues += v.type.bytes();
  need.parts.push_back(
      {"host buffers of the plan (step inputs, gradients, offloaded "
       "activations)",
       hostValues});
  if (backend == "cpu") {
    need.parts.push_back(
        {"device arena (the cpu backend holds it in host memory)",
         static_cast<uint64_t>(plan.arenaBytes)});
    // Each kernel runs on fp32 copies of its floating-point operands.
    uint64_t widest = 0;
    for (const exec::Instruction &inst : plan.instructions) {
      uint64_t bytes = 0;
      for (const auto *ids : {&inst.operands, &inst.results})
        for (int64_t id : *ids)
          bytes += plan.values[id].type.numElements() * sizeof(float);
      widest = std::max(widest, bytes);
    }
    need.parts.push_back({"fp32 operands of the largest kernel", widest});
  } else {
    need.parts.push_back(
        {"pinned weight staging",
         static_cast<uint64_t>(cuda::weightStagingBytes(plan))});
  }
  need.parts.push_back(
      {"data (samples in memory, batches read ahead)", data.bytesHeld()});
  uint64_t retained = 0, accum = 0, ema = 0;
  for (const exec::Instruction &inst : plan.instructions) {
    if (inst.op != exec::OpCode::HostAdamW)
      continue;
    const exec::TensorType &g = plan.values[inst.operands[0]].type;
    if (recipe.gradAccum > 1)
      accum += g.numElements() * sizeof(float);
    else if (deferred)
      retained += g.bytes();
    if (recipe.hasEma())
      ema += g.numElements() * (recipe.emaBf16 ? 2 : 4);
  }
  need.parts.push_back({"gradients kept for the deferred update", retained});
  need.parts.push_back({"gradient accumulation (fp32)", accum});
  need.parts.push_back({"EMA of the weights", ema});
  return need;
}

static llvm::Expected<std::unique_ptr<exec::Backend>>
createBackend(const exec::ExecPlan &plan, const SessionOptions &options) {
  if (options.backend == "sim") {
    sim::HardwareModel hw;
    if (!options.hardwarePath.empty()) {
      llvm::Expected<sim::HardwareModel> loaded =
          sim::loadHardwareModel(options.hardwarePath);
      if (!loaded)
        return loaded.takeError();
      hw = std::move(*loaded);
    }
    auto backend = sim::SimBackend::create(plan, std::move(hw));
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  if (options.backend == "cuda") {
    auto backend = cuda::CudaBackend::create(plan);
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  if (options.backend == "cpu") {
    auto backend = cpu::CpuBackend::create(plan);
    if (!backend)
      return backend.takeError();
    return std::unique_ptr<exec::Backend>(std::move(*backend));
  }
  return llvm::createStringError("unknown backend '" + options.backend +
                                 "' (use cpu, cuda or sim)");
}

static std::string formatDouble(double v) {
  return llvm::formatv("{0}", llvm::format("%.17g", v)).str();
}

static Settings
computeSettings(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
                llvm::ArrayRef<std::string> names,
                const SessionOptions &options, bool deferred,
                const DataSource &samples) {
  const exec::ExecPlan &plan = *plans.front();
  Settings s;
  s.push_back({"seed", std::to_string(options.seed)});
  std::string data = "(synthetic)";
  if (!options.dataDir.empty()) {
    llvm::SmallString<256> real;
    data = llvm::sys::fs::real_path(options.dataDir, real) ? options.dataDir
                                                           : std::string(real);
  }
  s.push_back({"data", data});
  // The folder's samples, not only its path: a resume over samples added,
  // removed or replaced would not continue the run.
  if (std::string digest = samples.digest(); !digest.empty())
    s.push_back({"data_samples", digest});
  s.push_back({"model", plan.model});
  for (const exec::Instruction &inst : plan.instructions) {
    if (inst.op != exec::OpCode::HostAdamW)
      continue;
    for (const char *name : {"lr", "beta1", "beta2", "eps", "weight_decay"})
      if (std::optional<double> v = inst.floatAttr(name))
        s.push_back({name, formatDouble(*v)});
    break;
  }
  for (const exec::Instruction &inst : plan.instructions)
    if (inst.op == exec::OpCode::Fetch) {
      s.push_back({"precision",
                   llvm::StringRef(
                       exec::dtypeName(plan.values[inst.results[0]].type.dtype))
                       .lower()});
      break;
    }
  s.push_back({"batch", std::to_string(plan.batch)});
  const Recipe &r = options.recipe;
  s.push_back({"update", deferred ? "deferred" : "streaming"});
  s.push_back({"lr_schedule", lrScheduleName(r.lrSchedule).str()});
  if (r.lrSchedule != LrSchedule::Constant) {
    s.push_back({"warmup_steps", std::to_string(r.warmupSteps)});
    if (r.lrSchedule != LrSchedule::WarmupConstant) {
      s.push_back({"min_lr", formatDouble(r.minLr)});
      s.push_back({"lr_decay_steps", std::to_string(r.decaySteps)});
    }
  }
  s.push_back({"max_grad_norm", formatDouble(r.maxGradNorm)});
  // The job's micro-batches per step, however many ranks take them: a
  // checkpoint resumes on another number of ranks with the same total
  // (docs/Distributed.md, "Checkpoints").
  int64_t jobAccum =
      r.gradAccum * (options.collectives ? options.collectives->size() : 1);
  s.push_back({"grad_accum", std::to_string(jobAccum)});
  s.push_back({"ema_decay", formatDouble(r.emaDecay)});
  if (r.hasEma()) {
    s.push_back({"ema_warmup", r.emaWarmup ? "true" : "false"});
    s.push_back({"ema_dtype", r.emaBf16 ? "bf16" : "f32"});
  }
  s.push_back({"timestep_sampling", timestepSamplingName(r.timesteps).str()});
  if (r.timesteps == TimestepSampling::LogitNormal) {
    s.push_back({"logit_mean", formatDouble(r.logitMean)});
    s.push_back({"logit_std", formatDouble(r.logitStd)});
  }
  s.push_back({"flow_shift", formatDouble(r.flowShift)});
  // Buckets: every bucket's plan, so that a resume with another set of
  // buckets (or another plan for one) is refused.
  // Hashed with the job's micro-batches: a rank's share is not the run's.
  auto serializeForJob = [&](const exec::ExecPlan &p) {
    if (p.gradAccum == jobAccum)
      return exec::serialize(p);
    exec::ExecPlan job = p;
    job.gradAccum = jobAccum;
    return exec::serialize(job);
  };
  std::string text = serializeForJob(plan);
  if (!names.front().empty()) {
    std::string all, list;
    for (size_t b = 0; b < plans.size(); ++b) {
      text = serializeForJob(*plans[b]);
      all += names[b] + "\n" + std::to_string(text.size()) + "\n" + text;
      list += (b ? "," : "") + names[b];
    }
    s.push_back({"buckets", list});
    text = std::move(all);
  }
  s.push_back({"plan_hash",
               llvm::formatv("{0:x-16}", llvm::xxh3_64bits(
                                             llvm::arrayRefFromStringRef(text)))
                   .str()});
  return s;
}

/// What the host optimizer does of the recipe.
static host::HostOptimizer::Options
optimizerOptions(const Recipe &r, bool deferred,
                 dist::Collectives *collectives) {
  host::HostOptimizer::Options o;
  o.deferred = deferred;
  o.collectives = collectives;
  o.gradAccum = r.gradAccum;
  o.maxGradNorm = r.maxGradNorm;
  o.emaDecay = r.emaDecay;
  o.emaWarmup = r.emaWarmup;
  o.emaBf16 = r.emaBf16;
  return o;
}

llvm::Expected<std::unique_ptr<Session>>
Session::create(exec::ExecPlan plan, const SessionOptions &options) {
  std::vector<BucketPlan> one;
  one.push_back({"", std::move(plan)});
  return create(std::move(one), options);
}

/// Why `b`'s plan cannot share a host state with `a`'s (same parameters:
/// names, roles, shapes, dtypes), if it cannot.
static std::optional<std::string> paramMismatch(const exec::ExecPlan &a,
                                                const exec::ExecPlan &b) {
  auto text = [](const exec::Param &p) {
    std::string shape;
    for (int64_t d : p.type.shape)
      shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    return llvm::formatv("'{0}' ({1} {2} [{3}])", p.name, p.role,
                         exec::dtypeName(p.type.dtype), shape)
        .str();
  };
  size_t n = std::max(a.params.size(), b.params.size());
  for (size_t i = 0; i < n; ++i) {
    if (i >= a.params.size() || i >= b.params.size())
      return llvm::formatv("{0} parameters against {1}", a.params.size(),
                           b.params.size())
          .str();
    const exec::Param &p = a.params[i], &q = b.params[i];
    if (p.name != q.name || p.role != q.role || p.of != q.of ||
        p.type.shape != q.type.shape || p.type.dtype != q.type.dtype)
      return "parameter " + text(p) + " against " + text(q);
  }
  return std::nullopt;
}

llvm::Expected<std::unique_ptr<Session>>
Session::create(std::vector<BucketPlan> bucketPlans,
                const SessionOptions &options) {
  if (bucketPlans.empty())
    return llvm::createStringError("a session needs a plan");
  std::vector<std::unique_ptr<exec::ExecPlan>> plans;
  std::vector<std::string> names;
  std::vector<double> predicted;
  std::vector<InputShapes> shapesOf;
  for (BucketPlan &b : bucketPlans) {
    llvm::Expected<InputShapes> shapes = InputShapes::of(b.plan);
    if (!shapes)
      return shapes.takeError();
    shapesOf.push_back(std::move(*shapes));
    names.push_back(b.name);
    predicted.push_back(b.predictedSeconds);
    plans.push_back(std::make_unique<exec::ExecPlan>(std::move(b.plan)));
  }
  bool bucketed = !names.front().empty();
  auto bucket = [&](size_t b) { return "bucket " + names[b]; };
  for (size_t b = 1; b < plans.size(); ++b)
    if (std::optional<std::string> why = paramMismatch(*plans[0], *plans[b]))
      return llvm::createStringError(
          "the plans of " + bucket(0) + " and " + bucket(b) +
          " do not share their parameters (" + *why +
          "): every bucket's plan must come from the same model and flags");
  // What the recipe needs of the plan: its updates' lr, and whether they
  // are deferred (the planner decides, docs/Training.md).
  bool deferred = false, streaming = false;
  double baseLr = exec::kDefaultLr;
  for (size_t b = 0; b < plans.size(); ++b) {
    bool planDefers = false, planStreams = false;
    for (const exec::Instruction &inst : plans[b]->instructions)
      if (inst.op == exec::OpCode::HostAdamW) {
        (inst.hasAttr(exec::kDeferredAttr) ? planDefers : planStreams) = true;
        if (b == 0)
          baseLr = inst.floatAttr("lr").value_or(baseLr);
      }
    if (planDefers && planStreams)
      return llvm::createStringError(
          "the plan defers some updates and not others; recompile it");
    if (b > 0 && (planDefers != deferred || planStreams != streaming))
      return llvm::createStringError(
          "the plans of " + bucket(0) + " and " + bucket(b) +
          " differ in their update (deferred in one, streaming in the "
          "other): give --update deferred or streaming");
    deferred = planDefers;
    streaming = planStreams;
  }
  const InputShapes &first = shapesOf.front();
  uint64_t dataSeed = options.seed ^ hashName("batches");
  std::unique_ptr<DataSource> data;
  if (bucketed && options.dataDir.empty())
    return llvm::createStringError(
        "a run over buckets trains on sample files: give --data DIR");
  if (options.dataDir.empty()) {
    data = std::make_unique<SyntheticData>(first, dataSeed);
  } else {
    auto files =
        bucketed ? FileData::open(options.dataDir, shapesOf, names, dataSeed)
                 : FileData::open(options.dataDir, first, dataSeed);
    if (!files)
      return files.takeError();
    data = std::move(*files);
  }
  std::unique_ptr<DataSource> valData;
  if (!options.valDataDir.empty()) {
    uint64_t valSeed = options.seed ^ hashName("validation");
    auto files =
        bucketed ? FileData::open(options.valDataDir, shapesOf, names, valSeed)
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
    valData = std::move(*files);
  }
  if (llvm::Error e = checkRecipe(options.recipe, baseLr))
    return std::move(e);
  if (options.collectives && options.collectives->size() > 1 && !deferred &&
      streaming)
    return llvm::createStringError(llvm::formatv(
        "data parallelism ({0} ranks) needs the deferred update (the job's "
        "gradient is complete only when every rank's backward ends), and "
        "this plan updates as gradients arrive (--update streaming); plan "
        "with --update deferred",
        options.collectives->size()));
  if (options.recipe.gradAccum > 1 && !deferred && streaming)
    return llvm::createStringError(
        "--grad-accum needs the deferred update (the accumulated gradient "
        "is complete only when the last micro-batch's backward ends), and "
        "this plan updates as gradients arrive (--update streaming); plan "
        "with --update deferred");
  std::unique_ptr<Session> session(
      new Session(std::move(plans), std::move(names), std::move(shapesOf),
                  options, std::move(data)));
  session->valData = std::move(valData);
  session->predicted = std::move(predicted);
  session->deferred = deferred;
  session->baseLr = baseLr;
  const exec::ExecPlan &p = session->plan();
  // Only backends that compute hold the model state (sim needs none): the
  // 105B state is 1.27 TB, so check that everything fits, summed, before
  // the backend or the state touches a byte.
  bool computes = options.backend != "sim";
  if (computes) {
    // One bucket's backend is alive at a time: each part as large as the
    // largest bucket's (the state is the same for all).
    for (const std::unique_ptr<exec::ExecPlan> &plan : session->plans) {
      HostMemoryNeed one = hostMemoryNeed(
          *plan, options.backend, *session->data, options.recipe, deferred);
      HostMemoryNeed &need = session->memoryNeed;
      if (need.parts.empty())
        need = std::move(one);
      else
        for (size_t i = 0; i < need.parts.size(); ++i)
          need.parts[i].second =
              std::max(need.parts[i].second, one.parts[i].second);
    }
    uint64_t need = session->memoryNeed.total();
    host::HostMemoryReadings readings = host::readHostMemory();
    llvm::Expected<uint64_t> usable = host::usableHostMemoryBytes(readings);
    if (!usable)
      return usable.takeError();
    uint64_t have = *usable;
    if (need > have) {
      // Sizes in the unit of their magnitude (1MB is not "0.00 GiB"),
      // right-aligned.
      size_t width = 0;
      for (const auto &part : session->memoryNeed.parts)
        width = std::max(width, formatBytes(part.second).size());
      std::string parts;
      for (const auto &[what, bytes] : session->memoryNeed.parts)
        if (bytes)
          parts += "\n  " +
                   std::string(width - formatBytes(bytes).size(), ' ') +
                   formatBytes(bytes) + "  " + what;
      return llvm::createStringError(
          "'" + p.model + "' on the " + options.backend + " backend needs " +
          formatBytes(need) + " of host memory, but this machine has " +
          formatBytes(have) +
          (readings.override
               ? std::string(" (as MEGASLIDE_HOST_MEMORY says):")
               : std::string(" (MemTotal or its memory blocks, capped by "
                             "the cgroup's limit):")) +
          parts +
          "\nuse --backend sim to predict it, a smaller model or video, or "
          "--activation-policy recompute; where memory grows as it is used "
          "(some VMs), set MEGASLIDE_HOST_MEMORY to what the machine has");
    }
  }
  auto backend = createBackend(p, options);
  if (!backend)
    return backend.takeError();
  session->executor = std::move(*backend);
  if (session->executor->computesLoss()) {
    session->hostState = host::initHostState(p, options.seed);
    session->runSettings = computeSettings(session->plans, session->names,
                                           options, deferred, *session->data);
    session->optimizer.prepare(p, session->hostState,
                               optimizerOptions(options.recipe, deferred,
                                                options.collectives));
  }
  return session;
}

std::vector<size_t> Session::bucketSamples() const {
  std::vector<size_t> counts;
  for (const std::vector<size_t> &samples : data->buckets())
    counts.push_back(samples.size());
  return counts;
}

llvm::Error Session::useBucket(size_t bucket) {
  if (executor && live == bucket)
    return llvm::Error::success();
  // Every decided update lands first: the next backend starts from the
  // host state alone.
  flushUpdates();
  executor.reset(); // its device memory goes before the next one's comes
  auto backend = createBackend(*plans[bucket], options);
  if (!backend)
    return backend.takeError();
  executor = std::move(*backend);
  live = bucket;
  return llvm::Error::success();
}

host::HostTensor *Session::ema(llvm::StringRef name) {
  flushUpdates();
  return hostState.find((name + ".ema").str());
}

void Session::flushUpdates() { optimizer.flush(); }

llvm::Expected<StepReport>
Session::trainStep(const exec::StepOptions &options) {
  if (hostState.incomplete)
    return runStep({}, {}).takeError(); // the error below, before drawing data
  uint64_t before = data->state();
  // A rank of a job takes its own micro-batches of the job's sequence:
  // rank r those after r K others', whatever the job's size
  // (docs/Distributed.md, "Data").
  int64_t K = this->options.recipe.gradAccum, ranks = 1, rank = 0;
  if (dist::Collectives *c = this->options.collectives) {
    ranks = c->size();
    rank = c->rank();
  }
  if (ranks > 1 && fault::hangs(rank, hostState.step + 1))
    for (;;)
      ::pause(); // a test's hung rank: only SIGKILL ends it
  if (ranks > 1)
    data->setState(data->stateAfter(before, rank * K));
  llvm::Expected<StepReport> report = optimizerStep(
      [&](int64_t, size_t &bucket) -> llvm::Expected<exec::StepInputs> {
        llvm::Expected<exec::StepInputs> batch = data->next(&bucket);
        if (batch)
          batch->erase("timesteps"); // the recipe's (optimizerStep)
        return batch;
      },
      options);
  if (!report) {
    data->setState(before); // a retry draws the same batches
    return report;
  }
  if (ranks > 1)
    data->setState(data->stateAfter(before, ranks * K));
  ++stepsRunSoFar;
  return report;
}

llvm::Expected<StepReport>
Session::trainStep(std::vector<exec::StepInputs> inputs,
                   const exec::StepOptions &options) {
  if (static_cast<int64_t>(inputs.size()) != this->options.recipe.gradAccum)
    return llvm::createStringError(llvm::formatv(
        "an optimizer step takes {0} micro-batches (--grad-accum), got {1}",
        this->options.recipe.gradAccum, inputs.size()));
  // The first bucket's shape: the caller's batches carry no bucket.
  llvm::Expected<StepReport> report = optimizerStep(
      [&](int64_t k, size_t &bucket) -> llvm::Expected<exec::StepInputs> {
        bucket = 0;
        return std::move(inputs[k]);
      },
      options);
  if (report)
    ++stepsRunSoFar;
  return report;
}

llvm::Expected<StepReport>
Session::optimizerStep(MicroBatches nextBatch, const exec::StepOptions &given) {
  const Recipe &r = options.recipe;
  int64_t K = r.gradAccum;
  int64_t B = shapesOf[0].latents[0]; // every bucket's batch
  // Micro-batch k with its timesteps (samples k B .. k B + B - 1 of the
  // step's sigmas, sampleSigmas), drawn in order, one at a time.
  SigmaStream sigmas(r, seed, hostState.step);
  dist::Collectives *job = options.collectives;
  int64_t ranks = job ? job->size() : 1;
  if (ranks > 1)
    sigmas.skip(job->rank() * K * B); // the micro-batches of ranks before
  std::vector<size_t> buckets;
  auto draw = [&](int64_t k) -> llvm::Expected<exec::StepInputs> {
    size_t bucket = 0;
    llvm::Expected<exec::StepInputs> batch = nextBatch(k, bucket);
    std::vector<float> t = sigmas.next(B);
    if (!batch)
      return batch.takeError();
    if (!batch->count("timesteps"))
      (*batch)["timesteps"] = std::move(t);
    buckets.push_back(bucket);
    return batch;
  };

  StepReport report;
  report.microBatches = K;
  report.lr = scheduledLr(r, baseLr, hostState.step);
  bool computes = executor->computesLoss();
  exec::StepOptions options = given;
  options.lr = report.lr;
  if (!computes || !given.applyUpdates) {
    // Timing only, or gradients only: no optimizer decisions.
    for (int64_t k = 0; k < K; ++k) {
      llvm::Expected<exec::StepInputs> batch = draw(k);
      if (!batch)
        return batch.takeError();
      llvm::Expected<exec::StepResult> one =
          runStepOn(buckets.back(), *batch, options);
      if (!one)
        return one.takeError();
      double seconds = report.result.seconds + one->seconds;
      float loss = report.result.loss + one->loss / K;
      report.result = std::move(*one);
      report.result.seconds = seconds;
      report.result.loss = loss;
    }
    report.buckets = buckets;
    return report;
  }

  if (!deferred) {
    // Streaming: the backend updates as gradients land, clipped with the
    // previous step's norm (docs/Training.md, "Streaming update").
    double factor = optimizer.beginStreamingStep();
    options.gradScale = static_cast<float>(factor);
    report.clipped = factor < 1.0;
    llvm::Expected<exec::StepInputs> batch = draw(0);
    if (!batch)
      return batch.takeError();
    llvm::Expected<exec::StepResult> one =
        runStepOn(buckets.back(), *batch, options);
    if (!one)
      return one.takeError();
    report.result = std::move(*one);
    report.buckets = buckets;
    if (report.result.skipped)
      return report;
    report.gradNorm = optimizer.endStreamingStep(report.result.gradSquaredNorm);
    return report;
  }

  // Deferred: every gradient is kept until the last micro-batch's backward
  // ends; then one global decision, and each parameter's update lands
  // before its next fetch (docs/Training.md, "Deferred update").
  options.applyUpdates = false;
  options.retainGradient = [this](const exec::Instruction &inst,
                                  const exec::HostGradient &g) {
    optimizer.retain(inst, g);
  };
  options.beforeFetch = [this](llvm::StringRef param) {
    optimizer.applyPending(param);
  };
  double lossSum = 0;
  for (int64_t k = 0; k < K; ++k) {
    llvm::Expected<exec::StepInputs> batch = draw(k);
    if (!batch) {
      optimizer.dropRetained();
      return batch.takeError();
    }
    llvm::Expected<exec::StepResult> one =
        runStepOn(buckets.back(), *batch, options);
    if (!one) {
      optimizer.dropRetained();
      return one.takeError();
    }
    double seconds = report.result.seconds + one->seconds;
    lossSum += one->loss;
    report.result = std::move(*one);
    report.result.seconds = seconds;
  }
  if (ranks > 1)
    if (llvm::Error e = job->allReduceSum(llvm::MutableArrayRef<double>(
            lossSum))) {
      optimizer.dropRetained();
      return std::move(e);
    }
  report.result.loss = static_cast<float>(lossSum / double(K * ranks));
  report.buckets = buckets;
  llvm::Expected<double> norm = optimizer.retainedNorm();
  if (!norm)
    return norm.takeError();
  report.gradNorm = *norm;
  if (!std::isfinite(*norm) || !std::isfinite(report.result.loss)) {
    // Nothing was updated: the state is bitwise as before the step.
    report.result.skipped = true;
    return report;
  }
  report.clipped = optimizer.decide(*norm, report.lr) < 1.0;
  return report;
}

llvm::Expected<float> Session::validationLoss() {
  if (!valData)
    return llvm::createStringError("no validation data (--val-data)");
  flushUpdates();
  // The same noise and timesteps at every call: drawn from one seed.
  Random rng(seed ^ hashName("validation"));
  int64_t batches = 0;
  double sum = 0;
  // Bucket by bucket, in order: whole batches of one bucket each.
  const std::vector<std::vector<size_t>> &buckets = valData->buckets();
  for (size_t g = 0; g < buckets.size(); ++g) {
    const InputShapes &shapes = shapesOf[g];
    int64_t B = shapes.latents[0];
    int64_t latent = 1, cond = 1;
    for (size_t d = 1; d < shapes.latents.size(); ++d)
      latent *= shapes.latents[d];
    if (!shapes.conditionIsLabel)
      for (size_t d = 1; d < shapes.condition.size(); ++d)
        cond *= shapes.condition[d];
    for (size_t k = 0; k + B <= buckets[g].size(); k += B, ++batches) {
      exec::StepInputs in;
      std::vector<float> &x0 = in["latents"], &noise = in["noise"],
                         &t = in["timesteps"], &c = in["condition"];
      x0.resize(B * latent);
      c.resize(B * cond);
      for (int64_t b = 0; b < B; ++b) {
        if (llvm::Error e = valData->sample(
                buckets[g][k + b], x0.data() + b * latent, c.data() + b * cond))
          return std::move(e);
        t.push_back(sampleSigma(options.recipe, rng));
      }
      noise.resize(B * latent);
      for (float &n : noise)
        n = rng.normal();
      exec::StepOptions gradientsOnly;
      gradientsOnly.applyUpdates = false;
      llvm::Expected<exec::StepResult> one = runStepOn(g, in, gradientsOnly);
      if (!one)
        return one.takeError();
      sum += one->loss;
    }
  }
  return static_cast<float>(sum / double(batches));
}

llvm::Expected<exec::StepResult>
Session::runStep(const exec::StepInputs &inputs,
                 const exec::StepOptions &options) {
  return runStepOn(0, inputs, options);
}

llvm::Expected<exec::StepResult>
Session::runStepOn(size_t bucket, const exec::StepInputs &inputs,
                   const exec::StepOptions &options) {
  if (hostState.incomplete)
    return llvm::createStringError(
        llvm::formatv("the host state is incomplete: step {0} stopped "
                      "part-way with some parameters updated; load a "
                      "checkpoint before stepping again",
                      hostState.step + 1)
            .str());
  if (llvm::Error e = useBucket(bucket))
    return std::move(e);
  return executor->step(inputs, hostState, options);
}

std::string Session::trainerState() const {
  llvm::json::Object settings;
  for (const auto &[name, value] : runSettings)
    settings[name] = value;
  llvm::json::Object o{{"version", kTrainerStateVersion},
                       {"seed", std::to_string(seed)},
                       {"data_state", std::to_string(data->state())},
                       {"step", hostState.step},
                       {"ema_updates", optimizer.emaUpdates()},
                       {"steps_run", stepsRunSoFar},
                       {"settings", std::move(settings)}};
  if (std::optional<double> norm = optimizer.previousNorm())
    o["previous_grad_norm"] = formatDouble(*norm);
  std::string text;
  llvm::raw_string_ostream os(text);
  os << llvm::json::Value(std::move(o));
  return text;
}

/// The trainer state's object, version checked.
static llvm::Expected<llvm::json::Value>
parseTrainerState(llvm::StringRef json) {
  llvm::Expected<llvm::json::Value> value = parseJson(json);
  if (!value)
    return llvm::createStringError("trainer state is not JSON: " +
                                   llvm::toString(value.takeError()));
  const llvm::json::Object *o = value->getAsObject();
  std::optional<int64_t> version = o ? o->getInteger("version") : std::nullopt;
  if (!version || *version < 1 || *version > kTrainerStateVersion)
    return llvm::createStringError("trainer state has an unsupported version");
  return value;
}

llvm::Error Session::restoreTrainerState(llvm::StringRef json) {
  llvm::Expected<llvm::json::Value> value = parseTrainerState(json);
  if (!value)
    return value.takeError();
  const llvm::json::Object *o = value->getAsObject();
  std::optional<llvm::StringRef> dataState = o->getString("data_state");
  std::optional<int64_t> step = o->getInteger("step");
  uint64_t parsed = 0;
  if (!dataState || dataState->getAsInteger(10, parsed) || !step || *step < 0)
    return llvm::createStringError(
        "trainer state lacks a valid 'data_state' or 'step'");
  std::optional<double> previousNorm;
  if (std::optional<llvm::StringRef> norm =
          o->getString("previous_grad_norm")) {
    double v;
    if (norm->getAsDouble(v))
      return llvm::createStringError(
          "trainer state has a malformed 'previous_grad_norm'");
    previousNorm = v;
  }
  data->setState(parsed);
  hostState.step = *step;
  hostState.incomplete = false;
  optimizer.restore(o->getInteger("ema_updates").value_or(0), previousNorm);
  // States saved before it was recorded: the optimizer steps (equal unless
  // a step was skipped).
  stepsRunSoFar = o->getInteger("steps_run").value_or(*step);
  return llvm::Error::success();
}

llvm::Expected<int64_t> train::stepOfTrainerState(llvm::StringRef json) {
  llvm::Expected<llvm::json::Value> value = parseTrainerState(json);
  if (!value)
    return value.takeError();
  std::optional<int64_t> step = value->getAsObject()->getInteger("step");
  if (!step || *step < 0)
    return llvm::createStringError("trainer state lacks a valid 'step'");
  return *step;
}

llvm::Expected<Settings> train::settingsOfTrainerState(llvm::StringRef json) {
  llvm::Expected<llvm::json::Value> value = parseTrainerState(json);
  if (!value)
    return value.takeError();
  const llvm::json::Object *o = value->getAsObject();
  Settings settings;
  if (const llvm::json::Object *stored = o->getObject("settings")) {
    for (const auto &kv : *stored) {
      std::optional<llvm::StringRef> v = kv.second.getAsString();
      if (!v)
        return llvm::createStringError("trainer state setting '" +
                                       kv.first.str() + "' is not a string");
      settings.push_back({kv.first.str(), v->str()});
    }
    llvm::sort(settings);
  } else if (std::optional<llvm::StringRef> seed = o->getString("seed")) {
    settings.push_back({"seed", seed->str()}); // format 1
  }
  return settings;
}

std::optional<std::string> train::findSetting(const Settings &settings,
                                              llvm::StringRef name) {
  for (const auto &[n, v] : settings)
    if (n == name)
      return v;
  return std::nullopt;
}

llvm::Error train::checkResumeSettings(const Settings &stored,
                                       const Settings &current) {
  std::string diffs;
  bool onlyPlan = true;
  for (const auto &[name, value] : stored) {
    std::optional<std::string> now = findSetting(current, name);
    if (!now || *now == value)
      continue;
    onlyPlan &= name == "plan_hash";
    diffs += llvm::formatv("\n  {0}: {1} in the checkpoint, {2} now", name,
                           value, *now)
                 .str();
  }
  if (diffs.empty())
    return llvm::Error::success();
  return llvm::createStringError(
      "this run's settings differ from the checkpoint's, so resuming would "
      "not continue it:" +
      diffs +
      (onlyPlan
           ? "\nthe execution plan differs: resume with the model, video "
             "size and planning flags the checkpoint was trained with (or "
             "--plan with the plan --save-plan wrote)"
           : "\nleave --seed, --data, --lr, --weight-decay and --precision "
             "out to use the checkpoint's values; the others must be given "
             "as the first run had them") +
      "; or start a fresh run with --overwrite-checkpoints");
}
