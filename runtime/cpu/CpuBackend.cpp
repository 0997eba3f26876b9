//===- CpuBackend.cpp - The reference backend -----------------------------===//

#include "megaslide/runtime/cpu/CpuBackend.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/Isa.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/FormatVariadic.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>

using namespace megaslide;
using namespace megaslide::cpu;
using exec::DType;
using exec::Home;

namespace {

using Clock = std::chrono::steady_clock;

/// The tracking allocator standing in for device memory: every allocation
/// is placed where the plan says, checked against the live ones, and
/// measured.
class TrackingArena {
public:
  explicit TrackingArena(uint8_t *storage) : storage(storage) {}

  llvm::Error allocate(int64_t offset, int64_t size, int64_t owner) {
    if (size == 0)
      return llvm::Error::success();
    auto next = live.lower_bound(offset);
    if (next != live.end() && next->first < offset + size)
      return overlap(owner, next->second.owner);
    if (next != live.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > offset)
        return overlap(owner, prev->second.owner);
    }
    live[offset] = {size, owner};
    liveBytes += size;
    peakLiveBytes = std::max(peakLiveBytes, liveBytes);
    highWater = std::max(highWater, offset + size);
    return llvm::Error::success();
  }
  void release(int64_t offset) {
    auto it = live.find(offset);
    if (it == live.end())
      return;
    liveBytes -= it->second.size;
    live.erase(it);
  }
  uint8_t *at(int64_t offset) { return storage + offset; }

  int64_t highWater = 0, peakLiveBytes = 0;

private:
  llvm::Error overlap(int64_t a, int64_t b) {
    return llvm::createStringError("device memory plan is corrupt: %" +
                                   llvm::Twine(a) + " is placed over live %" +
                                   llvm::Twine(b));
  }
  struct Allocation {
    int64_t size, owner;
  };
  uint8_t *storage;
  std::map<int64_t, Allocation> live; ///< by offset
  int64_t liveBytes = 0;
};

bool isFloat(DType d) {
  return d == DType::BF16 || d == DType::F16 || d == DType::F32;
}

/// One execution of the plan: where each value's bytes are right now.
class StepRun {
public:
  StepRun(const exec::ExecPlan &plan, uint8_t *arenaStorage,
          std::vector<std::vector<uint8_t>> &hostBytes)
      : plan(plan), arena(arenaStorage), hostBytes(hostBytes) {
    hostBytes.resize(plan.values.size());
  }

  uint8_t *data(int64_t id) {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Device)
      return arena.at(v.offset);
    return hostBytes[id].data();
  }

  const exec::ExecPlan &plan;
  TrackingArena arena;
  std::vector<std::vector<uint8_t>> &hostBytes; ///< inputs and host values
};

} // namespace

CpuBackend::CpuBackend(const exec::ExecPlan &plan)
    : plan(plan), liveness(exec::computeLiveness(plan)) {}

llvm::Expected<std::unique_ptr<CpuBackend>>
CpuBackend::create(const exec::ExecPlan &plan) {
  // The kernels read MEGASLIDE_CPU_ISA and MEGASLIDE_NUM_THREADS; a bad
  // value is reported here instead of aborting or being ignored there.
  if (const char *error = cpuSettingsError())
    return llvm::createStringError(error);
  // The arena is host memory here: refuse what cannot be allocated rather
  // than abort inside the allocator.
  llvm::Expected<uint64_t> memory = host::usableHostMemoryBytes();
  if (!memory)
    return memory.takeError();
  if (static_cast<uint64_t>(plan.arenaBytes) > *memory)
    return llvm::createStringError(
        "the plan's device arena of " + llvm::Twine(plan.arenaBytes) +
        " bytes does not fit this machine's memory; the cpu backend holds "
        "it in host memory (use --backend sim for plans this size)");
  std::unique_ptr<CpuBackend> backend(new CpuBackend(plan));
  // Kept from step to step: a fresh arena each step cost a page fault per
  // 4 KiB, 6% of a 1,024-token step (docs/Benchmarks.md, "CPU training
  // step"). Every value is written before it is read, as on a device, so
  // what the arena held in an earlier step is never seen.
  backend->arenaStorage.resize(plan.arenaBytes);
  backend->releasedAfter.resize(plan.instructions.size());
  for (size_t id = 0; id < plan.values.size(); ++id) {
    const exec::Value &v = plan.values[id];
    if (v.viewOf || backend->liveness.def[id] < 0)
      continue;
    int64_t last =
        std::max(backend->liveness.def[id], backend->liveness.lastUse[id]);
    if (last >= 0 && last < static_cast<int64_t>(plan.instructions.size()))
      backend->releasedAfter[last].push_back(id);
  }
  for (const exec::Instruction &inst : plan.instructions) {
    GraphKernel kernel = nullptr;
    // A reshape's result is a view: it holds the operand's bytes already.
    if (!exec::isScheduleOp(inst.op) && inst.op != exec::OpCode::Reshape) {
      kernel = findGraphKernel(inst.op);
      if (!kernel)
        return llvm::createStringError(
            llvm::Twine("the cpu backend has no kernel for '") +
            exec::opName(inst.op) + "'");
    }
    backend->kernels.push_back(kernel);
  }
  return backend;
}

