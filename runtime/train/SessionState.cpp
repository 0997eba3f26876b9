//===- SessionState.cpp - A run's settings and trainer state --------------===//
//
// What a checkpoint keeps of a session besides the host tensors: the
// settings that change the numbers a run computes, and the trainer state
// (data position, optimizer step, EMA count), as JSON.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/SessionParts.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/plan/ExecPlanJson.h"
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
/// update count and the previous step's gradient norm, 4 the two experts'
/// optimizer records ("experts", only of a two-expert run).
static constexpr int64_t kTrainerStateVersion = 4;

static std::string formatDouble(double v) {
  return llvm::formatv("{0}", llvm::format("%.17g", v)).str();
}

/// `v` as the user gave it (0.9, not 0.90000000000000002), yet exact: the
/// shortest of 15 to 17 digits that reads back as `v`.
static std::string formatShortest(double v) {
  for (int digits : {15, 16}) {
    std::string text = llvm::formatv("{0}", llvm::format("%.*g", digits, v));
    double back;
    if (!llvm::StringRef(text).getAsDouble(back) && back == v)
      return text;
  }
  return formatDouble(v);
}

Settings
train::computeSettings(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
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
  if (r.usesLogitNormal()) {
    s.push_back({"logit_mean", formatDouble(r.logitMean)});
    s.push_back({"logit_std", formatDouble(r.logitStd)});
  }
  s.push_back({"flow_shift", formatDouble(r.flowShift)});
  // Always: a Wan 2.2 expert's checkpoint is not resumed as the other's.
  s.push_back({"timestep_range", "[" + formatDouble(r.minTimestep) + ", " +
                                     formatDouble(r.maxTimestep) + ")"});
  // Always: a run of one model does not resume two experts, or another
  // boundary's.
  s.push_back({"experts", r.twoExperts()
                              ? "2, boundary " + formatShortest(r.boundary)
                              : "1"});
  s.push_back({"weighting_scheme", lossWeightingName(r.weighting).str()});
  // Buckets: every bucket's plan, so that a resume with another set of
  // buckets (or another plan for one) is refused.
  // Hashed with the job's micro-batches (a rank's share is not the run's)
  // and without the NVMe tier, which moves state and changes no number: a
  // run resumes with or without it.
  auto serializeForJob = [&](const exec::ExecPlan &p) {
    if (p.gradAccum == jobAccum && p.tierRoles.empty())
      return exec::serialize(p);
    exec::ExecPlan job = p;
    job.gradAccum = jobAccum;
    if (!job.tierRoles.empty()) {
      job.tierRoles.clear();
      job.tierWindowBytes = 0;
      job.version = job.oldestVersion();
    }
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

std::string Session::trainerState() const {
  llvm::json::Object settings;
  for (const auto &[name, value] : runSettings)
    settings[name] = value;
  // What the optimizer keeps besides the tensors, of each expert.
  auto optimizerRecord = [](const Expert &e) {
    llvm::json::Object o{{"step", e.state.step},
                         {"ema_updates", e.optimizer.emaUpdates()}};
    if (std::optional<double> norm = e.optimizer.previousNorm())
      o["previous_grad_norm"] = formatDouble(*norm);
    return o;
  };
  llvm::json::Object o = experts.size() > 1 ? llvm::json::Object()
                                            : optimizerRecord(experts.front());
  o["version"] = experts.size() > 1 ? kTrainerStateVersion : 3;
  o["seed"] = std::to_string(seed);
  o["data_state"] = std::to_string(data->state());
  o["steps_run"] = stepsRunSoFar;
  o["settings"] = std::move(settings);
  if (experts.size() > 1) {
    o["step"] = step();
    llvm::json::Array each;
    for (const Expert &e : experts)
      each.push_back(optimizerRecord(e));
    o["experts"] = std::move(each);
  }
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
  // The optimizer records: the state's own, or each expert's.
  std::vector<const llvm::json::Object *> records{o};
  if (experts.size() > 1) {
    const llvm::json::Array *each = o->getArray("experts");
    if (!each || each->size() != experts.size())
      return llvm::createStringError(llvm::formatv(
          "trainer state lacks the {0} experts' records", experts.size()));
    records.clear();
    for (const llvm::json::Value &v : *each)
      records.push_back(v.getAsObject());
  }
  std::vector<std::optional<double>> previousNorms;
  int64_t sum = 0;
  for (const llvm::json::Object *record : records) {
    std::optional<int64_t> own =
        record ? record->getInteger("step") : std::nullopt;
    if (!own || *own < 0)
      return llvm::createStringError("trainer state lacks a valid 'step'");
    sum += *own;
    std::optional<double> &previousNorm = previousNorms.emplace_back();
    if (std::optional<llvm::StringRef> norm =
            record->getString("previous_grad_norm")) {
      double v;
      if (norm->getAsDouble(v))
        return llvm::createStringError(
            "trainer state has a malformed 'previous_grad_norm'");
      previousNorm = v;
    }
  }
  if (sum != *step)
    return llvm::createStringError(llvm::formatv(
        "trainer state's experts took {0} steps, its 'step' says {1}", sum,
        *step));
  data->setState(parsed);
  for (size_t e = 0; e < experts.size(); ++e) {
    experts[e].state.step = *records[e]->getInteger("step");
    experts[e].state.incomplete = false;
    experts[e].optimizer.restore(
        records[e]->getInteger("ema_updates").value_or(0), previousNorms[e]);
  }
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
                                       const Settings &current,
                                       llvm::StringRef advice) {
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
  std::string text = "this run's settings differ from the checkpoint's, so "
                     "resuming would not continue it:" +
                     diffs;
  if (!advice.empty())
    return llvm::createStringError(text + "\n" + advice);
  return llvm::createStringError(
      text +
      (onlyPlan
           ? "\nthe execution plan differs: resume with the model, video "
             "size and planning flags the checkpoint was trained with (or "
             "--plan with the plan --save-plan wrote)"
           : "\nleave --seed, --data, --lr, --weight-decay and --precision "
             "out to use the checkpoint's values; the others must be given "
             "as the first run had them") +
      "; or start a fresh run with --overwrite-checkpoints");
}
