//===- CudaStep.cpp - One training step on the cuda backend ---------------===//
//
// Issues the plan's instructions in program order on their streams: the GPU
// streams' work through the driver, the host stream's on the host worker.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackendImpl.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/ParallelFor.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

namespace megaslide::cuda {

using exec::DType;
using exec::Home;
using exec::Stream;

llvm::Expected<exec::StepResult>
CudaBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                  const exec::StepOptions &options) {
  if (options.onPrediction)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "the cuda backend does not return the model's prediction; use the "
        "cpu backend (Trainer.predict)");
  Impl &I = *impl;
  const exec::ExecPlan &plan = I.plan;
  const CudaDriverApi &cu = *I.cu;
  using Clock = std::chrono::steady_clock;
  Clock::time_point begin = Clock::now();
  if (auto e = I.check(cu.cuCtxSetCurrent(I.ctx), "cuCtxSetCurrent"))
    return std::move(e);

  // Inputs into their pinned pool, in the planned dtype.
  int64_t optimizerStep = state.step + 1;
  for (int64_t id : plan.inputs) {
    const exec::Value &v = plan.values[id];
    int64_t n = v.type.numElements();
    uint8_t *dst = I.hostAddress(id);
    if (v.name == "step") {
      std::vector<float> one(n, static_cast<float>(optimizerStep));
      narrowOnWorkers(cpu::processPool(), one.data(), v.type.dtype, n, dst);
      if (v.type.dtype == DType::I64 && n == 1)
        std::memcpy(dst, &optimizerStep, 8);
      continue;
    }
    auto it = inputs.find(v.name);
    if (it == inputs.end())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "step input '" + v.name +
                                         "' was not provided");
    if (static_cast<int64_t>(it->second.size()) != n)
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "step input '" + v.name + "' has " + llvm::Twine(it->second.size()) +
              " elements; the plan expects " + llvm::Twine(n));
    narrowOnWorkers(cpu::processPool(), it->second.data(), v.type.dtype, n,
                    dst);
  }

  // The masters every fetch casts, checked before anything is issued.
  std::vector<WeightStager::Job> jobs;
  for (size_t k = 0; k < I.prep.fetches.size(); ++k) {
    size_t i = I.prep.fetches[k];
    const exec::Instruction &inst = plan.instructions[i];
    const host::HostTensor *source = state.find(inst.param);
    if (!source)
      return instError(i, inst,
                       "host state has no parameter '" + inst.param + "'");
    const exec::Value &v = plan.values[inst.results[0]];
    if (static_cast<int64_t>(source->data.size()) != v.type.numElements())
      return instError(i, inst,
                       "host tensor '" + inst.param + "' has the wrong size");
    WeightStager::Job job{source->data.data(), v.type.numElements(),
                          v.type.dtype, I.prep.fetchUpdate[k] >= 0, nullptr};
    if (options.beforeFetch)
      job.before = [&options, &inst] { options.beforeFetch(inst.param); };
    jobs.push_back(std::move(job));
  }

  CUstream compute = I.streams[0];
  if (auto e = I.syncStream(0, "step start", I.baseEvent))
    return std::move(e);
  I.stager.begin(std::move(jobs));
  Clock::time_point t0 = Clock::now();
  auto since0 = [t0](Clock::time_point t) {
    return std::chrono::duration<double>(t - t0).count();
  };
  {
    std::lock_guard<std::mutex> lock(I.errorMu);
    I.workerError.clear();
  }
  I.worker.reset();

  size_t n = plan.instructions.size();
  std::vector<std::pair<double, double>> hostTimes(n, {-1.0, 0.0});
  // Each update's gradient norm, written by the worker, summed in plan order.
  std::vector<double> squaredNorms(n, 0.0);
  size_t fetchCount = 0;
  bool trace = options.trace;
  // Written by the worker, read after drain(); only the first update sets it.
  std::atomic<bool> skipped = false;

  // host_adamw `i` on the worker, once its gradient is on the host.
  auto hostUpdate = [&](size_t i) {
    // An error (of the worker or of the issue loop) cancels the updates
    // still queued: the step fails as a whole.
    if (I.workerFailed() || skipped)
      return;
    const exec::Instruction &inst = plan.instructions[i];
    if (options.applyUpdates && I.prep.lossDef >= 0 &&
        static_cast<int64_t>(i) == I.prep.firstUpdate) {
      // Nothing is updated yet: a non-finite loss skips the step.
      if (CUresult r = I.cu->cuEventSynchronize(I.lossEvent)) {
        I.setWorkerError(
            "instruction #" + std::to_string(i) +
            ": cuEventSynchronize (loss): " + cuResultString(*I.cu, r));
        return;
      }
      const exec::Value &lossValue = I.plan.values[I.prep.lossValue];
      float loss;
      cpu::widen(lossValue.home == Home::Device
                     ? static_cast<const uint8_t *>(I.lossStage)
                     : I.hostAddress(I.prep.lossValue),
                 lossValue.type.dtype, 1, &loss);
      if (!std::isfinite(loss)) {
        skipped = true;
        return;
      }
    }
    Clock::time_point start = Clock::now();
    llvm::Expected<host::AdamWTensors> tensors =
        host::adamwTensors(state, inst.param);
    if (!tensors) {
      I.setWorkerError(llvm::toString(tensors.takeError()));
      return;
    }
    const exec::Value &g = I.plan.values[inst.operands[0]];
    host::HostGradient gradient{I.hostAddress(inst.operands[0]), g.type.dtype,
                                g.type.numElements()};
    if (options.onGradient) {
      std::vector<float> wide(gradient.count);
      cpu::widen(gradient.data, gradient.dtype, gradient.count, wide.data());
      options.onGradient(inst.param, wide);
    }
    if (options.retainGradient)
      options.retainGradient(inst, gradient);
    if (options.applyUpdates) {
      llvm::Expected<double> squared =
          host::streamingUpdate(state, *tensors, inst, gradient,
                                {optimizerStep, options.lr, options.gradScale});
      if (!squared) {
        I.setWorkerError(llvm::toString(squared.takeError()));
        return;
      }
      squaredNorms[i] = *squared;
    }
    hostTimes[i] = {since0(start), since0(Clock::now()) - since0(start)};
  };

  auto issueAll = [&]() -> llvm::Error {
    for (size_t i = 0; i < n; ++i) {
      const exec::Instruction &inst = plan.instructions[i];
      const PreparedInstruction &pi = I.prep.instructions[i];
      if (I.workerFailed())
        return llvm::Error::success(); // reported after the drain

      if (!isGpuStream(inst.stream)) {
        // The host stream: everything on the worker, in order, each task
        // after the GPU work it waits for (derived waits, a plan wait).
        std::vector<CUevent> events;
        for (const Dependency &d : pi.waits)
          if (isGpuStream(d.stream))
            events.push_back(I.doneEvents[d.instruction]);
        if (inst.op == exec::OpCode::Wait && inst.event) {
          int64_t recorder = I.prep.eventRecorder[*inst.event];
          if (recorder >= 0 && isGpuStream(plan.instructions[recorder].stream))
            events.push_back(I.planEvents[*inst.event]);
        }
        bool update = inst.op == exec::OpCode::HostAdamW;
        I.worker.enqueue(i, [&I, &hostUpdate, events, i, update] {
          if (I.workerFailed())
            return;
          for (CUevent ev : events)
            if (CUresult r = I.cu->cuEventSynchronize(ev)) {
              I.setWorkerError(
                  "instruction #" + std::to_string(i) + " ('" +
                  exec::opName(I.plan.instructions[i].op) +
                  "'): cuEventSynchronize: " + cuResultString(*I.cu, r));
              return;
            }
          if (update)
            hostUpdate(i);
        });
        continue;
      }

      // A GPU stream: cross-stream waits first.
      CUstream stream = I.streamOf(inst.stream);
      for (const Dependency &d : pi.waits) {
        if (isGpuStream(d.stream)) {
          if (auto e = I.check(
                  cu.cuStreamWaitEvent(stream, I.doneEvents[d.instruction], 0),
                  "cuStreamWaitEvent"))
            return e;
        } else {
          I.worker.waitFor(d.instruction);
        }
      }
      if (inst.op == exec::OpCode::Record) {
        if (auto e =
                I.check(cu.cuEventRecord(I.planEvents[*inst.event], stream),
                        "cuEventRecord"))
          return e;
        continue;
      }
      if (inst.op == exec::OpCode::Wait) {
        int64_t recorder = I.prep.eventRecorder[*inst.event];
        if (recorder >= 0 && !isGpuStream(plan.instructions[recorder].stream)) {
          I.worker.waitFor(recorder);
          continue;
        }
        if (auto e = I.check(
                cu.cuStreamWaitEvent(stream, I.planEvents[*inst.event], 0),
                "cuStreamWaitEvent"))
          return e;
        continue;
      }

      if (inst.op == exec::OpCode::Fetch) {
        // Cast by the staging thread, ahead of this one; a master updated
        // this step already is cast after its AdamW.
        int64_t k = fetchCount++;
        if (I.prep.fetchUpdate[k] >= 0) {
          I.worker.waitFor(I.prep.fetchUpdate[k]);
          I.stager.release(k);
        }
        uint8_t *stage = I.stager.staged(k);
        if (!stage) {
          std::string why = I.stager.error();
          return instError(i, inst,
                           why.empty() ? "weight staging stopped" : why);
        }
        const exec::Value &v = plan.values[inst.results[0]];
        if (trace)
          cu.cuEventRecord(I.startEvents[i], stream);
        if (auto e = I.check(
                cu.cuMemcpyHtoDAsync_v2(I.deviceAddress(inst.results[0]), stage,
                                        v.type.bytes(), stream),
                "cuMemcpyHtoDAsync (fetch " + inst.param + ")"))
          return e;
        if (auto e = I.check(cu.cuEventRecord(I.copyEvents[k], stream),
                             "cuEventRecord"))
          return e;
        I.stager.copyIssued(k);
      } else {
        if (trace)
          cu.cuEventRecord(I.startEvents[i], stream);
        if (inst.op == exec::OpCode::HostToDevice) {
          if (auto e = I.check(cu.cuMemcpyHtoDAsync_v2(
                                   I.deviceAddress(inst.results[0]),
                                   I.hostAddress(inst.operands[0]),
                                   plan.values[inst.results[0]].type.bytes(),
                                   stream),
                               "cuMemcpyHtoDAsync"))
            return instError(i, inst, llvm::toString(std::move(e)));
        } else if (inst.op == exec::OpCode::DeviceToHost) {
          if (auto e = I.check(cu.cuMemcpyDtoHAsync_v2(
                                   I.hostAddress(inst.results[0]),
                                   I.deviceAddress(inst.operands[0]),
                                   plan.values[inst.results[0]].type.bytes(),
                                   stream),
                               "cuMemcpyDtoHAsync"))
            return instError(i, inst, llvm::toString(std::move(e)));
        } else if (auto e =
                       I.issueCommands(i, Impl::streamIndex(inst.stream))) {
          return e;
        }
      }
      // MEGASLIDE_CUDA_SYNC=1: the copies too (issueCommands waits for
      // each command itself).
      if (I.syncEach && I.commands[i].empty())
        if (auto e = I.syncStream(Impl::streamIndex(inst.stream),
                                  "MEGASLIDE_CUDA_SYNC=1"))
          return instError(
              i, inst, "failed on the GPU: " + llvm::toString(std::move(e)));
      if (trace)
        cu.cuEventRecord(I.endEvents[i], stream);
      if (I.prep.needsDoneEvent[i])
        if (auto e = I.check(cu.cuEventRecord(I.doneEvents[i], stream),
                             "cuEventRecord"))
          return e;
      if (static_cast<int64_t>(i) == I.prep.lossDef) {
        int64_t lossId = I.prep.lossValue;
        const exec::Value &loss = plan.values[lossId];
        if (auto e = I.check(loss.home == Home::Device
                                 ? cu.cuMemcpyDtoHAsync_v2(
                                       I.lossStage, I.deviceAddress(lossId),
                                       loss.type.bytes(), stream)
                                 : CUDA_SUCCESS,
                             "cuMemcpyDtoHAsync (loss)"))
          return e;
        if (auto e = I.check(cu.cuEventRecord(I.lossEvent, stream),
                             "cuEventRecord (loss)"))
          return e;
      }
    }
    return llvm::Error::success();
  };

  llvm::Error issued = issueAll();
  if (issued)
    I.setWorkerError("cancelled"); // no queued update may apply (hostUpdate)
  // Every fetch the loop issued is staged; a loop that stopped early leaves
  // the staging thread waiting for copies that will not come.
  I.stager.stop();
  // Whatever happened, nothing may stay in flight past this call.
  I.worker.drain();
  I.stager.finish();
  llvm::Error synced = llvm::Error::success();
  for (int s = 0; s < 3; ++s) {
    llvm::Error e = I.syncStream(s, "the step failed on the GPU");
    if (!synced)
      synced = std::move(e);
    else
      llvm::consumeError(std::move(e));
  }
  if (issued) {
    llvm::consumeError(std::move(synced));
    return std::move(issued);
  }
  if (synced)
    return std::move(synced);
  {
    std::lock_guard<std::mutex> lock(I.errorMu);
    if (!I.workerError.empty())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "host stream: " + I.workerError);
  }

  exec::StepResult result;
  if (plan.outputs.empty())
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "the plan returns no loss");
  int64_t lossId = plan.outputs[0];
  const exec::Value &lossValue = plan.values[lossId];
  if (lossValue.home == Home::Device) {
    // Into pinned memory: a copy to pageable memory is synchronous.
    if (auto e = I.check(
            cu.cuMemcpyDtoHAsync_v2(I.lossStage, I.deviceAddress(lossId),
                                    lossValue.type.bytes(), compute),
            "cuMemcpyDtoHAsync (loss)"))
      return std::move(e);
    if (auto e = I.syncStream(0, "loss"))
      return std::move(e);
    cpu::widen(static_cast<const uint8_t *>(I.lossStage), lossValue.type.dtype,
               1, &result.loss);
  } else {
    cpu::widen(I.hostAddress(lossId), lossValue.type.dtype, 1, &result.loss);
  }
  if (skipped || (options.applyUpdates && I.prep.firstUpdate < 0 &&
                  !std::isfinite(result.loss))) {
    result.skipped = true;
  } else if (options.applyUpdates && !std::isfinite(result.loss)) {
    state.incomplete = true; // updated before the loss was known
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        llvm::formatv("step {0}: the loss is {1}, and this plan updates "
                      "parameters before it computes the loss, so the step "
                      "could not be skipped: the host state is incomplete",
                      optimizerStep, result.loss)
            .str());
  } else if (options.applyUpdates) {
    state.step = optimizerStep;
    state.incomplete = false;
    for (double norm : squaredNorms)
      result.gradSquaredNorm += norm;
  }

  if (trace) {
    for (size_t i = 0; i < n; ++i) {
      const exec::Instruction &inst = plan.instructions[i];
      if (inst.op == exec::OpCode::Record || inst.op == exec::OpCode::Wait)
        continue;
      exec::TraceSpan span;
      span.stream = inst.stream;
      span.name = exec::spanName(inst);
      span.instruction = i;
      span.layer = inst.layer;
      span.flops = inst.cost.matmulFlops + inst.cost.attentionFlops +
                   inst.cost.otherFlops;
      span.bytes = inst.cost.bytes;
      if (isGpuStream(inst.stream)) {
        float startMs = 0, durMs = 0;
        if (cu.cuEventElapsedTime(&startMs, I.baseEvent, I.startEvents[i]) !=
                CUDA_SUCCESS ||
            cu.cuEventElapsedTime(&durMs, I.startEvents[i], I.endEvents[i]) !=
                CUDA_SUCCESS)
          continue;
        span.start = startMs * 1e-3;
        span.seconds = durMs * 1e-3;
      } else {
        if (hostTimes[i].first < 0)
          continue;
        span.start = hostTimes[i].first;
        span.seconds = hostTimes[i].second;
      }
      result.spans.push_back(std::move(span));
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  result.memory.plannedArenaBytes = plan.arenaBytes;
  result.memory.plannedLiveBytes = plan.plannedLiveBytes;
  result.memory.measuredArenaBytes = I.prep.arenaHighWater;
  result.memory.measuredLiveBytes = I.prep.peakLiveBytes;
  return result;
}

} // namespace megaslide::cuda
