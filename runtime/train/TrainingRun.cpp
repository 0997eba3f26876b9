//===- TrainingRun.cpp - The training loop as a library -------------------===//

#include "megaslide/runtime/train/TrainingRun.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/Gemm.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/trace/ChromeTrace.h"
#include "megaslide/runtime/train/TrainingReport.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/ScopeExit.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cmath>

using namespace llvm;
using namespace megaslide;
using namespace megaslide::train;

/// A resume and a fresh start over the same folder, asked for together.
static Error resumeOverOverwrite(OptionSpelling spell) {
  return createStringError(spell("resume") +
                           " continues the checkpoints "
                           "that " +
                           spell("overwrite-checkpoints") +
                           " would replace; give one of them");
}

TrainingRun::~TrainingRun() {
  // The lock's file goes first: a folder this run created and left empty
  // goes with it.
  lock.reset();
  removeCreatedDirectories(createdDirs);
}

bool TrainingRun::writesCheckpoints() const {
  return !options.checkpointDir.empty() && options.writesCheckpoints;
}

Expected<std::unique_ptr<TrainingRun>> TrainingRun::open(RunOptions o) {
  std::unique_ptr<TrainingRun> run(new TrainingRun(std::move(o)));
  const RunOptions &opts = run->options;
  OptionSpelling spell = opts.spell;
  if (opts.resume && opts.overwriteCheckpoints)
    return resumeOverOverwrite(spell);
  if (opts.resume && opts.checkpointDir.empty())
    return createStringError(spell("resume") + " needs " +
                             spell("checkpoint-dir"));
  run->replaceOthers = opts.overwriteCheckpoints;
  if (run->writesCheckpoints() && opts.ownsCheckpoints) {
    if (Error e = prepareOutputDirectory(opts.checkpointDir, &run->createdDirs))
      return createStringError(spell("checkpoint-dir") + ": " +
                               toString(std::move(e)));
    Expected<std::unique_ptr<host::CheckpointLock>> locked =
        host::CheckpointLock::acquire(opts.checkpointDir);
    if (!locked)
      return locked.takeError();
    run->lock = std::move(*locked);
    // Under the lock, whatever interrupted saves left is stale.
    host::removeStaleTemporaries(opts.checkpointDir);
    if (opts.refuseEarlierRunAtOpen && !opts.resume)
      if (Error e = run->refuseEarlierRun())
        return std::move(e);
  }
  if (opts.resume)
    if (Error e = run->readStoredSettings())
      return std::move(e);
  for (auto [name, file] :
       {std::pair<StringRef, StringRef>{"trace", opts.tracePath},
        {"metrics", opts.metricsPath},
        {"report", opts.reportPath}})
    if (!file.empty())
      if (Error e = checkOutputFile(file))
        return createStringError(spell(name) + ": " + toString(std::move(e)));
  if (Error e = checkMetricsLog(opts.metricsPath, opts.resume,
                                opts.resume && !opts.reportPath.empty(), spell))
    return std::move(e);
  run->metricsCheckedForResume = opts.resume;
  return run;
}

Error TrainingRun::readStoredSettings() {
  Expected<std::string> state =
      host::readLatestTrainerState(options.checkpointDir);
  if (!state)
    return state.takeError();
  Expected<Settings> settings = settingsOfTrainerState(*state);
  if (!settings)
    return settings.takeError();
  storedState = std::move(*state);
  stored = std::move(*settings);
  // A new learning-rate horizon is the one recipe setting a resume may
  // change, and only when given: the schedule continues from this step
  // towards it.
  if (options.lrDecaySteps)
    if (std::optional<std::string> old = findSetting(*stored, "lr_decay_steps");
        old && *old != std::to_string(*options.lrDecaySteps)) {
      horizon =
          formatv("the learning-rate horizon moves from step {0} "
                  "(the checkpoint's) to {1} ({2})",
                  *old, *options.lrDecaySteps, options.spell("lr-decay-steps"))
              .str();
      llvm::erase_if(
          *stored, [](const auto &kv) { return kv.first == "lr_decay_steps"; });
    }
  return Error::success();
}

