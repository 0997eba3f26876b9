//===- Session.cpp - A training run over an execution plan ----------------===//

#include "megaslide/runtime/train/Session.h"

#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cuda/CudaPlan.h"
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

/// Version of trainerState()'s JSON: 2 adds the settings.
static constexpr int64_t kTrainerStateVersion = 2;

Session::Session(std::unique_ptr<exec::ExecPlan> plan, InputShapes shapes,
                 uint64_t seed, std::unique_ptr<DataSource> data)
    : planStorage(std::move(plan)), shapes(std::move(shapes)), seed(seed),
      data(std::move(data)) {}

uint64_t HostMemoryNeed::total() const {
  uint64_t sum = 0;
  for (const auto &part : parts)
    sum += part.second;
  return sum;
}

static std::string gib(uint64_t bytes) {
  return llvm::formatv("{0:F2} GiB", bytes / double(1ull << 30)).str();
}

/// What a computing backend holds in host memory for `plan`: upper bounds
/// from the plan's own sizes (docs/Runtime.md, "Host memory").
static HostMemoryNeed hostMemoryNeed(const exec::ExecPlan &plan,
                                     llvm::StringRef backend,
                                     const DataSource &data) {
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
    need.parts.push_back({"pinned weight staging",
                          static_cast<uint64_t>(cuda::weightStagingBytes(plan))});
  }
  need.parts.push_back(
      {"data (samples in memory, batches read ahead)", data.bytesHeld()});
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

static Settings computeSettings(const exec::ExecPlan &plan,
                                const SessionOptions &options) {
  Settings s;
  s.push_back({"seed", std::to_string(options.seed)});
  std::string data = "(synthetic)";
  if (!options.dataDir.empty()) {
    llvm::SmallString<256> real;
    data = llvm::sys::fs::real_path(options.dataDir, real) ? options.dataDir
                                                           : std::string(real);
  }
  s.push_back({"data", data});
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
                   llvm::StringRef(exec::dtypeName(
                                       plan.values[inst.results[0]].type.dtype))
                       .lower()});
      break;
    }
  s.push_back({"batch", std::to_string(plan.batch)});
  std::string text = exec::serialize(plan);
  s.push_back({"plan_hash",
               llvm::formatv("{0:x-16}", llvm::xxh3_64bits(
                                             llvm::arrayRefFromStringRef(text)))
                   .str()});
  return s;
}

llvm::Expected<std::unique_ptr<Session>>
Session::create(exec::ExecPlan plan, const SessionOptions &options) {
  llvm::Expected<InputShapes> shapes = InputShapes::of(plan);
  if (!shapes)
    return shapes.takeError();
  uint64_t dataSeed = options.seed ^ hashName("batches");
  std::unique_ptr<DataSource> data;
  if (options.dataDir.empty()) {
    data = std::make_unique<SyntheticData>(*shapes, dataSeed);
  } else {
    auto files = FileData::open(options.dataDir, *shapes, dataSeed);
    if (!files)
      return files.takeError();
    data = std::move(*files);
  }
  auto owned = std::make_unique<exec::ExecPlan>(std::move(plan));
  std::unique_ptr<Session> session(new Session(
      std::move(owned), std::move(*shapes), options.seed, std::move(data)));
  const exec::ExecPlan &p = session->plan();
  // Only backends that compute hold the model state (sim needs none): the
  // 105B state is 1.27 TB, so check that everything fits, summed, before
  // the backend or the state touches a byte.
  bool computes = options.backend != "sim";
  if (computes) {
    session->memoryNeed = hostMemoryNeed(p, options.backend, *session->data);
    uint64_t need = session->memoryNeed.total();
    host::HostMemoryReadings readings = host::readHostMemory();
    llvm::Expected<uint64_t> usable = host::usableHostMemoryBytes(readings);
    if (!usable)
      return usable.takeError();
    uint64_t have = *usable;
    if (need > have) {
      std::string parts;
      for (const auto &[what, bytes] : session->memoryNeed.parts)
        if (bytes)
          parts += "\n  " + gib(bytes) + "  " + what;
      return llvm::createStringError(
          "'" + p.model + "' on the " + options.backend + " backend needs " +
          gib(need) + " of host memory, but this machine has " + gib(have) +
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
    session->runSettings = computeSettings(p, options);
  }
  return session;
}

llvm::Expected<exec::StepResult>
Session::trainStep(const exec::StepOptions &options) {
  if (hostState.incomplete)
    return runStep({}, {}); // the error below, before drawing data
  uint64_t before = data->state();
  llvm::Expected<exec::StepInputs> inputs = data->next();
  if (!inputs)
    return inputs.takeError();
  llvm::Expected<exec::StepResult> result = runStep(*inputs, options);
  if (!result)
    data->setState(before); // a retry draws the same batch
  return result;
}

llvm::Expected<exec::StepResult>
Session::runStep(const exec::StepInputs &inputs,
                 const exec::StepOptions &options) {
  if (hostState.incomplete)
    return llvm::createStringError(
        llvm::formatv("the host state is incomplete: step {0} stopped "
                      "part-way with some parameters updated; load a "
                      "checkpoint before stepping again",
                      hostState.step + 1)
            .str());
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
                       {"settings", std::move(settings)}};
  std::string text;
  llvm::raw_string_ostream os(text);
  os << llvm::json::Value(std::move(o));
  return text;
}

/// The trainer state's object, version checked.
static llvm::Expected<llvm::json::Value> parseTrainerState(llvm::StringRef json) {
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
  data->setState(parsed);
  hostState.step = *step;
  hostState.incomplete = false;
  return llvm::Error::success();
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
