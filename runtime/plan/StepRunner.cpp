//===- StepRunner.cpp - One step's semantics over device primitives -------===//

#include "megaslide/runtime/plan/StepRunner.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/WorkerPool.h"
#include "megaslide/runtime/plan/Liveness.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <chrono>
#include <cmath>
#include <cstring>

using namespace megaslide;
using namespace megaslide::exec;

using Clock = std::chrono::steady_clock;

static double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

llvm::Error exec::instError(size_t i, const Instruction &inst,
                            const llvm::Twine &msg) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "instruction #" + llvm::Twine(i) + " ('" +
                                     opName(inst.op) + "'): " + msg);
}

void StepStatus::fail(const std::string &message) {
  std::lock_guard<std::mutex> lock(mu);
  if (first.empty())
    first = message;
  failedFlag = true;
}

std::string StepStatus::message() const {
  std::lock_guard<std::mutex> lock(mu);
  return first;
}

void StepStatus::reset() {
  std::lock_guard<std::mutex> lock(mu);
  first.clear();
  failedFlag = false;
}

Device::~Device() = default;

std::optional<std::pair<double, double>> Device::timeOf(size_t) {
  return std::nullopt;
}

/// One run of the plan: what the walk and the host work share.
struct StepRunner::Step {
  Step(host::HostState &state, const StepOptions &options)
      : state(state), options(options), optimizerStep(state.step + 1),
        begin(Clock::now()) {}
  host::HostState &state;
  const StepOptions &options;
  int64_t optimizerStep;
  Clock::time_point begin, t0;
  /// Written by host work, read after Device::endStep: each update's
  /// gradient norm (summed in plan order), when each ran ({-1, 0}: not).
  std::vector<double> squaredNorms;
  std::vector<std::pair<double, double>> hostTimes, issueTimes;
  /// Set by the first update's host work only.
  std::atomic<bool> skipped = false;
};

llvm::Error Device::collective(size_t) {
  // Backends without device collectives refuse a job's plan when made
  // (checkOneRank); this is the last line.
  return llvm::createStringError(llvm::Twine("the ") + name() +
                                 " backend has no device collectives");
}

llvm::Error exec::checkOneRank(const ExecPlan &plan, llvm::StringRef backend) {
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    if (inst.op != OpCode::AllGather && inst.op != OpCode::ReduceScatter)
      continue;
    return llvm::createStringError(
        "the " + backend + " backend cannot run instruction #" +
        llvm::Twine(i) + " ('" + opName(inst.op) + "' over " +
        llvm::Twine(inst.cost.ranks) +
        " ranks): the plan is for a job of several GPUs (megaslide-plan "
        "--gpus-per-node, --nodes), whose device collectives only the cuda "
        "backend runs (one process per GPU under mpirun or srun); replay it "
        "with --backend sim. A job on the cpu backend runs one rank's plan "
        "and does its collectives on the host (docs/Distributed.md)");
  }
  return llvm::Error::success();
}

StepRunner::StepRunner(const ExecPlan &plan, Device &device)
    : plan(plan), device(device), guard(lossGuard(plan)),
      jobRanks(plan.jobRanks()) {
  Liveness liveness = computeLiveness(plan);
  size_t n = plan.instructions.size();
  releasedAfter.resize(n);
  for (size_t id = 0; id < plan.values.size(); ++id) {
    if (plan.values[id].viewOf || liveness.def[id] < 0)
      continue;
    int64_t last = std::max(liveness.def[id], liveness.lastUse[id]);
    if (last >= 0 && last < static_cast<int64_t>(n))
      releasedAfter[last].push_back(id);
  }
  std::vector<bool> shardCopy(plan.values.size());
  shardGradient.assign(n, false);
  for (size_t i = 0; i < n; ++i) {
    const Instruction &inst = plan.instructions[i];
    if (inst.op == OpCode::Fetch)
      fetches.push_back(i);
    if (inst.op == OpCode::DeviceToHost && inst.hasAttr("ranks"))
      shardCopy[inst.results[0]] = true;
    if (inst.op == OpCode::HostAdamW)
      shardGradient[i] = shardCopy[inst.operands[0]];
  }
}

