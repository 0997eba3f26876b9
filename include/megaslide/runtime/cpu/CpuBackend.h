//===- CpuBackend.h - The reference backend ---------------------*- C++ -*-===//
//
// Executes a plan's numerics on the host, in program order: every device
// tensor lives in a byte arena at exactly its planned offset and in its
// planned dtype, and a tracking allocator checks each allocation against
// the live ones and measures the arena's high-water mark and the live
// bytes, so planned and measured device peaks can be compared byte for
// byte. Deterministic: the same inputs and state give the same bits.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_CPUBACKEND_H
#define MEGASLIDE_RUNTIME_CPU_CPUBACKEND_H

#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/plan/Liveness.h"
#include "megaslide/runtime/plan/StepRunner.h"

#include <memory>

namespace megaslide::cpu {

class CpuBackend : public exec::Backend {
public:
  /// Fails, naming the op, when the plan uses an op without a cpu kernel.
  static llvm::Expected<std::unique_ptr<CpuBackend>>
  create(const exec::ExecPlan &plan);
  ~CpuBackend() override;

  const char *name() const override { return "cpu"; }
  /// The step runner's semantics (plan/StepRunner.h) over the cpu
  /// backend's primitives, each done before it returns.
  llvm::Expected<exec::StepResult>
  step(const exec::StepInputs &inputs, host::HostState &state,
       const exec::StepOptions &options) override;

private:
  CpuBackend() = default;
  std::unique_ptr<exec::Device> device;
  std::unique_ptr<exec::StepRunner> runner;
};

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_CPUBACKEND_H
