//===- HardwareModel.h - Hardware and instruction time ----------*- C++ -*-===//
//
// A hardware description (JSON, docs/CostModel.md) with a built-in default
// for one H200 SXM on PCIe Gen5 x16 and a 1.5 TB host, and the one formula
// that times an instruction on it: a roofline per kernel family for device
// ops, bandwidth for transfers, parameter throughput for the host
// optimizer. The planner
// (lib/Analysis/CostModel.cpp, from the IR) and the sim backend (from an
// execution plan) both call secondsFor, so they predict the same step.
// No MLIR.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SIM_HARDWAREMODEL_H
#define MEGASLIDE_RUNTIME_SIM_HARDWAREMODEL_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/JSON.h"

#include <cstdint>
#include <optional>
#include <string>

namespace megaslide::sim {

struct HardwareModel {
  std::string name =
      "1x NVIDIA H200 SXM 141 GB, PCIe Gen5 x16, 1.5 TB host (built-in)";
  double bf16DenseFlops = 989e12; ///< tensor-core peak, FLOP/s
  double f32DenseFlops = 67e12;   ///< fp32 peak on CUDA cores (no TF32)
  /// Fractions of the dense peak reached by each compute-bound kernel
  /// family (KernelFamily; docs/CostModel.md derives them; the attention
  /// and DSA figures are estimates until measured).
  double gemmEfficiency = 0.70;         ///< cuBLASLt matmul
  double attentionFwdEfficiency = 0.30; ///< dense attention forward
  double attentionBwdEfficiency = 0.15; ///< dense attention dQ + dK/dV
  double dsa3dFwdEfficiency = 0.30;     ///< 3D-DSA forward
  double dsa3dBwdEfficiency = 0.16;     ///< 3D-DSA backward
  double vectorFlops = 60e12;           ///< CUDA-core rate, elementwise work
  double hbmBandwidth = 4.8e12;         ///< B/s
  /// Fraction of hbm_bandwidth the compute-bound families' bytes move at.
  double hbmEfficiency = 0.80;
  /// Fractions of hbm_bandwidth the memory-bound families reach: the
  /// grid-stride kernels with 2-byte scalar loads, and the DSA offsets.
  double elementwiseHbmEfficiency = 0.40;
  double dsa3dOffsetsHbmEfficiency = 0.04;
  double h2dBandwidth = 53e9;             ///< pinned host -> device, B/s
  double d2hBandwidth = 50e9;             ///< device -> pinned host, B/s
  double transferLatency = 10e-6;         ///< s per copy
  double launchLatency = 4e-6;            ///< s per kernel
  double hostMemoryBandwidth = 350e9;     ///< B/s, all sockets (staging casts)
  double hostAdamWParamsPerSecond = 12e9; ///< fused AdamW, params/s
  /// The links of a job of several GPUs, per GPU and per direction
  /// (docs/CostModel.md gives the sources): NVLink 4 within a node (18
  /// links of 25 GB/s), one 400 Gb/s NIC per GPU between nodes.
  double nvlinkBandwidth = 450e9; ///< B/s per direction per GPU
  double nvlinkLatency = 3e-6;    ///< s per ring step (estimate)
  double networkBandwidth = 50e9; ///< B/s per direction per GPU
  double networkLatency = 6e-6;   ///< s per ring step (estimate)
  /// One NVMe drive of the host's tier, sequential, B/s (docs/CostModel.md
  /// gives the datasheet; benchmarks/ measures a drive's own).
  double nvmeReadBandwidth = 14e9;
  double nvmeWriteBandwidth = 10e9;
  // The drives a tier stripes over are the plan's (host_tier.drives).
};

/// Parses a hardware description; absent fields keep the built-in
/// defaults, unknown fields are errors naming the field, and so is a value
/// outside the field's range (FLOP/s in [1e6, 1e18], B/s in [1e6, 1e15],
/// params/s in [1e3, 1e15], efficiencies in [0.001, 1], latencies in
/// (0, 1] s; docs/CostModel.md), which keeps every figure secondsFor and
/// the replay derive from any valid plan finite. `source` names the
/// description in errors and is its `name` unless the JSON gives one.
llvm::Expected<HardwareModel> parseHardwareModel(llvm::StringRef json,
                                                 llvm::StringRef source);
llvm::Expected<HardwareModel> loadHardwareModel(llvm::StringRef path);
/// Every field, in the order of the file format; without `links` the
/// fields of the links between GPUs are left out (a one-GPU plan's report,
/// which does not use them), without `nvme` the NVMe tier's (a plan
/// without one).
llvm::json::Value toJson(const HardwareModel &hw, bool links = true,
                         bool nvme = true);

/// Seconds of a ring all-gather or reduce-scatter of a tensor of `bytes`
/// (the whole tensor) over `ranks` ranks on `nodes` nodes:
///   (ranks - 1) * (latency + bytes / (ranks * bandwidth))
/// with nvlink_latency and nvlink_bandwidth within one node, and over
/// several nodes network_latency and min(nvlink_bandwidth,
/// network_bandwidth) (the ring crosses the network; an estimate: NCCL's
/// hierarchical algorithms can do better). 0 for one rank.
double ringCollectiveSeconds(double bytes, int64_t ranks, int64_t nodes,
                             const HardwareModel &hw);
/// What one rank of `plan`'s job has of `hw`: a node's host memory
/// bandwidth and host AdamW throughput are shared by its ranks (the job's
/// ranks / nodes, from its collectives), which all update and stage at
/// once; `hw` itself for a one-GPU plan.
HardwareModel rankShare(const exec::ExecPlan &plan, HardwareModel hw);

/// Seconds of the all-reduce of a few scalars (the global gradient norm,
/// the non-finite flag) over the job: 2 (ranks - 1) latencies.
double allReduceScalarSeconds(int64_t ranks, int64_t nodes,
                              const HardwareModel &hw);

/// Which formula times an instruction.
enum class CostKind : uint8_t {
  None,         ///< no work: views (reshape), events
  Fetch,        ///< staging cast on the host pipelined with the h2d copy
  HostToDevice, ///< PCIe copy to the device
  DeviceToHost, ///< PCIe copy to the host
  HostAdamW,    ///< host optimizer
  Device,       ///< a kernel: roofline of FLOPs and HBM bytes
  Collective,   ///< a ring all-gather or reduce-scatter over the job's GPUs
};

/// The kind of an execution-plan op, as plan/Ops.def declares it: the
/// transfers and the host optimizer by their formula; reshape, record and
/// wait do no work; every other op is a device kernel.
CostKind costKindOf(exec::OpCode op);

/// The kernels the cuda backend launches for a device op (Ops.def's fourth
/// column), each with its own efficiency in the hardware description.
enum class KernelFamily : uint8_t {
  None,         ///< no kernel: views, transfers, host work, events
  Gemm,         ///< cuBLASLt matmul (linear, patch embedding)
  AttentionFwd, ///< dense attention forward
  AttentionBwd, ///< dense attention backward (dQ and dK/dV kernels)
  Dsa3dFwd,     ///< 3D dilated sparse attention forward
  Dsa3dBwd,     ///< 3D-DSA backward
  Dsa3dOffsets, ///< 3D-DSA neighbour offsets (memory-bound)
  Elementwise,  ///< grid-stride elementwise and reduction kernels
};
inline constexpr int kNumKernelFamilies =
    static_cast<int>(KernelFamily::Elementwise) + 1;

/// The family of an op, as plan/Ops.def declares it.
KernelFamily kernelFamilyOf(exec::OpCode op);
/// The family's name in reports, traces and calibration ("gemm",
/// "attention_fwd", ..., "elementwise"; "none").
const char *kernelFamilyName(KernelFamily family);
/// The family named `name`, if any.
std::optional<KernelFamily> parseKernelFamily(llvm::StringRef name);
/// Whether the family's time is bound by FLOPs on the tensor cores (its
/// efficiency is a fraction of the dense peak) rather than by HBM bytes.
bool isComputeBound(KernelFamily family);
/// The family's efficiency in `hw`: of the dense peak for a compute-bound
/// family, of hbm_bandwidth for a memory-bound one.
double efficiencyOf(const HardwareModel &hw, KernelFamily family);
/// The member holding it, for the calibration to write (nullptr for None).
double HardwareModel::*efficiencyMember(KernelFamily family);

/// FLOPs per parameter the host AdamW reports (in CostInputs::otherFlops);
/// its time is the parameter count at host_adamw_params_per_second.
inline constexpr uint64_t kHostAdamWFlopsPerParam = 14;
/// Host memory traffic of the host AdamW per parameter: it reads the fp32
/// master and both moments (12 B) and the bf16 gradient (2 B) and writes
/// the master and the moments (12 B). A host_adamw whose moments are kept
/// in fewer bytes (int8-moments, factored-moments) carries the bytes it
/// moves in CostInputs::bytes instead. The replay shares
/// host_memory_bandwidth between it and the fetches' staging casts.
inline constexpr uint64_t kHostAdamWBytesPerParam = 26;

/// Host memory bytes an instruction of `kind` moves (a fetch's staging
/// cast, the host AdamW's reads and writes; 0 for every other kind).
double hostMemoryBytes(CostKind kind, const exec::CostInputs &in);

/// Seconds an instruction of `kind` and `family` with `in` takes on `hw`
/// when it has the host to itself; `resultType` is the element type of
/// its first result (an fp32 op runs its matmul and attention FLOPs on
/// CUDA cores, at f32_dense_flops, any other at bf16_dense_flops):
///   Fetch        transfer_latency + max(bytes / h2d, (sourceBytes + bytes)
///                / host_memory_bandwidth)
///   HostToDevice transfer_latency + bytes / h2d
///   DeviceToHost transfer_latency + bytes / d2h
///   HostAdamW    max(params / params_per_second, hostMemoryBytes /
///                host_memory_bandwidth), params = otherFlops /
///                kHostAdamWFlopsPerParam
///   Collective   ringCollectiveSeconds(bytes, ranks, nodes)
///   Device       launch_latency + max(matmul / (dense * gemm_eff) +
///                attention / (dense * family_eff) + other / vector,
///                bytes / (hbm * hbm_eff(family)))
///   None         0
/// A compute-bound family's attention FLOPs run at its own efficiency
/// (a memory-bound family's at vector_flops) and its bytes at
/// hbm_efficiency; a memory-bound family's bytes run at its own.
/// `instructions` (elementwiseInstructions), when not 0, replace an
/// elementwise op's `other / vector` by instructions / (vector / 2): one
/// thread instruction per FP32 lane per clock, an FMA being 2 FLOPs.
double secondsFor(CostKind kind, KernelFamily family,
                  const exec::CostInputs &in, const HardwareModel &hw,
                  exec::DType resultType = exec::DType::BF16,
                  double instructions = 0);

/// A dense cuda kernel's PTX instructions per element of its main loop
/// (thread instructions; the 16-byte loops' count over their 8 elements),
/// read off the sm_90a PTX of its bf16 instance and held to it by
/// test/unit/runtime/cuda/ElementwiseCodegenTest.cpp.
struct KernelInstructions {
  const char *kernel; ///< its kind in runtime/cuda/ElementwiseKernelsSource.inc
  double perElement;
};
/// The kernels with a stated count.
llvm::ArrayRef<KernelInstructions> elementwiseKernelInstructions();

/// Thread instructions of elementwise-family instruction `inst`: its
/// kernel's perElement times the elements of its largest tensor (per pair
/// for rope3d); 0 for an op without a stated count (norms and the
/// reductions; secondsFor then times its FLOPs at vector_flops).
double elementwiseInstructions(const exec::ExecPlan &plan,
                               const exec::Instruction &inst);

/// secondsFor an instruction of `plan`, except that a deferred
/// host_adamw (exec::kDeferredAttr) retains its gradient rather than
/// updating: a host copy, retainedBytes at host_memory_bandwidth (its
/// squared norm and finite flag ride along). Its update is timed as a
/// host_adamw, before the fetch that applies it (buildTasks).
double secondsFor(const exec::ExecPlan &plan, const exec::Instruction &inst,
                  const HardwareModel &hw);
/// hostMemoryBytes of an instruction of `plan`: retainedBytes for a
/// deferred host_adamw.
double hostMemoryBytes(const exec::ExecPlan &plan,
                       const exec::Instruction &inst);
/// Host bytes a deferred host_adamw moves: its gradient read and the
/// retained copy written (in a job, its rank's shard: the parameters its
/// cost inputs count).
double retainedBytes(const exec::ExecPlan &plan, const exec::Instruction &inst);

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_HARDWAREMODEL_H
