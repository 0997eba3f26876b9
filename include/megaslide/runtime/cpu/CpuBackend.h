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

#include <memory>

namespace megaslide::cpu {

class CpuBackend : public exec::Backend {
public:
  /// Fails, naming the op, when the plan uses an op without a cpu kernel.
  static llvm::Expected<std::unique_ptr<CpuBackend>>
  create(const exec::ExecPlan &plan);

  const char *name() const override { return "cpu"; }
  llvm::Expected<exec::StepResult> step(const exec::StepInputs &inputs,
                                        host::HostState &state,
                                        const exec::StepOptions &options) override;

private:
  explicit CpuBackend(const exec::ExecPlan &plan);
  const exec::ExecPlan &plan;
  exec::Liveness liveness;
  /// Instructions after which each value's bytes are released.
  std::vector<std::vector<int64_t>> releasedAfter;
  /// Per instruction; null for schedule ops and views.
  std::vector<GraphKernel> kernels;
  /// The device arena and the host values' bytes, kept from step to step.
  std::vector<uint8_t> arenaStorage;
  std::vector<std::vector<uint8_t>> hostStorage;
};

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_CPUBACKEND_H