llvm::Expected<exec::StepResult>
CpuBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                 const exec::StepOptions &options) {
  StepRun run(plan, arenaStorage.data(), hostStorage);
  exec::StepResult result;
  Clock::time_point begin = Clock::now();
  auto since = [&](Clock::time_point t) {
    return std::chrono::duration<double>(t - begin).count();
  };

  // Inputs: converted to their planned dtype on the host.
  int64_t optimizerStep = state.step + 1;
  for (int64_t id : plan.inputs) {
    const exec::Value &v = plan.values[id];
    int64_t n = v.type.numElements();
    run.hostBytes[id].resize(v.type.bytes());
    if (v.name == "step") {
      std::vector<float> one(n, static_cast<float>(optimizerStep));
      narrow(one.data(), v.type.dtype, n, run.hostBytes[id].data());
      if (v.type.dtype == DType::I64 && n == 1)
        std::memcpy(run.hostBytes[id].data(), &optimizerStep, 8);
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
    narrow(it->second.data(), v.type.dtype, n, run.hostBytes[id].data());
  }

  if (plan.outputs.empty())
    return llvm::createStringError("the plan returns no loss");
  int64_t lossId = plan.outputs[0];
  auto [lossSourceId, lossDef] = exec::lossSource(plan);
  auto readLoss = [&, lossSourceId = lossSourceId] {
    widen(run.data(lossSourceId), plan.values[lossSourceId].type.dtype, 1,
          &result.loss);
  };
  auto finish = [&] {
    result.seconds = since(Clock::now());
    result.memory.plannedArenaBytes = plan.arenaBytes;
    result.memory.plannedLiveBytes = plan.plannedLiveBytes;
    result.memory.measuredArenaBytes = run.arena.highWater;
    result.memory.measuredLiveBytes = run.arena.peakLiveBytes;
  };
  bool updating = false;

  std::vector<std::vector<float>> wide;
  std::vector<OpTensor> operands, results;
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    Clock::time_point start = Clock::now();

    // Allocate results and workspace where the plan put them.
    for (int64_t r : inst.results) {
      const exec::Value &v = plan.values[r];
      if (v.home == Home::Host)
        run.hostBytes[r].resize(v.type.bytes());
      else if (!v.viewOf)
        if (llvm::Error err = run.arena.allocate(v.offset, v.type.bytes(), r))
          return std::move(err);
    }
    for (const exec::Range &w : inst.workspace)
      if (llvm::Error err = run.arena.allocate(w.offset, w.size, -1))
        return std::move(err);

    if (inst.op == exec::OpCode::Fetch) {
      if (options.beforeFetch)
        options.beforeFetch(inst.param);
      const host::HostTensor *source = state.find(inst.param);
      if (!source)
        return llvm::createStringError("host state has no parameter '" +
                                       inst.param + "'");
      const exec::Value &v = plan.values[inst.results[0]];
      narrow(source->data.data(), v.type.dtype, v.type.numElements(),
             run.data(inst.results[0]));
    } else if (inst.op == exec::OpCode::HostToDevice ||
               inst.op == exec::OpCode::DeviceToHost) {
      std::memcpy(run.data(inst.results[0]), run.data(inst.operands[0]),
                  plan.values[inst.results[0]].type.bytes());
    } else if (inst.op == exec::OpCode::HostAdamW) {
      llvm::Expected<host::AdamWTensors> tensors =
          host::adamwTensors(state, inst.param);
      if (!tensors)
        return tensors.takeError();
      const exec::Value &g = plan.values[inst.operands[0]];
      host::HostGradient gradient{run.data(inst.operands[0]), g.type.dtype,
                                  g.type.numElements()};
      if (options.onGradient) {
        std::vector<float> wide(gradient.count);
        widen(gradient.data, gradient.dtype, gradient.count, wide.data());
        options.onGradient(inst.param, wide);
      }
      if (options.retainGradient)
        options.retainGradient(inst, gradient);
      if (options.applyUpdates && !updating) {
        // The compiler's plans compute the loss before the first update:
        // a non-finite one skips the step with the state untouched.
        if (lossDef >= 0 && lossDef < static_cast<int64_t>(i)) {
          readLoss();
          if (!std::isfinite(result.loss)) {
            result.skipped = true;
            finish();
            return result;
          }
        }
        updating = true;
      }
      if (options.applyUpdates) {
        llvm::Expected<double> squared = host::streamingUpdate(
            state, *tensors, inst, gradient,
            {optimizerStep, options.lr, options.gradScale});
        if (!squared)
          return squared.takeError();
        result.gradSquaredNorm += *squared;
      }
    } else if (GraphKernel kernel = kernels[i]) {
      wide.resize(inst.operands.size() + inst.results.size());
      operands.clear();
      results.clear();
      size_t slot = 0;
      auto bind = [&](int64_t id) {
        const exec::Value &v = plan.values[id];
        OpTensor t;
        t.type = v.type;
        if (isFloat(v.type.dtype)) {
          wide[slot].resize(v.type.numElements());
          t.f32 = wide[slot++].data();
        } else if (v.type.dtype == DType::I32) {
          t.i32 = reinterpret_cast<int32_t *>(run.data(id));
        } else {
          t.i64 = reinterpret_cast<int64_t *>(run.data(id));
        }
        return t;
      };
      for (int64_t o : inst.operands) {
        OpTensor t = bind(o);
        if (t.f32)
          widen(run.data(o), t.type.dtype, t.type.numElements(), t.f32);
        operands.push_back(t);
      }
      for (int64_t r : inst.results)
        results.push_back(bind(r));
      if (inst.op == exec::OpCode::FlowMatchingLoss && options.onPrediction &&
          !operands.empty() && operands[0].f32)
        options.onPrediction(
            operands[0].type.shape,
            {operands[0].f32,
             static_cast<size_t>(operands[0].type.numElements())});
      if (llvm::Error err = kernel(inst, operands, results))
        return llvm::createStringError("instruction #" + llvm::Twine(i) + ": " +
                                       llvm::toString(std::move(err)));
      for (size_t k = 0; k < results.size(); ++k)
        if (results[k].f32)
          narrow(results[k].f32, results[k].type.dtype,
                 results[k].type.numElements(), run.data(inst.results[k]));
    }

    if (options.trace && inst.op != exec::OpCode::Record &&
        inst.op != exec::OpCode::Wait) {
      exec::TraceSpan span;
      span.stream = inst.stream;
      span.name = exec::spanName(inst);
      span.start = since(start);
      span.seconds = since(Clock::now()) - span.start;
      span.instruction = i;
      span.layer = inst.layer;
      span.flops = inst.cost.matmulFlops + inst.cost.attentionFlops +
                   inst.cost.otherFlops;
      span.bytes = inst.cost.bytes;
      result.spans.push_back(std::move(span));
    }

    for (const exec::Range &w : inst.workspace)
      run.arena.release(w.offset);
    for (int64_t id : releasedAfter[i]) {
      const exec::Value &v = plan.values[id];
      if (v.home == Home::Device)
        run.arena.release(v.offset);
    }
  }

  widen(run.data(lossId), plan.values[lossId].type.dtype, 1, &result.loss);
  if (options.applyUpdates && !std::isfinite(result.loss)) {
    if (!updating) {
      result.skipped = true; // a plan that updates nothing
    } else {
      // Only a plan that updates before computing its loss gets here.
      state.incomplete = true;
      return llvm::createStringError(llvm::formatv(
          "step {0}: the loss is {1}, and this plan updates parameters before "
          "it computes the loss, so the step could not be skipped: the host "
          "state is incomplete",
          optimizerStep, result.loss));
    }
  } else if (options.applyUpdates) {
    state.step = optimizerStep;
    state.incomplete = false;
  }
  finish();
  return result;
}
