//===- HostDevice.cpp - Device primitives over host memory ----------------===//

#include "megaslide/runtime/cpu/HostDevice.h"

#include "megaslide/runtime/cpu/Convert.h"

#include "llvm/ADT/Twine.h"

#include <cstring>

using namespace megaslide;
using namespace megaslide::cpu;

llvm::Expected<std::vector<GraphKernel>>
cpu::bindGraphKernels(const exec::ExecPlan &plan) {
  std::vector<GraphKernel> kernels;
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
    kernels.push_back(kernel);
  }
  return kernels;
}

HostDevice::HostDevice(const exec::ExecPlan &plan,
                       std::vector<GraphKernel> kernels)
    : plan(plan), kernels(std::move(kernels)) {}

llvm::Error HostDevice::beginStep(exec::StepSetup setup) {
  fetches = std::move(setup.fetches);
  resetMemory();
  return llvm::Error::success();
}

llvm::Error HostDevice::fetch(size_t i, size_t k) {
  const exec::FetchSource &source = fetches[k];
  if (source.before)
    source.before();
  int64_t id = plan.instructions[i].results[0];
  if (source.gather)
    return source.gather(bytesOf(id));
  const exec::TensorType &type = plan.values[id].type;
  narrow(source.master, type.dtype, type.numElements(), bytesOf(id));
  return llvm::Error::success();
}

llvm::Error HostDevice::copy(size_t i) {
  const exec::Instruction &inst = plan.instructions[i];
  std::memcpy(bytesOf(inst.results[0]), bytesOf(inst.operands[0]),
              plan.values[inst.results[0]].type.bytes());
  return llvm::Error::success();
}

llvm::Error HostDevice::launch(size_t i) {
  GraphKernel kernel = kernels[i];
  if (!kernel)
    return llvm::Error::success(); // a reshape's result views its operand
  if (llvm::Error err = runGraphKernel(
          kernel, plan, plan.instructions[i],
          [this](int64_t id) { return bytesOf(id); }, wide))
    return llvm::createStringError("instruction #" + llvm::Twine(i) + ": " +
                                   llvm::toString(std::move(err)));
  return llvm::Error::success();
}

llvm::Error HostDevice::runOnHost(size_t, std::function<void()> work) {
  work();
  return llvm::Error::success();
}

llvm::Error HostDevice::captureValue(int64_t id, exec::Stream) {
  const uint8_t *bytes = bytesOf(id);
  captured.assign(bytes, bytes + plan.values[id].type.bytes());
  return llvm::Error::success();
}

llvm::Error HostDevice::awaitValue(int64_t, void *dst) {
  std::memcpy(dst, captured.data(), captured.size());
  return llvm::Error::success();
}

llvm::Error HostDevice::readValue(int64_t id, void *dst) {
  std::memcpy(dst, bytesOf(id), plan.values[id].type.bytes());
  return llvm::Error::success();
}