Error TrainingRun::refuseEarlierRun() {
  Expected<std::vector<host::CheckpointInfo>> existing =
      host::listCheckpoints(options.checkpointDir);
  if (!existing)
    return existing.takeError();
  if (isResumed || options.overwriteCheckpoints || existing->empty())
    return Error::success();
  return createStringError(formatv(
      "{2} '{0}' holds checkpoints of an earlier run (the newest: step {1}); "
      "give {3} to continue it, or {4} to start afresh (they are deleted "
      "once this run's first checkpoint is complete)",
      options.checkpointDir, existing->back().step,
      options.spell("checkpoint-dir"), options.spell("resume"),
      options.spell("overwrite-checkpoints")));
}

Expected<int64_t> TrainingRun::storedStep() const {
  if (storedState.empty())
    return createStringError("no checkpoint was read");
  return stepOfTrainerState(storedState);
}

void TrainingRun::attach(Session &s) { session = &s; }

Error TrainingRun::resume() {
  OptionSpelling spell = options.spell;
  const std::string &dir = options.checkpointDir;
  if (started)
    return createStringError(spell("resume") +
                             " continues a checkpoint before the run's first "
                             "step, not after it");
  if (dir.empty())
    return createStringError(spell("resume") + " needs " +
                             spell("checkpoint-dir"));
  if (options.overwriteCheckpoints)
    return resumeOverOverwrite(spell);
  // Python's Trainer takes every setting as given: none is adopted.
  std::string advice =
      spell == cliSpelling
          ? ""
          : "give the Trainer the plan, seed, data and recipe the "
            "checkpoint's run had; or start afresh with " +
                spell("overwrite-checkpoints");
  auto mismatch = [&](Error e) {
    return createStringError(spell("resume") + " from '" + dir +
                             "': " + toString(std::move(e)));
  };
  // Decided after open() (Python's Trainer): read now.
  if (!stored)
    if (Error e = readStoredSettings())
      return e;
  // The recipe first: a checkpoint of another recipe (an EMA it has and
  // this run has not) names the setting, not the tensors it differs in.
  if (Error e = checkResumeSettings(*stored, session->settings(), advice))
    return mismatch(std::move(e));
  std::string trainerState;
  if (Error e = session->withCheckpointState([&](host::HostState &state) {
        return host::loadLatestCheckpoint(dir, state, trainerState);
      }))
    return e;
  if (Error e = session->restoreTrainerState(trainerState))
    return e;
  // `latest` may have been rewritten since the settings were read.
  Expected<Settings> loaded = settingsOfTrainerState(trainerState);
  if (!loaded)
    return loaded.takeError();
  if (!horizon.empty())
    llvm::erase_if(*loaded,
                   [](const auto &kv) { return kv.first == "lr_decay_steps"; });
  if (Error e = checkResumeSettings(*loaded, session->settings(), advice))
    return mismatch(std::move(e));
  isResumed = true;
  if (options.note) {
    options.note(
        formatv("resumed at step {0} from {1}", session->step(), dir).str());
    if (!horizon.empty())
      options.note(horizon);
  }
  return Error::success();
}

Error TrainingRun::start() {
  if (started)
    return Error::success();
  if (!session)
    return createStringError("the training run has no session");
  if (writesCheckpoints() && options.ownsCheckpoints && !isResumed &&
      !options.refuseEarlierRunAtOpen)
    if (Error e = refuseEarlierRun())
      return e;
  if (isResumed && !metricsCheckedForResume)
    if (Error e = checkMetricsLog(options.metricsPath, true,
                                  !options.reportPath.empty(), options.spell))
      return e;
  if (writesCheckpoints())
    if (Error e = session->withCheckpointState([&](host::HostState &state) {
          return host::checkCheckpointSpace(options.checkpointDir, state);
        }))
      return e;
  if (!options.metricsPath.empty() || !options.reportPath.empty()) {
    Expected<std::unique_ptr<MetricsLog>> opened = MetricsLog::open(
        options.metricsPath,
        isResumed ? std::optional<int64_t>(session->step()) : std::nullopt,
        !options.reportPath.empty());
    if (!opened)
      return opened.takeError();
    metrics = std::move(*opened);
  }
  if (!options.tracePath.empty()) {
    Expected<std::unique_ptr<trace::ChromeTrace>> created =
        trace::ChromeTrace::create(
            options.tracePath,
            formatv("{2} {0} ({1})", session->plan().model,
                    session->backend().name(), options.toolName)
                .str());
    if (!created)
      return created.takeError();
    trace = std::move(*created);
  }
  first = session->step();
  started = true;
  return Error::success();
}

