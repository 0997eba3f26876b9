//===- Session.cpp - A training run over an execution plan ----------------===//

#include "train/Session.h"

#include "cpu/CpuBackend.h"
#include "cuda/CudaBackend.h"
#include "sim/SimBackend.h"
#include "support/Json.h"

#include "llvm/Support/JSON.h"

using namespace megaslide;
using namespace megaslide::train;

/// Version of trainerState()'s JSON.
static constexpr int64_t kTrainerStateVersion = 1;

Session::Session(std::unique_ptr<exec::ExecPlan> plan, InputShapes shapes,
                 uint64_t seed, std::unique_ptr<DataSource> data)
    : planStorage(std::move(plan)), shapes(std::move(shapes)), seed(seed),
      data(std::move(data)) {}

/// Bytes of the host state the plan's backend will hold.
static uint64_t hostStateBytes(const exec::ExecPlan &plan) {
  uint64_t bytes = 0;
  for (const exec::Param &p : plan.params)
    if (p.role == "master" || p.role == "moment" || p.role == "frozen")
      bytes += p.type.numElements() * sizeof(float);
  return bytes;
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
  auto backend = createBackend(session->plan(), options);
  if (!backend)
    return backend.takeError();
  session->executor = std::move(*backend);
  // Only backends that compute hold the model state (sim needs none): the
  // 105B state is 1.27 TB, so check it fits before touching a byte.
  if (session->executor->computesLoss()) {
    uint64_t need = hostStateBytes(session->plan());
    uint64_t have = host::physicalMemoryBytes();
    if (need > have)
      return llvm::createStringError(
          "the host state of '" + session->plan().model + "' needs " +
          llvm::Twine(need >> 20) + " MiB (fp32 masters and AdamW moments) " +
          "but this machine has " + llvm::Twine(have >> 20) +
          " MiB of memory; use --backend sim to predict it, or a smaller "
          "model");
    session->hostState = host::initHostState(session->plan(), options.seed);
  }
  return session;
}

llvm::Expected<exec::StepResult> Session::trainStep(bool trace) {
  exec::StepOptions options;
  options.trace = trace;
  return runStep(data->next(), options);
}

llvm::Expected<exec::StepResult>
Session::runStep(const exec::StepInputs &inputs,
                 const exec::StepOptions &options) {
  return executor->step(inputs, hostState, options);
}

std::string Session::trainerState() const {
  llvm::json::Object o{{"version", kTrainerStateVersion},
                       {"seed", std::to_string(seed)},
                       {"data_state", std::to_string(data->state())},
                       {"step", hostState.step}};
  std::string text;
  llvm::raw_string_ostream os(text);
  os << llvm::json::Value(std::move(o));
  return text;
}

llvm::Error Session::restoreTrainerState(llvm::StringRef json) {
  llvm::Expected<llvm::json::Value> value = parseJson(json);
  if (!value)
    return llvm::createStringError("trainer state is not JSON: " +
                                   llvm::toString(value.takeError()));
  const llvm::json::Object *o = value->getAsObject();
  std::optional<int64_t> version = o ? o->getInteger("version") : std::nullopt;
  if (!version || *version != kTrainerStateVersion)
    return llvm::createStringError("trainer state has an unsupported version");
  std::optional<llvm::StringRef> dataState = o->getString("data_state");
  std::optional<int64_t> step = o->getInteger("step");
  uint64_t parsed = 0;
  if (!dataState || dataState->getAsInteger(10, parsed) || !step || *step < 0)
    return llvm::createStringError(
        "trainer state lacks a valid 'data_state' or 'step'");
  data->setState(parsed);
  hostState.step = *step;
  return llvm::Error::success();
}
