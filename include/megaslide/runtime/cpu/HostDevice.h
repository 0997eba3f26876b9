//===- HostDevice.h - Device primitives over host memory --------*- C++ -*-===//
//
// The primitives of a device whose values all live in host memory and
// whose every primitive is done when it returns (exec::Device): a fetch's
// cast, the copies, the graph ops on the cpu kernels (GraphKernels.h),
// events and host work in place, the captured loss and values read back.
// Such devices differ only in where a value's bytes are, so a subclass
// binds them (allocate, release, bytesOf) and measures them: the cpu
// backend places every value in its tracking arena at its planned offset
// (CpuBackend.cpp); the step runner's conformance test gives each value a
// buffer of its own (test/unit/runtime/plan/StepRunnerTest.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_HOSTDEVICE_H
#define MEGASLIDE_RUNTIME_CPU_HOSTDEVICE_H

#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/plan/StepRunner.h"

#include <cstdint>
#include <vector>

namespace megaslide::cpu {

/// The cpu kernel of each instruction of `plan`, null for schedule ops and
/// reshapes (a reshape's result views its operand's bytes); an error
/// naming the op when one has no cpu kernel.
llvm::Expected<std::vector<GraphKernel>>
bindGraphKernels(const exec::ExecPlan &plan);

class HostDevice : public exec::Device {
public:
  /// `kernels`: bindGraphKernels(plan).
  HostDevice(const exec::ExecPlan &plan, std::vector<GraphKernel> kernels);

  bool synchronous() const final { return true; }
  /// Keeps the step's fetches and calls resetMemory().
  llvm::Error beginStep(exec::StepSetup setup) final;
  llvm::Error fetch(size_t i, size_t k) final;
  llvm::Error copy(size_t i) final;
  llvm::Error launch(size_t i) final;
  llvm::Error record(size_t) final { return llvm::Error::success(); }
  llvm::Error wait(size_t) final { return llvm::Error::success(); }
  llvm::Error runOnHost(size_t, std::function<void()> work) final;
  llvm::Error captureValue(int64_t id, exec::Stream) final;
  llvm::Error awaitValue(int64_t, void *dst) final;
  llvm::Error endStep() final { return llvm::Error::success(); }
  llvm::Error readValue(int64_t id, void *dst) final;

protected:
  /// A step begins: no device value is live.
  virtual void resetMemory() = 0;
  /// The bytes of value `id` (live, or home Input or Host).
  virtual uint8_t *bytesOf(int64_t id) = 0;

  const exec::ExecPlan &plan;

private:
  std::vector<GraphKernel> kernels; ///< per instruction
  std::vector<exec::FetchSource> fetches;
  std::vector<uint8_t> captured;
  std::vector<std::vector<float>> wide; ///< graph ops' fp32 operands
};

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_HOSTDEVICE_H