Error TrainingRun::checkpoint() {
  if (Error e = start())
    return e;
  int64_t step = session->step();
  if (step == lastCheckpoint)
    return Error::success();
  host::CheckpointOptions saveOptions;
  saveOptions.replaceOthers = replaceOthers;
  std::string dir;
  if (Error e =
          session->withCheckpointState([&](host::HostState &state) -> Error {
            Expected<std::string> saved = host::saveCheckpoint(
                options.checkpointDir, state, session->trainerState(),
                saveOptions, session->sharded() ? session->job() : nullptr);
            if (!saved)
              return saved.takeError();
            dir = std::move(*saved);
            return Error::success();
          }))
    return e;
  replaceOthers = false;
  lastCheckpoint = step;
  if (options.note)
    options.note("checkpoint: " + dir);
  return Error::success();
}

// The report is rewritten whole, atomically: a reader never sees half.
Error TrainingRun::writeReport() {
  if (options.reportPath.empty() || !metrics || metrics->text().empty())
    return Error::success();
  Session &s = *session;
  TrainingReportInfo info;
  info.title =
      formatv("{0} on the {1} backend", s.plan().model, s.backend().name());
  info.settings = s.settings();
  // Shown, not stored in the settings: a resumed run may be on another
  // machine (results match across thread counts, not instruction sets).
  if (StringRef(s.backend().name()) == "cpu")
    info.settings.push_back(
        {"cpu_isa", formatv("{0} (GEMM {1})", cpu::cpuIsaName(cpu::cpuIsa()),
                            cpu::gemmIsaName())
                        .str()});
  if (s.bucketed()) {
    std::vector<size_t> samples = s.bucketSamples();
    for (size_t b = 0; b < s.numBuckets(); ++b)
      info.buckets.push_back(
          {s.bucketName(b),
           b < samples.size() ? static_cast<int64_t>(samples[b]) : 0,
           s.plan(b).arenaBytes, s.predictedSeconds(b)});
  }
  Expected<std::string> html = trainingReportHtml(metrics->text(), info);
  if (!html)
    return html.takeError();
  return writeFileAtomically(options.reportPath, *html);
}

Error TrainingRun::finish(bool whole) {
  if (trace && (whole || sums.ran > 0))
    if (Error e = trace->finish())
      return e;
  if (Error e = writeReport())
    return createStringError(options.spell("report") + ": " +
                             toString(std::move(e)));
  return Error::success();
}

Error TrainingRun::failAfterSaving(const Twine &message) {
  std::string text = message.str();
  if (session && started) {
    int64_t step = session->step();
    bool incomplete = false;
    for (int64_t e = 0; e < session->numExperts(); ++e)
      incomplete |= session->expertState(e).incomplete;
    if (session->sharded() && writesCheckpoints() && step != lastCheckpoint &&
        step > 0) {
      // The other ranks hold the moments' other shards and are not here.
      text += "\nthe state is sharded over the job's ranks and not saved "
              "now; the last checkpoint resumes the run";
    } else if (writesCheckpoints() && session->backend().computesLoss() &&
               !incomplete && step != lastCheckpoint && step > 0) {
      if (Error e = checkpoint())
        text += "\n(the state could not be saved either: " +
                toString(std::move(e)) + ")";
      else
        text += formatv("\nthe state after step {0} is saved; fix the cause "
                        "and continue with {1}",
                        step, options.spell("resume"))
                    .str();
    }
  }
  if (trace && sums.ran > 0) // an empty trace never replaces an old one
    consumeError(trace->finish());
  if (Error e = writeReport())
    text += "\n(" + options.spell("report") +
            " could not be written either: " + toString(std::move(e)) + ")";
  return createStringError(text);
}