llvm::Error StepRunner::stageInputs(const StepInputs &inputs,
                                    int64_t optimizerStep) {
  // Converted to their planned dtype on the host, the larger ones on the
  // CPU kernels' workers.
  for (int64_t id : plan.inputs) {
    const Value &v = plan.values[id];
    int64_t n = v.type.numElements();
    uint8_t *dst = device.hostData(id);
    if (v.name == "step") {
      // The optimizer step counter is the host state's, not the caller's.
      std::vector<float> one(n, static_cast<float>(optimizerStep));
      cpu::narrowOnWorkers(cpu::processPool(), one.data(), v.type.dtype, n,
                           dst);
      if (v.type.dtype == DType::I64 && n == 1)
        std::memcpy(dst, &optimizerStep, 8);
      continue;
    }
    auto it = inputs.find(v.name);
    if (it == inputs.end())
      return llvm::createStringError("step input '" + v.name +
                                     "' was not provided");
    if (static_cast<int64_t>(it->second.size()) != n)
      return llvm::createStringError(
          "step input '" + v.name + "' has " + llvm::Twine(it->second.size()) +
          " elements; the plan expects " + llvm::Twine(n));
    cpu::narrowOnWorkers(cpu::processPool(), it->second.data(), v.type.dtype, n,
                         dst);
  }
  return llvm::Error::success();
}

llvm::Expected<StepResult> StepRunner::run(const StepInputs &inputs,
                                           host::HostState &state,
                                           const StepOptions &options) {
  if (options.onPrediction && !device.synchronous())
    return llvm::createStringError(
        llvm::Twine("the ") + device.name() +
        " backend does not return the model's prediction; use the cpu "
        "backend (Trainer.predict)");
  if (jobRanks > 1 && (options.applyUpdates || options.onGradient))
    return llvm::createStringError(
        "a job's plan gives each rank its shard of the gradients' sum over "
        "the ranks: it needs the trainer's deferred update (no update in "
        "the step, no onGradient)");
  size_t n = plan.instructions.size();
  Step step(state, options);
  if (llvm::Error e = stageInputs(inputs, step.optimizerStep))
    return std::move(e);
  if (plan.outputs.empty())
    return llvm::createStringError("the plan returns no loss");

  // The masters every fetch casts, checked before anything is issued.
  StepSetup setup;
  setup.trace = options.trace;
  setup.status = &status;
  for (size_t i : fetches) {
    const Instruction &inst = plan.instructions[i];
    const host::HostTensor *source = state.find(inst.param);
    if (!source)
      return instError(i, inst,
                       "host state has no parameter '" + inst.param + "'");
    const TensorType &type = plan.values[inst.results[0]].type;
    if (source->param->type.numElements() != type.numElements() ||
        static_cast<int64_t>(source->data.size()) != source->held())
      return instError(i, inst,
                       "host tensor '" + inst.param + "' has the wrong size");
    FetchSource f{source->data.data(), source->heldBegin(), source->held(),
                  nullptr, nullptr};
    if (options.beforeFetch)
      f.before = [&options, &inst] { options.beforeFetch(inst.param); };
    // A job's plan fetches the rank's shard (of a tensor the host state
    // holds whole, a frozen buffer, too) and all-gathers it on the device.
    if (!inst.hasAttr("ranks") && source->sharded) {
      // Every rank gathers each fetched master at the same point of the
      // same plan: only where fetches run in program order on this thread.
      if (!options.gatherFetch || !device.synchronous())
        return instError(i, inst,
                         llvm::Twine("the ") + device.name() +
                             " backend cannot fetch '" + inst.param +
                             "', which is sharded over the job's ranks");
      f.master = nullptr;
      f.gather = [&options, source, dtype = type.dtype](void *dst) {
        return options.gatherFetch(*source, dtype, dst);
      };
    }
    setup.fetches.push_back(std::move(f));
  }

  status.reset();
  if (options.onRunStart)
    options.onRunStart();
  if (llvm::Error e = device.beginStep(std::move(setup)))
    return std::move(e);
  step.t0 = Clock::now();
  step.squaredNorms.assign(n, 0.0);
  step.hostTimes.assign(n, {-1.0, 0.0});
  step.issueTimes.assign(n, {-1.0, 0.0});

  llvm::Error issued = issueAll(step);
  if (issued)
    status.fail("cancelled"); // no queued host work may run
  // Whatever happened, nothing may stay in flight past this call.
  llvm::Error ended = device.endStep();
  if (issued) {
    llvm::consumeError(std::move(ended));
    return std::move(issued);
  }
  if (ended)
    return std::move(ended);
  if (status.failed())
    return llvm::createStringError(status.message());
  return finish(step);
}

