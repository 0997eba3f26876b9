//===- CudaStep.cpp - The cuda backend's step primitives ------------------===//
//
// exec::Device on the GPU: the step runner (plan/StepRunner.h) walks the
// plan and calls these in program order; they issue each instruction on
// its stream (derived cross-stream waits first), the host stream's work on
// the host worker after the GPU work it waits for, and fetches from the
// staging thread's bytes. Nothing here waits for the GPU except where an
// instruction depends on the host (HostWorker::waitFor) and at endStep.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackendImpl.h"

#include "llvm/ADT/Twine.h"
#include "llvm/Support/FormatVariadic.h"

#include <cstring>

namespace megaslide::cuda {

using exec::Home;

llvm::Expected<exec::StepResult>
CudaBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                  const exec::StepOptions &options) {
  llvm::Expected<exec::StepResult> result = runner->run(inputs, state, options);
  // A rank whose step failed has issued only some of the step's
  // collectives (or none): the others would wait for the rest for ever.
  // Nothing of the step is in flight any more (Device::endStep), so the
  // communicator can go: their collectives fail, or hang until their
  // watchdog ends the job; a job's rank does not step again after a
  // failure.
  if (!result && impl->collectives)
    impl->collectives->abort();
  return result;
}

llvm::Error CudaBackend::Impl::beginStep(exec::StepSetup setup) {
  if (auto e = check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent"))
    return e;
  trace = setup.trace;
  status = setup.status;
  std::vector<WeightStager::Job> jobs;
  fetchShards.clear();
  for (size_t k = 0; k < prep.fetches.size(); ++k) {
    const exec::Instruction &inst = plan.instructions[prep.fetches[k]];
    const exec::Value &v = plan.values[inst.results[0]];
    exec::FetchSource &f = setup.fetches[k];
    // What the runner gives must be what this device copies: all of the
    // master, or in a job's plan this rank's shard of it.
    int64_t count = v.type.numElements();
    dist::ShardRange want = copiedRange(inst);
    // A tensor held whole (a frozen buffer) gives the shard of itself.
    bool whole = f.begin == 0 && f.count == count;
    if (f.gather ||
        (!whole && (f.begin != want.begin || f.count != want.size())))
      return instError(prep.fetches[k], inst,
                       llvm::formatv("the host state holds elements [{0}, "
                                     "{1}) of '{2}', and this device copies "
                                     "[{3}, {4}) (rank {5} of {6})",
                                     f.begin, f.begin + f.count, inst.param,
                                     want.begin, want.end, jobRank, jobSize)
                           .str());
    fetchShards.push_back({want.begin, want.size()});
    jobs.push_back({f.master + (whole ? want.begin : 0), want.size(),
                    v.type.dtype, prep.fetchUpdate[k] >= 0,
                    std::move(f.before)});
  }
  if (auto e = syncStream(0, "step start", baseEvent))
    return e;
  stager.begin(std::move(jobs));
  worker.reset();
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::waitForOtherStreams(size_t i, CUstream stream) {
  for (const Dependency &d : prep.instructions[i].waits) {
    if (isGpuStream(d.stream)) {
      if (auto e =
              check(cu->cuStreamWaitEvent(stream, doneEvents[d.instruction], 0),
                    "cuStreamWaitEvent"))
        return e;
    } else {
      worker.waitFor(d.instruction);
    }
  }
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::startOnStream(size_t i, CUstream stream) {
  if (auto e = waitForOtherStreams(i, stream))
    return e;
  if (trace)
    cu->cuEventRecord(startEvents[i], stream);
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::finishOnStream(size_t i, CUstream stream) {
  const exec::Instruction &inst = plan.instructions[i];
  // MEGASLIDE_CUDA_SYNC=1: the copies too (issueCommands waits for each
  // command itself).
  if (syncEach && commands[i].empty())
    if (auto e = syncStream(streamIndex(inst.stream), "MEGASLIDE_CUDA_SYNC=1"))
      return instError(i, inst,
                       "failed on the GPU: " + llvm::toString(std::move(e)));
  if (trace)
    cu->cuEventRecord(endEvents[i], stream);
  if (prep.needsDoneEvent[i])
    if (auto e =
            check(cu->cuEventRecord(doneEvents[i], stream), "cuEventRecord"))
      return e;
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::enqueueHost(size_t i,
                                           std::function<void()> work) {
  // The host stream: everything on the worker, in order, each task after
  // the GPU work it waits for (derived waits, a plan wait).
  const exec::Instruction &inst = plan.instructions[i];
  std::vector<CUevent> events;
  for (const Dependency &d : prep.instructions[i].waits)
    if (isGpuStream(d.stream))
      events.push_back(doneEvents[d.instruction]);
  if (inst.op == exec::OpCode::Wait && inst.event) {
    int64_t recorder = prep.eventRecorder[*inst.event];
    if (recorder >= 0 && isGpuStream(plan.instructions[recorder].stream))
      events.push_back(planEvents[*inst.event]);
  }
  worker.enqueue(i, [this, events, i, work = std::move(work)] {
    if (status->failed())
      return;
    for (CUevent ev : events)
      if (CUresult r = cu->cuEventSynchronize(ev)) {
        status->fail("host stream: instruction #" + std::to_string(i) + " ('" +
                     exec::opName(plan.instructions[i].op) +
                     "'): cuEventSynchronize: " + cuResultString(*cu, r));
        return;
      }
    if (work)
      work();
  });
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::fetch(size_t i, size_t k) {
  const exec::Instruction &inst = plan.instructions[i];
  CUstream stream = streamOf(inst.stream);
  if (auto e = waitForOtherStreams(i, stream))
    return e;
  // Cast by the staging thread, ahead of this one; a master updated this
  // step already is cast after its AdamW.
  if (prep.fetchUpdate[k] >= 0) {
    worker.waitFor(prep.fetchUpdate[k]);
    stager.release(k);
  }
  uint8_t *stage = stager.staged(k);
  if (!stage) {
    std::string why = stager.error();
    return instError(i, inst, why.empty() ? "weight staging stopped" : why);
  }
  const exec::Value &v = plan.values[inst.results[0]];
  if (trace)
    cu->cuEventRecord(startEvents[i], stream);
  // The whole master, or this rank's shard at its place.
  size_t bytes = exec::dtypeBytes(v.type.dtype);
  auto [begin, count] = fetchShards[k];
  if (auto e = check(cu->cuMemcpyHtoDAsync_v2(deviceAddress(inst.results[0]) +
                                                  begin * bytes,
                                              stage, count * bytes, stream),
                     "cuMemcpyHtoDAsync (fetch " + inst.param + ")"))
    return e;
  if (auto e = check(cu->cuEventRecord(copyEvents[k], stream), "cuEventRecord"))
    return e;
  stager.copyIssued(k);
  return finishOnStream(i, stream);
}

llvm::Error CudaBackend::Impl::copy(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  CUstream stream = streamOf(inst.stream);
  if (auto e = startOnStream(i, stream))
    return e;
  const exec::TensorType &type = plan.values[inst.results[0]].type;
  if (inst.op == exec::OpCode::HostToDevice) {
    if (auto e = check(cu->cuMemcpyHtoDAsync_v2(deviceAddress(inst.results[0]),
                                                hostAddress(inst.operands[0]),
                                                type.bytes(), stream),
                       "cuMemcpyHtoDAsync"))
      return instError(i, inst, llvm::toString(std::move(e)));
  } else {
    // A gradient's reduce-scattered shard: only it crosses PCIe, to the
    // start of its host value (exec::hostValueBytes).
    dist::ShardRange r = copiedRange(inst);
    size_t element = exec::dtypeBytes(type.dtype);
    if (auto e = check(cu->cuMemcpyDtoHAsync_v2(
                           hostAddress(inst.results[0]),
                           deviceAddress(inst.operands[0]) + r.begin * element,
                           r.size() * element, stream),
                       "cuMemcpyDtoHAsync"))
      return instError(i, inst, llvm::toString(std::move(e)));
  }
  return finishOnStream(i, stream);
}

llvm::Error CudaBackend::Impl::collective(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  CUstream stream = streamOf(inst.stream);
  if (auto e = startOnStream(i, stream))
    return e;
  const exec::TensorType &type = plan.values[inst.operands[0]].type;
  CUdeviceptr data = deviceAddress(inst.operands[0]);
  llvm::Error e = inst.op == exec::OpCode::AllGather
                      ? collectives->allGatherShards(data, type.numElements(),
                                                     type.dtype, stream)
                      : collectives->reduceScatterShards(
                            data, type.numElements(), type.dtype, stream);
  if (e)
    return instError(i, inst, llvm::toString(std::move(e)));
  return finishOnStream(i, stream);
}

llvm::Error CudaBackend::Impl::launch(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  CUstream stream = streamOf(inst.stream);
  if (auto e = startOnStream(i, stream))
    return e;
  if (auto e = issueCommands(i, streamIndex(inst.stream)))
    return e;
  return finishOnStream(i, stream);
}

llvm::Error CudaBackend::Impl::record(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  if (!isGpuStream(inst.stream))
    return enqueueHost(i, nullptr);
  CUstream stream = streamOf(inst.stream);
  if (auto e = waitForOtherStreams(i, stream))
    return e;
  return check(cu->cuEventRecord(planEvents[*inst.event], stream),
               "cuEventRecord");
}

llvm::Error CudaBackend::Impl::wait(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  if (!isGpuStream(inst.stream))
    return enqueueHost(i, nullptr);
  CUstream stream = streamOf(inst.stream);
  if (auto e = waitForOtherStreams(i, stream))
    return e;
  int64_t recorder = prep.eventRecorder[*inst.event];
  if (recorder >= 0 && !isGpuStream(plan.instructions[recorder].stream)) {
    worker.waitFor(recorder);
    return llvm::Error::success();
  }
  return check(cu->cuStreamWaitEvent(stream, planEvents[*inst.event], 0),
               "cuStreamWaitEvent");
}

llvm::Error CudaBackend::Impl::runOnHost(size_t i, std::function<void()> work) {
  return enqueueHost(i, std::move(work));
}

llvm::Error CudaBackend::Impl::captureValue(int64_t id, exec::Stream s) {
  // Into pinned memory as soon as it exists: the first update reads it.
  CUstream stream = streamOf(s);
  const exec::Value &v = plan.values[id];
  if (auto e = check(v.home == Home::Device ? cu->cuMemcpyDtoHAsync_v2(
                                                  lossStage, deviceAddress(id),
                                                  v.type.bytes(), stream)
                                            : CUDA_SUCCESS,
                     "cuMemcpyDtoHAsync (loss)"))
    return e;
  return check(cu->cuEventRecord(lossEvent, stream), "cuEventRecord (loss)");
}

llvm::Error CudaBackend::Impl::awaitValue(int64_t id, void *dst) {
  if (CUresult r = cu->cuEventSynchronize(lossEvent))
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "cuEventSynchronize (loss): " +
                                       cuResultString(*cu, r));
  const exec::Value &v = plan.values[id];
  std::memcpy(dst,
              v.home == Home::Device ? static_cast<const uint8_t *>(lossStage)
                                     : hostAddress(id),
              v.type.bytes());
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::endStep() {
  // Every fetch the walk issued is staged; a walk that stopped early
  // leaves the staging thread waiting for copies that will not come.
  stager.stop();
  worker.drain();
  stager.finish();
  llvm::Error synced = llvm::Error::success();
  for (int s = 0; s < kStreams; ++s) {
    llvm::Error e = syncStream(s, "the step failed on the GPU");
    if (!synced)
      synced = std::move(e);
    else
      llvm::consumeError(std::move(e));
  }
  // The comm stream waited for every collective: none is pending now.
  if (collectives && !synced)
    collectives->settled();
  return synced;
}

llvm::Error CudaBackend::Impl::readValue(int64_t id, void *dst) {
  const exec::Value &v = plan.values[id];
  if (v.home != Home::Device) {
    std::memcpy(dst, hostAddress(id), v.type.bytes());
    return llvm::Error::success();
  }
  // Into pinned memory: a copy to pageable memory is synchronous.
  if (auto e = check(cu->cuMemcpyDtoHAsync_v2(lossStage, deviceAddress(id),
                                              v.type.bytes(), streams[0]),
                     "cuMemcpyDtoHAsync (loss)"))
    return e;
  if (auto e = syncStream(0, "loss"))
    return e;
  std::memcpy(dst, lossStage, v.type.bytes());
  return llvm::Error::success();
}

std::optional<std::pair<double, double>> CudaBackend::Impl::timeOf(size_t i) {
  float startMs = 0, durMs = 0;
  if (cu->cuEventElapsedTime(&startMs, baseEvent, startEvents[i]) !=
          CUDA_SUCCESS ||
      cu->cuEventElapsedTime(&durMs, startEvents[i], endEvents[i]) !=
          CUDA_SUCCESS)
    return std::nullopt;
  return std::pair<double, double>(startMs * 1e-3, durMs * 1e-3);
}

void CudaBackend::Impl::measureMemory(exec::MemoryStats &stats) {
  stats.measuredArenaBytes = prep.arenaHighWater;
  stats.measuredLiveBytes = prep.peakLiveBytes;
}

} // namespace megaslide::cuda
