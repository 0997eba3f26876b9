//===- Session.cpp - A training run over an execution plan ----------------===//
//
// The session's making and its optimizer steps; its backends, host-memory
// check, settings and trainer state, and validation are in the files
// SessionParts.h names.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/SessionParts.h"

#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/host/NvmeTier.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <unistd.h>

using namespace megaslide;
using namespace megaslide::train;

Session::Session(std::vector<std::unique_ptr<exec::ExecPlan>> plans,
                 std::vector<std::string> names,
                 std::vector<InputShapes> shapes, SessionOptions options,
                 std::unique_ptr<DataSource> data)
    : plans(std::move(plans)), names(std::move(names)),
      shapesOf(std::move(shapes)), options(std::move(options)),
      seed(this->options.seed), data(std::move(data)) {
  experts.resize(this->options.recipe.numExperts());
}

host::HostOptimizer::Options
train::optimizerOptions(const Recipe &r, const exec::ExecPlan &plan,
                        bool deferred, dist::Collectives *collectives) {
  host::HostOptimizer::Options o;
  o.deferred = deferred;
  o.collectives = collectives;
  // A job's plan reduce-scatters the gradients on the device.
  o.deviceReduces = plan.jobRanks() > 1;
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

namespace {
/// What the recipe needs of the plans: their updates' lr (the first
/// plan's), and whether they are deferred (the planner decides,
/// docs/Training.md).
struct PlanUpdates {
  bool deferred = false, streaming = false;
  double baseLr = exec::kDefaultLr;
};
} // namespace

/// The updates of `plans`, which must agree (named by `bucket` in errors).
static llvm::Expected<PlanUpdates>
planUpdates(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
            llvm::function_ref<std::string(size_t)> bucket) {
  PlanUpdates u;
  for (size_t b = 0; b < plans.size(); ++b) {
    bool planDefers = false, planStreams = false;
    for (const exec::Instruction &inst : plans[b]->instructions)
      if (inst.op == exec::OpCode::HostAdamW) {
        (inst.hasAttr(exec::kDeferredAttr) ? planDefers : planStreams) = true;
        if (b == 0)
          u.baseLr = inst.floatAttr("lr").value_or(u.baseLr);
      }
    if (planDefers && planStreams)
      return llvm::createStringError(
          "the plan defers some updates and not others; recompile it");
    if (b > 0 && (planDefers != u.deferred || planStreams != u.streaming))
      return llvm::createStringError(
          "the plans of " + bucket(0) + " and " + bucket(b) +
          " differ in their update (deferred in one, streaming in the "
          "other): give --update deferred or streaming");
    u.deferred = planDefers;
    u.streaming = planStreams;
  }
  return u;
}

/// Whether `plan` takes per-sample loss weights (exec::kLossWeightsInput).
static bool takesLossWeights(const exec::ExecPlan &plan) {
  return llvm::any_of(plan.inputs, [&](int64_t id) {
    return plan.values[id].name == exec::kLossWeightsInput;
  });
}

/// The training data: options.dataDir's samples, else synthetic ones.
static llvm::Expected<std::unique_ptr<DataSource>>
openTrainingData(const SessionOptions &options,
                 const std::vector<InputShapes> &shapesOf,
                 llvm::ArrayRef<std::string> names) {
  const InputShapes &first = shapesOf.front();
  bool bucketed = !names.front().empty();
  uint64_t dataSeed = options.seed ^ hashName("batches");
  if (bucketed && options.dataDir.empty())
    return llvm::createStringError(
        "a run over buckets trains on sample files: give --data DIR");
  if (options.dataDir.empty())
    return std::make_unique<SyntheticData>(first, dataSeed);
  auto files = bucketed
                   ? FileData::open(options.dataDir, shapesOf, names, dataSeed)
                   : FileData::open(options.dataDir, first, dataSeed);
  if (!files)
    return files.takeError();
  return std::unique_ptr<DataSource>(std::move(*files));
}

/// The masters a plan fetches, in order, with the dtype of each fetch.
static std::vector<std::pair<llvm::StringRef, exec::DType>>
fetchesOf(const exec::ExecPlan &plan) {
  std::vector<std::pair<llvm::StringRef, exec::DType>> fetches;
  for (const exec::Instruction &inst : plan.instructions)
    if (inst.op == exec::OpCode::Fetch)
      fetches.push_back({inst.param, plan.values[inst.results[0]].type.dtype});
  return fetches;
}

/// What a job's ranks do together in a step of `plan`, in order: gather
/// each fetched master on the host (one rank's plan), or a job's plan's
/// device collectives (op, elements, dtype).
static std::vector<std::string> collectivesOf(const exec::ExecPlan &plan) {
  std::vector<std::string> all;
  if (plan.jobRanks() == 1) {
    for (auto [param, dtype] : fetchesOf(plan))
      all.push_back((param + " " + exec::dtypeName(dtype)).str());
    return all;
  }
  for (const exec::Instruction &inst : plan.instructions)
    if (inst.op == exec::OpCode::AllGather ||
        inst.op == exec::OpCode::ReduceScatter) {
      const exec::TensorType &t = plan.values[inst.operands[0]].type;
      all.push_back(llvm::formatv("{0} {1} {2}", exec::opName(inst.op),
                                  t.numElements(), exec::dtypeName(t.dtype)));
    }
  return all;
}

/// A job's ranks run their collectives together, whichever bucket each one
/// steps (a validation batch): every plan must have the same ones in the
/// same order.
static llvm::Error
checkSameCollectives(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
                     llvm::ArrayRef<std::string> names) {
  auto first = collectivesOf(*plans[0]);
  for (size_t b = 1; b < plans.size(); ++b)
    if (collectivesOf(*plans[b]) != first)
      return llvm::createStringError(llvm::formatv(
          "the plans of buckets '{0}' and '{1}' fetch or reduce the weights "
          "in another order; a job's ranks gather every fetched weight and "
          "reduce every gradient together, so each bucket's plan must do so "
          "alike (plan them with one --activation-policy, not auto)",
          names[0], names[b]));
  return llvm::Error::success();
}

llvm::Error Session::gatherLikeAStep() {
  const exec::ExecPlan &p = plan(0);
  if (p.jobRanks() > 1) {
    // The collectives are the step's own: a step of bucket 0 on zeros,
    // whose loss no one reads.
    exec::StepInputs zeros;
    for (int64_t id : p.inputs)
      zeros[p.values[id].name].assign(p.values[id].type.numElements(), 0.0f);
    zeros.erase("step");
    exec::StepOptions gradientsOnly;
    gradientsOnly.applyUpdates = false;
    return runStepOn(0, std::move(zeros), gradientsOnly).takeError();
  }
  for (auto [param, dtype] : fetchesOf(p))
    if (const host::HostTensor *t = current().state.find(param);
        t && t->sharded) {
      std::vector<uint8_t> scratch(t->param->type.numElements() *
                                   exec::dtypeBytes(dtype));
      if (llvm::Error e = host::gatherWhole(*t, dtype, scratch.data(),
                                            *options.collectives))
        return e;
    }
  return llvm::Error::success();
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
  auto bucket = [&](size_t b) { return "bucket " + names[b]; };
  for (size_t b = 1; b < plans.size(); ++b)
    if (std::optional<std::string> why = paramMismatch(*plans[0], *plans[b]))
      return llvm::createStringError(
          "the plans of " + bucket(0) + " and " + bucket(b) +
          " do not share their parameters (" + *why +
          "): every bucket's plan must come from the same model and flags");
  llvm::Expected<PlanUpdates> updates = planUpdates(plans, bucket);
  if (!updates)
    return updates.takeError();
  llvm::Expected<std::unique_ptr<DataSource>> data =
      openTrainingData(options, shapesOf, names);
  if (!data)
    return data.takeError();
  std::unique_ptr<DataSource> valData;
  if (!options.valDataDir.empty() && options.recipe.twoExperts())
    return llvm::createStringError(
        "--val-data with --boundary: validating two experts (each sample "
        "on the expert of its time) is not built; validate each expert's "
        "saved weights in a run of its own with its --min-timestep or "
        "--max-timestep");
  if (!options.valDataDir.empty()) {
    llvm::Expected<std::unique_ptr<DataSource>> files =
        openValidationData(options, shapesOf, names);
    if (!files)
      return files.takeError();
    valData = std::move(*files);
  }
  if (llvm::Error e = checkRecipe(options.recipe, updates->baseLr))
    return std::move(e);
  for (size_t b = 0; b < plans.size(); ++b)
    if (takesLossWeights(*plans[b]) != options.recipe.weightsLoss())
      return llvm::createStringError(
          options.recipe.weightsLoss()
              ? "--weighting-scheme " +
                    lossWeightingName(options.recipe.weighting).str() +
                    " weights the loss per sample, but the plan" +
                    (plans.size() > 1 ? " of " + bucket(b) : "") +
                    " was compiled without loss weights: compile it with "
                    "the scheme (megaslide-run --save-plan)"
              : "the plan" + (plans.size() > 1 ? " of " + bucket(b) : "") +
                    " weights the loss per sample (it was compiled with a "
                    "--weighting-scheme), and this run's is none: give the "
                    "scheme it was compiled for");
  if (options.collectives && options.collectives->size() > 1 &&
      !updates->deferred && updates->streaming)
    return llvm::createStringError(llvm::formatv(
        "data parallelism ({0} ranks) needs the deferred update (the job's "
        "gradient is complete only when every rank's backward ends), and "
        "this plan updates as gradients arrive (--update streaming); plan "
        "with --update deferred",
        options.collectives->size()));
  if (options.collectives && options.collectives->size() > 1)
    if (llvm::Error e = checkSameCollectives(plans, names))
      return std::move(e);
  if (options.recipe.gradAccum > 1 && !updates->deferred && updates->streaming)
    return llvm::createStringError(
        "--grad-accum needs the deferred update (the accumulated gradient "
        "is complete only when the last micro-batch's backward ends), and "
        "this plan updates as gradients arrive (--update streaming); plan "
        "with --update deferred");
  std::unique_ptr<Session> session(
      new Session(std::move(plans), std::move(names), std::move(shapesOf),
                  options, std::move(*data)));
  session->valData = std::move(valData);
  session->predicted = std::move(predicted);
  session->deferred = updates->deferred;
  session->baseLr = updates->baseLr;
  const exec::ExecPlan &p = session->plan();
  // One host state serves every bucket: its plans keep the same roles on
  // NVMe, and the tier needs its drives.
  for (const std::unique_ptr<exec::ExecPlan> &other : session->plans)
    if (other->tierRoles != p.tierRoles ||
        other->tierWindowBytes != p.tierWindowBytes)
      return llvm::createStringError(
          "the bucket plans keep different host state on NVMe "
          "(host_tier); compile them with the same --host-mem and --nvme");
  if (!p.tierRoles.empty() && options.nvmeDirs.empty() &&
      options.backend != "sim")
    return llvm::createStringError(
        "the plan keeps the " + llvm::join(p.tierRoles, " and ") +
        " tensors on NVMe (host_tier): give their drives' directories with "
        "--nvme DIR[,DIR...]");
  if (dist::Collectives *c = options.collectives;
      c && c->size() > 1 && p.hasLeanMoments())
    return llvm::createStringError(
        "this plan keeps the AdamW moments as " + p.hostState +
        ", which is for a job of one rank (their block scales and row/column "
        "statistics are not sharded); this job has " +
        std::to_string(c->size()) +
        " ranks: plan with --host-state-policy master-moments or "
        "bf16-moments");
  // Only backends that compute hold the model state (sim needs none): the
  // 105B state is 1.27 TB, so check that everything fits, summed, before
  // the backend or the state touches a byte.
  if (options.backend != "sim") {
    session->memoryNeed = hostMemoryNeed(session->plans, options,
                                         *session->data, session->deferred);
    if (llvm::Error e = checkHostMemory(session->memoryNeed, p, options.backend,
                                        options.collectives))
      return std::move(e);
  }
  auto backend = createBackend(p, options);
  if (!backend)
    return backend.takeError();
  session->executor = std::move(*backend);
  session->keepDeviceCollectives();
  // A rank of a job takes its own micro-batches of the job's sequence:
  // rank r those after r K others', whatever the job's size
  // (docs/Distributed.md, "Data").
  if (dist::Collectives *c = options.collectives; c && c->size() > 1)
    session->data->setShare(c->rank(), c->size(), options.recipe.gradAccum);
  if (session->executor->computesLoss()) {
    dist::Collectives *job = options.collectives;
    // Both experts start from the same weights (those of --seed) until
    // weights are loaded into each.
    for (Expert &e : session->experts) {
      e.state = host::initHostState(p, options.seed, job ? job->rank() : 0,
                                    job ? job->size() : 1);
      e.optimizer.prepare(p, e.state,
                          optimizerOptions(options.recipe, p, session->deferred,
                                           options.collectives));
      host::NvmeTierOptions tier;
      tier.dirs = options.nvmeDirs;
      tier.windowBytes = static_cast<uint64_t>(p.tierWindowBytes);
      tier.force = options.nvmeForce;
      if (llvm::Error err = e.optimizer.useTier(tier))
        return std::move(err);
    }
    session->runSettings =
        computeSettings(session->plans, session->names, options,
                        session->deferred, *session->data);
  }
  return session;
}

std::vector<size_t> Session::bucketSamples() const {
  std::vector<size_t> counts;
  for (const std::vector<size_t> &samples : data->buckets())
    counts.push_back(samples.size());
  return counts;
}

host::HostTensor *Session::ema(llvm::StringRef name) {
  flushUpdates();
  return current().state.find((name + ".ema").str());
}

void Session::flushUpdates() { current().optimizer.flush(); }

llvm::Error Session::updatesFailed() const {
  for (const Expert &e : experts)
    if (llvm::Error failed = e.optimizer.failed())
      return failed;
  return llvm::Error::success();
}

int64_t Session::step() const {
  int64_t sum = 0;
  for (const Expert &e : experts)
    sum += e.state.step;
  return sum;
}

host::HostState &Session::expertState(int64_t e) {
  flushUpdates();
  return experts[e].state;
}

void Session::useExpert(size_t e) {
  // The pending updates read the plan's buffers the other expert's step
  // would overwrite: applied first.
  if (e != liveExpert)
    flushUpdates();
  liveExpert = e;
}

llvm::Error Session::withCheckpointState(
    llvm::function_ref<llvm::Error(host::HostState &)> fn) {
  flushUpdates();
  if (llvm::Error e = updatesFailed())
    return e;
  if (experts.size() == 1)
    return fn(current().state);
  host::HostState both;
  both.step = step();
  for (size_t e = 0; e < experts.size(); ++e)
    for (host::HostTensor &t : experts[e].state.tensors) {
      const exec::Param *param = t.param;
      if (e > 0) {
        exec::Param renamed = *t.param;
        renamed.name = (kSecondExpertPrefix + renamed.name).str();
        if (!renamed.of.empty())
          renamed.of = (kSecondExpertPrefix + renamed.of).str();
        param = &both.ownParams.emplace_back(std::move(renamed));
      }
      host::HostTensor &moved = both.tensors.emplace_back();
      moved.param = param;
      moved.data = std::move(t.data);
      moved.bf16 = std::move(t.bf16);
      moved.sharded = t.sharded;
      moved.shardBegin = t.shardBegin;
      moved.shardEnd = t.shardEnd;
      both.index[param->name] = both.tensors.size() - 1;
    }
  llvm::Error err = fn(both);
  size_t k = 0;
  for (Expert &e : experts)
    for (host::HostTensor &t : e.state.tensors) {
      t.data = std::move(both.tensors[k].data);
      t.bf16 = std::move(both.tensors[k++].bf16);
    }
  return err;
}
llvm::Expected<StepReport>
Session::trainStep(const exec::StepOptions &options) {
  if (llvm::any_of(experts, [](const Expert &e) { return e.state.incomplete; }))
    return runStep({}, {}).takeError(); // the error below, before drawing data
  uint64_t before = data->state();
  if (dist::Collectives *c = this->options.collectives;
      c && c->size() > 1 && fault::hangs(c->rank(), step() + 1))
    for (;;)
      ::pause(); // a test's hung rank: only SIGKILL ends it
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
  int64_t B = shapesOf[0].latents[0]; // every bucket's batch
  // Of two experts, the one this step trains (a function of (seed, step),
  // so a resumed run picks as the uninterrupted one), its times drawn
  // within its range.
  int64_t globalStep = step();
  Recipe times = r;
  if (r.twoExperts()) {
    int64_t e = stepExpert(r, seed, globalStep);
    useExpert(e);
    times = expertRecipe(r, e);
  }
  // Micro-batch k with its timesteps (samples k B .. k B + B - 1 of the
  // step's sigmas, sampleSigmas), drawn in order, one at a time.
  SigmaStream sigmas(times, seed, globalStep);
  if (dist::Collectives *job = options.collectives; job && job->size() > 1)
    // The micro-batches of the ranks before this one.
    sigmas.skip(job->rank() * r.gradAccum * B);
  std::vector<size_t> buckets;
  auto draw = [&](int64_t k,
                  size_t &bucket) -> llvm::Expected<exec::StepInputs> {
    bucket = 0;
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
  report.microBatches = r.gradAccum;
  report.lr = scheduledLr(r, baseLr, globalStep);
  if (r.twoExperts())
    report.expert = liveExpert;
  exec::StepOptions options = given;
  options.lr = report.lr;
  // Timing only, or gradients only: no optimizer decisions.
  bool updates = executor->computesLoss() && given.applyUpdates;
  if (llvm::Error e = !updates   ? stepWithoutUpdate(draw, options, report)
                      : deferred ? deferredStep(draw, options, report)
                                 : streamingStep(draw, options, report))
    return std::move(e);
  report.buckets = std::move(buckets);
  return report;
}

llvm::Error Session::stepWithoutUpdate(MicroBatches draw,
                                       const exec::StepOptions &options,
                                       StepReport &report) {
  int64_t K = report.microBatches;
  for (int64_t k = 0; k < K; ++k) {
    size_t bucket;
    llvm::Expected<exec::StepInputs> batch = draw(k, bucket);
    if (!batch)
      return batch.takeError();
    llvm::Expected<exec::StepResult> one =
        runStepOn(bucket, std::move(*batch), options);
    if (!one)
      return one.takeError();
    double seconds = report.result.seconds + one->seconds;
    float loss = report.result.loss + one->loss / K;
    std::optional<float> unweighted;
    if (one->unweightedLoss)
      unweighted =
          report.result.unweightedLoss.value_or(0) + *one->unweightedLoss / K;
    report.result = std::move(*one);
    report.result.seconds = seconds;
    report.result.loss = loss;
    report.result.unweightedLoss = unweighted;
  }
  return llvm::Error::success();
}

llvm::Error Session::streamingStep(MicroBatches draw, exec::StepOptions options,
                                   StepReport &report) {
  // The backend updates as gradients land, clipped with the previous
  // step's norm (docs/Training.md, "Streaming update").
  double factor = current().optimizer.beginStreamingStep();
  options.gradScale = static_cast<float>(factor);
  report.clipped = factor < 1.0;
  size_t bucket;
  llvm::Expected<exec::StepInputs> batch = draw(0, bucket);
  if (!batch)
    return batch.takeError();
  llvm::Expected<exec::StepResult> one =
      runStepOn(bucket, std::move(*batch), options);
  if (!one)
    return one.takeError();
  report.result = std::move(*one);
  if (!report.result.skipped)
    report.gradNorm =
        current().optimizer.endStreamingStep(report.result.gradSquaredNorm);
  return current().optimizer.failed();
}

llvm::Error Session::deferredStep(MicroBatches draw, exec::StepOptions options,
                                  StepReport &report) {
  // Every gradient is kept until the last micro-batch's backward ends;
  // then one global decision, and each parameter's update lands before
  // its next fetch (docs/Training.md, "Deferred update").
  options.applyUpdates = false;
  options.retainGradient = [this](const exec::Instruction &inst,
                                  const exec::HostGradient &g) {
    current().optimizer.retain(inst, g);
  };
  options.beforeFetch = [this](llvm::StringRef param) {
    current().optimizer.applyPending(param);
  };
  int64_t K = report.microBatches;
  // The loss, then a weighted loss's unweighted one.
  std::vector<double> lossSums(1);
  for (int64_t k = 0; k < K; ++k) {
    size_t bucket;
    llvm::Expected<exec::StepInputs> batch = draw(k, bucket);
    if (!batch) {
      current().optimizer.dropRetained();
      return batch.takeError();
    }
    llvm::Expected<exec::StepResult> one =
        runStepOn(bucket, std::move(*batch), options);
    if (!one) {
      current().optimizer.dropRetained();
      return one.takeError();
    }
    // The previous step's updates, applied before this one's fetches.
    if (llvm::Error e = current().optimizer.failed())
      return e;
    double seconds = report.result.seconds + one->seconds;
    lossSums[0] += one->loss;
    if (one->unweightedLoss) {
      lossSums.resize(2);
      lossSums[1] += *one->unweightedLoss;
    }
    report.result = std::move(*one);
    report.result.seconds = seconds;
  }
  // The mean over the job's micro-batches.
  int64_t ranks = 1;
  if (dist::Collectives *job = this->options.collectives;
      job && job->size() > 1) {
    ranks = job->size();
    if (llvm::Error e = job->allReduceSum(lossSums)) {
      current().optimizer.dropRetained();
      return e;
    }
  }
  report.result.loss = static_cast<float>(lossSums[0] / double(K * ranks));
  if (lossSums.size() > 1)
    report.result.unweightedLoss =
        static_cast<float>(lossSums[1] / double(K * ranks));
  llvm::Expected<double> norm = current().optimizer.retainedNorm();
  if (!norm)
    return norm.takeError();
  report.gradNorm = *norm;
  if (!std::isfinite(*norm) || !std::isfinite(report.result.loss)) {
    // Nothing was updated: the state is bitwise as before the step.
    report.result.skipped = true;
    return llvm::Error::success();
  }
  report.clipped = current().optimizer.decide(*norm, report.lr) < 1.0;
  // A job's ranks each update their shard; the next fetch gathers them.
  if (current().optimizer.sharded())
    return current().optimizer.applySharded();
  return llvm::Error::success();
}

llvm::Expected<exec::StepResult>
Session::runStep(const exec::StepInputs &inputs,
                 const exec::StepOptions &options) {
  return runStepOn(0, inputs, options);
}

llvm::Expected<exec::StepResult>
Session::runStepOn(size_t bucket, exec::StepInputs inputs,
                   const exec::StepOptions &options) {
  if (llvm::any_of(experts, [](const Expert &e) { return e.state.incomplete; }))
    return llvm::createStringError(
        llvm::formatv("the host state is incomplete: step {0} stopped "
                      "part-way with some parameters updated; load a "
                      "checkpoint before stepping again",
                      step() + 1)
            .str());
  if (llvm::Error e = useBucket(bucket))
    return std::move(e);
  // A weighted loss's weights follow the timesteps the step runs at,
  // whoever gave them (the recipe, the caller, validation).
  if (auto t = inputs.find("timesteps");
      t != inputs.end() && takesLossWeights(plan(bucket))) {
    std::vector<float> weights = lossWeights(this->options.recipe, t->second);
    inputs[std::string(exec::kLossWeightsInput)] = std::move(weights);
  }
  if (!current().optimizer.sharded())
    return executor->step(inputs, current().state, options);
  exec::StepOptions gathering = options;
  gathering.gatherFetch =
      [job = this->options.collectives](const host::HostTensor &t,
                                        exec::DType dtype, void *dst) {
        return host::gatherWhole(t, dtype, dst, *job);
      };
  return executor->step(inputs, current().state, gathering);
}