llvm::Error StepRunner::issueAll(Step &step) {
  bool timeIssues = step.options.trace && device.synchronous();
  size_t fetchIndex = 0;
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    if (status.failed())
      return llvm::Error::success(); // reported after Device::endStep
    Clock::time_point start = timeIssues ? Clock::now() : Clock::time_point();
    if (llvm::Error e = device.allocate(i))
      return e;
    if (llvm::Error e = issue(step, i, fetchIndex))
      return e;
    // The loss, as soon as it exists, for the first update's guard.
    if (static_cast<int64_t>(i) == guard.def)
      if (llvm::Error e =
              device.captureValue(guard.value, plan.instructions[i].stream))
        return e;
    if (timeIssues)
      step.issueTimes[i] = {secondsBetween(step.t0, start),
                            secondsBetween(start, Clock::now())};
    device.release(i, releasedAfter[i]);
  }
  return llvm::Error::success();
}

llvm::Error StepRunner::issue(Step &step, size_t i, size_t &fetchIndex) {
  const Instruction &inst = plan.instructions[i];
  switch (inst.op) {
  case OpCode::Fetch:
    return device.fetch(i, fetchIndex++);
  case OpCode::HostToDevice:
  case OpCode::DeviceToHost:
    return device.copy(i);
  case OpCode::AllGather:
  case OpCode::ReduceScatter:
    return device.collective(i);
  case OpCode::Record:
    return device.record(i);
  case OpCode::Wait:
    return device.wait(i);
  case OpCode::HostAdamW:
    return device.runOnHost(i, [this, &step, i] { hostUpdate(step, i); });
  default:
    break;
  }
  const StepOptions &options = step.options;
  if (inst.op == OpCode::FlowMatchingLoss && options.onPrediction &&
      !inst.operands.empty()) {
    // The model's prediction, as the loss reads it (fp32 from its dtype).
    const TensorType &type = plan.values[inst.operands[0]].type;
    if (type.dtype == DType::BF16 || type.dtype == DType::F16 ||
        type.dtype == DType::F32) {
      std::vector<uint8_t> bytes(type.bytes());
      if (llvm::Error e = device.readValue(inst.operands[0], bytes.data()))
        return e;
      std::vector<float> prediction(type.numElements());
      cpu::widen(bytes.data(), type.dtype, prediction.size(),
                 prediction.data());
      options.onPrediction(type.shape, prediction);
    }
  }
  return device.launch(i);
}

