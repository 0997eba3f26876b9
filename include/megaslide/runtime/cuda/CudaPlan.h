//===- CudaPlan.h - GPU-free preparation of a plan for the GPU --*- C++ -*-===//
//
// Everything the cuda backend decides before it touches a GPU, so that it
// can be tested without one: each graph op lowered (GraphOpLowering.h), the
// 3D-DSA ops matched to the plan's generated modules, the pinned pools laid
// out (HostPool.cpp) and the cross-stream waits derived.
//
// The plan's events order producers before consumers (read after write).
// Reuse of arena and host-pool bytes across streams (write after read or
// write) is not in the plan: prepareCudaPlan derives those waits from
// program order, so the copy streams may run ahead of compute exactly as
// far as the memory plan allows.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CUDA_CUDAPLAN_H
#define MEGASLIDE_RUNTIME_CUDA_CUDAPLAN_H

#include "megaslide/runtime/cuda/CudaOptions.h"
#include "megaslide/runtime/cuda/GraphOpLowering.h"
#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/HostPool.h"
#include "megaslide/runtime/plan/Liveness.h"
#include "megaslide/runtime/plan/StepRunner.h"

#include "llvm/ADT/Twine.h"

#include <array>
#include <map>
#include <optional>

namespace megaslide::cuda {

/// Launch shape of one kernel of a generated 3D-DSA module (from its
/// manifest; grids for batch 1).
struct DsaKernelSpec {
  std::string name;
  std::array<int64_t, 3> grid{};
  int threads = 0;
  int64_t dynamicSharedBytes = 0;
};

/// One of the plan's kernel modules with its configuration.
struct DsaModuleSpec {
  std::string name;
  std::array<int64_t, 3> grid{}, window{}, tile{};
  int64_t heads = 0, headDim = 0, radius = 0;
  std::string elementType;
  /// forward, backward, backward_keys, offsets.
  std::map<std::string, DsaKernelSpec, std::less<>> kernels;
};

/// Parses a module's manifest (writeDsaManifest's JSON, one configuration).
llvm::Expected<DsaModuleSpec> parseDsaManifest(const exec::KernelModule &m);

using exec::Dependency;
using exec::deviceOffset;

struct PreparedInstruction {
  /// Graph ops with a dense lowering.
  std::optional<LoweredOp> lowered;
  /// dsa3d, dsa3d_grad, dsa3d_offsets: the module (index into dsaModules).
  int64_t dsaModule = -1;
  /// dsa3d_grad: arena offset of the fp32 row sums Delta = rowsum(dO * O)
  /// [B, H, N] that the backward writes and the dK/dV kernel reads, or -1
  /// when the plan's workspace is too small (then the backend's own
  /// scratch).
  int64_t deltaOffset = -1;
  /// Write-after-read/write waits on other streams (filtered: none implied
  /// by an earlier wait of the same stream).
  std::vector<Dependency> waits;
  /// The stream that recorded a plan event (record instructions).
  std::optional<exec::Stream> recordedOn;
};

struct PreparedPlan {
  std::vector<PreparedInstruction> instructions;
  std::vector<DsaModuleSpec> dsaModules;
  /// Distinct dense kernels the plan launches, and their CUDA C++.
  std::vector<KernelInstance> kernels;
  std::string elementwiseSource;
  /// Device bytes beside the arena: the largest op scratch, and the
  /// 3D-DSA accumulators when the plan gives no workspace for them.
  int64_t scratchBytes = 0, dsaFallbackBytes = 0;
  /// Pinned pools: step inputs and host values, offsets per value (-1 for
  /// device values).
  std::vector<int64_t> hostOffset;
  int64_t inputPoolBytes = 0, hostPoolBytes = 0;
  /// The fetches in program order, the host_adamw that updates each one's
  /// master earlier in the step (-1: none), and the pinned ring they are
  /// cast into (weightStagingBytes).
  std::vector<int64_t> fetches, fetchUpdate;
  int64_t stagingBytes = 0;
  /// Host values share bytes (exec::HostPoolLayout): gradients through a
  /// ring of `gradientRingSlots` slots of `gradientRingSlotBytes`.
  bool hostPoolShared = false;
  int64_t gradientRingSlots = 0, gradientRingSlotBytes = 0;
  /// Instructions whose completion another stream waits for.
  std::vector<bool> needsDoneEvent;
  /// Per plan event: the instruction recording it (-1: none).
  std::vector<int64_t> eventRecorder;
  /// The step runner's loss guard (exec::lossGuard): the loss where it is
  /// computed, the instruction defining it (-1: no guard) and the first
  /// host_adamw; the loss is copied to the host as soon as it exists.
  int64_t lossValue = -1, lossDef = -1, firstUpdate = -1;
  /// Measured like the cpu backend: arena high-water mark, live peak.
  int64_t arenaHighWater = 0, peakLiveBytes = 0;
};

/// Lowers every graph op, matches the 3D-DSA ops to the plan's modules,
/// lays out the pinned pools and derives the cross-stream waits. Errors
/// name the instruction (an op without a cuda lowering, a 3D-DSA
/// configuration without a module, a graph op reading a host value).
llvm::Expected<PreparedPlan> prepareCudaPlan(const exec::ExecPlan &plan,
                                             const CudaOptions &options = {});

/// Lays out the pinned pools of `prep` (hostOffset, the pool sizes,
/// hostPoolShared) from the plan's values and their liveness.
void layoutHostPools(const exec::ExecPlan &plan, const exec::Liveness &live,
                     const CudaOptions &options, PreparedPlan &prep);

/// The pinned ring the fetches of `plan` are cast into (cuda/Staging.h):
/// room for the fetches of two blocks (a block: one layer's fetches before
/// or after the loss, as the planner sizes its "pinned staging"), at least
/// two of the largest fetch, each fetch (its exec::copiedBytes: a job's
/// shard) rounded up to 4 KiB;
/// `override` > 0 replaces it, raised to the largest fetch.
int64_t weightStagingBytes(const exec::ExecPlan &plan, int64_t override = 0);

using exec::isGpuStream;

using exec::instError;

} // namespace megaslide::cuda

#endif // MEGASLIDE_RUNTIME_CUDA_CUDAPLAN_H