Expected<RunStep>
TrainingRun::step(const exec::StepOptions &stepOptions, bool last,
                  function_ref<void(const RunStep &)> afterStep,
                  std::optional<std::vector<exec::StepInputs>> inputs) {
  if (Error e = start())
    return std::move(e);
  Session &s = *session;
  bool computesLoss = s.backend().computesLoss();
  RunStep out;
  // sim keeps no state: its steps are counted here.
  out.step = computesLoss ? s.step() + 1 : first + sums.ran + 1;
  exec::StepOptions opts = stepOptions;
  opts.trace |= trace != nullptr;
  Expected<StepReport> report =
      inputs ? s.trainStep(std::move(*inputs), opts) : s.trainStep(opts);
  if (!report) {
    std::string why = toString(report.takeError());
    return failAfterSaving(StringRef(why).starts_with("step ")
                               ? why
                               : formatv("step {0}: {1}", out.step, why).str());
  }
  out.report = std::move(*report);
  exec::StepResult &result = out.report.result;
  if (trace)
    // Steps follow each other on the trace's time axis.
    for (exec::TraceSpan &span : result.spans) {
      span.start += sums.seconds;
      trace->complete(span);
    }
  sums.seconds += result.seconds;
  out.ran = ++sums.ran;
  sums.lastSkipped = result.skipped;
  if (result.skipped) {
    ++sums.skipped;
    ++skippedInARow;
  } else {
    skippedInARow = 0;
    sums.memory = result.memory;
    if (!sums.firstLoss)
      sums.firstLoss = result.loss;
    sums.lastLoss = result.loss;
  }
  out.skippedInARow = skippedInARow;
  out.checkpointDue = !options.checkpointDir.empty() &&
                      ((options.checkpointEvery > 0 &&
                        s.stepsRun() % options.checkpointEvery == 0) ||
                       last);
  if (!result.skipped && computesLoss && s.hasValidation() &&
      ((options.valEvery > 0 && s.stepsRun() % options.valEvery == 0) ||
       last)) {
    Expected<float> v = s.validationLoss();
    if (!v)
      return failAfterSaving("validation: " + toString(v.takeError()));
    out.valLoss = *v;
  }
  if (metrics) {
    const exec::ExecPlan &p = s.plan();
    MetricsRecord record;
    record.step = out.step;
    if (computesLoss) {
      record.loss = result.loss;
      record.unweightedLoss = result.unweightedLoss;
    }
    record.lr = out.report.lr;
    record.gradNorm = out.report.gradNorm;
    record.clipped = out.report.clipped;
    record.skipped = result.skipped;
    record.microBatches = out.report.microBatches;
    record.seconds = result.seconds;
    double perSecond = 1.0 / std::max(result.seconds, 1e-12);
    int64_t tokens = 0;
    for (size_t b : out.report.buckets) {
      int64_t perSample = 1;
      for (int64_t g : s.plan(b).grid)
        perSample *= g;
      tokens += p.batch * perSample;
    }
    record.samplesPerSecond = out.report.microBatches * p.batch * perSecond;
    record.tokensPerSecond = double(tokens) * perSecond;
    record.hostRssBytes = host::residentBytes();
    record.devicePeakBytes = result.memory.measuredArenaBytes;
    if (out.valLoss)
      record.valLoss = *out.valLoss;
    if (!horizon.empty() && sums.ran == 1)
      record.lrDecaySteps = s.recipe().decaySteps;
    if (s.bucketed())
      for (size_t b : out.report.buckets)
        record.buckets.push_back(s.bucketName(b));
    if (out.report.expert)
      record.expert = expertName(*out.report.expert).str();
    if (Error e = metrics->write(record))
      return failAfterSaving(toString(std::move(e)));
  }
  if (afterStep)
    afterStep(out);
  if (inTrain && skippedInARow >= options.maxNonFiniteSteps)
    return failAfterSaving(formatv(
        "{0} steps in a row had a non-finite loss (the last: step {1}); "
        "lower {2}, check the data (every sample is checked to be finite) or "
        "the weights",
        skippedInARow, out.step,
        options.spell == cliSpelling ? "--lr" : "the learning rate"));
  if (out.checkpointDue) {
    // Every rank of a job writes its shards.
    if (Error saved = writesCheckpoints() ? checkpoint() : Error::success())
      return failAfterSaving(toString(std::move(saved)));
    if (writesCheckpoints())
      if (Error e = writeReport())
        return failAfterSaving(options.spell("report") + ": " +
                               toString(std::move(e)));
  }
  return out;
}