void StepRunner::hostUpdate(Step &step, size_t i) {
  // An error (of host work or of the issue loop) cancels the updates still
  // queued: the step fails as a whole.
  if (status.failed() || step.skipped)
    return;
  const Instruction &inst = plan.instructions[i];
  const StepOptions &options = step.options;
  if (options.applyUpdates && static_cast<int64_t>(i) == guard.firstUpdate &&
      guard.def >= 0) {
    // Nothing is updated yet: a non-finite loss skips the step.
    const TensorType &type = plan.values[guard.value].type;
    std::vector<uint8_t> bytes(type.bytes());
    if (llvm::Error e = device.awaitValue(guard.value, bytes.data())) {
      status.fail("host stream: instruction #" + std::to_string(i) + ": " +
                  llvm::toString(std::move(e)));
      return;
    }
    float loss;
    cpu::widen(bytes.data(), type.dtype, 1, &loss);
    if (!std::isfinite(loss)) {
      step.skipped = true;
      return;
    }
  }
  Clock::time_point start = Clock::now();
  llvm::Expected<host::AdamWTensors> tensors =
      host::adamwTensors(step.state, inst.param);
  if (!tensors) {
    status.fail(llvm::toString(tensors.takeError()));
    return;
  }
  const Value &g = plan.values[inst.operands[0]];
  HostGradient gradient{device.hostData(inst.operands[0]), g.type.dtype,
                        g.type.numElements()};
  if (shardGradient[i])
    // The rank's shard (Device::copy): the elements of the master it holds.
    gradient.count = tensors->master->held();
  if (options.onGradient) {
    std::vector<float> wide(gradient.count);
    cpu::widen(gradient.data, gradient.dtype, gradient.count, wide.data());
    options.onGradient(inst.param, wide);
  }
  if (options.retainGradient)
    options.retainGradient(inst, gradient);
  if (options.applyUpdates) {
    llvm::Expected<double> squared = host::streamingUpdate(
        step.state, *tensors, inst, gradient,
        {step.optimizerStep, options.lr, options.gradScale});
    if (!squared) {
      status.fail(llvm::toString(squared.takeError()));
      return;
    }
    step.squaredNorms[i] = *squared;
  }
  step.hostTimes[i] = {secondsBetween(step.t0, start),
                       secondsBetween(start, Clock::now())};
}

llvm::Expected<StepResult> StepRunner::finish(Step &step) {
  const StepOptions &options = step.options;
  host::HostState &state = step.state;
  StepResult result;
  const TensorType &lossType = plan.values[plan.outputs[0]].type;
  std::vector<uint8_t> bytes(lossType.bytes());
  if (llvm::Error e = device.readValue(plan.outputs[0], bytes.data()))
    return std::move(e);
  cpu::widen(bytes.data(), lossType.dtype, 1, &result.loss);
  if (plan.outputs.size() > 1) {
    const TensorType &type = plan.values[plan.outputs[1]].type;
    std::vector<uint8_t> unweighted(type.bytes());
    if (llvm::Error e = device.readValue(plan.outputs[1], unweighted.data()))
      return std::move(e);
    cpu::widen(unweighted.data(), type.dtype, 1,
               &result.unweightedLoss.emplace());
  }

  // The commit: a skipped step leaves the state as it was.
  bool finite = std::isfinite(result.loss);
  if (step.skipped ||
      (options.applyUpdates && guard.firstUpdate < 0 && !finite)) {
    result.skipped = true;
  } else if (options.applyUpdates && !finite) {
    state.incomplete = true; // updated before the loss was known
    return llvm::createStringError(llvm::formatv(
        "step {0}: the loss is {1}, and this plan updates parameters before "
        "it computes the loss, so the step could not be skipped: the host "
        "state is incomplete",
        step.optimizerStep, result.loss));
  } else if (options.applyUpdates) {
    state.step = step.optimizerStep;
    state.incomplete = false;
    for (double norm : step.squaredNorms)
      result.gradSquaredNorm += norm;
  }

  if (options.trace) {
    for (size_t i = 0; i < plan.instructions.size(); ++i) {
      const Instruction &inst = plan.instructions[i];
      if (inst.op == OpCode::Record || inst.op == OpCode::Wait)
        continue;
      std::optional<std::pair<double, double>> time;
      if (device.synchronous())
        time = step.issueTimes[i];
      else if (!isGpuStream(inst.stream))
        time = step.hostTimes[i];
      else
        time = device.timeOf(i);
      if (time && time->first >= 0)
        result.spans.push_back(
            instructionSpan(inst, i, time->first, time->second));
    }
  }
  result.seconds = secondsBetween(step.begin, Clock::now());
  result.memory.plannedArenaBytes = plan.arenaBytes;
  result.memory.plannedLiveBytes = plan.plannedLiveBytes;
  device.measureMemory(result.memory);
  return result;
}