Expected<int64_t> TrainingRun::train(int64_t steps, const Hooks &hooks) {
  if (Error e = start())
    return std::move(e);
  int64_t done = 0;
  inTrain = true;
  llvm::scope_exit outside([&] { inTrain = false; });
  for (; done < steps && !(hooks.stopRequested && hooks.stopRequested());
       ++done) {
    bool last = done + 1 == steps;
    exec::StepOptions opts;
    if (hooks.beforeStep)
      hooks.beforeStep(opts, last);
    if (Expected<RunStep> taken = step(opts, last, hooks.afterStep); !taken)
      return taken.takeError();
  }
  return done;
}

/// Writes `state`, one model's or one expert's, as saveSessionWeights.
static Error saveStateWeights(Session &s, host::HostState &state, StringRef dir,
                              host::SaveWeightsOptions saveOptions, bool ema) {
  // The EMA stands in for the masters while they are written (a bf16 EMA
  // widened, exactly, for the time; one in the NVMe tier read from it,
  // all of them before any master moves).
  std::vector<std::vector<float>> kept;
  if (ema)
    for (host::HostTensor &t : state.tensors)
      if (t.param->role == "ema" && (!t.bf16.empty() || t.tier)) {
        Expected<std::vector<float>> values = host::heldValues(t);
        if (!values)
          return values.takeError();
        kept.push_back(std::move(*values));
      }
  auto swapEma = [&] {
    size_t k = 0;
    for (host::HostTensor &t : state.tensors) {
      if (t.param->role != "ema")
        continue;
      std::vector<float> &master = state.find(t.param->of)->data;
      if (t.bf16.empty() && !t.tier)
        std::swap(t.data, master);
      else
        std::swap(kept[k++], master);
    }
  };
  if (ema)
    swapEma();
  if (saveOptions.runPlans.empty())
    for (size_t b = 0; b < s.numBuckets(); ++b)
      saveOptions.runPlans.push_back(&s.plan(b));
  if (s.sharded())
    saveOptions.job = s.job();
  Error err = host::saveWeights(s.plan(), state, dir, saveOptions);
  if (ema)
    swapEma();
  return err;
}

/// Where a pipeline folder keeps expert `e` (diffusers' WanPipeline).
static std::string expertFolder(StringRef dir, int64_t e) {
  llvm::SmallString<256> path(dir);
  llvm::sys::path::append(path, e == 0 ? "transformer" : "transformer_2");
  return std::string(path);
}

Error train::saveSessionWeights(Session &s, StringRef dir,
                                host::SaveWeightsOptions saveOptions,
                                bool ema) {
  if (ema && !s.recipe().hasEma())
    return createStringError("the run keeps no EMA of the weights to write "
                             "(give an EMA decay)");
  if (s.numExperts() == 1)
    return saveStateWeights(s, s.state(), dir, saveOptions, ema);
  for (int64_t e = 0; e < s.numExperts(); ++e)
    if (Error err = saveStateWeights(s, s.expertState(e), expertFolder(dir, e),
                                     saveOptions, ema))
      return err;
  return Error::success();
}

Error train::loadSessionWeights(Session &s, StringRef path) {
  if (s.numExperts() == 1)
    return host::loadWeights(path, s.state(), &s.plan());
  for (int64_t e = 0; e < s.numExperts(); ++e)
    if (Error err = host::loadWeights(expertFolder(path, e), s.expertState(e),
                                      &s.plan()))
      return err;
  return Error::success();
}
