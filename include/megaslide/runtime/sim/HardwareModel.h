//===- HardwareModel.h - Hardware and instruction time ----------*- C++ -*-===//
//
// A hardware description (JSON, docs/CostModel.md) with a built-in default
// for one H200 SXM on PCIe Gen5 x16 and a 1.5 TB host, and the one formula
// that times an instruction on it: roofline for device ops, bandwidth for
// transfers, parameter throughput for the host optimizer. The planner
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
#include <string>

namespace megaslide::sim {

struct HardwareModel {
  std::string name =
      "1x NVIDIA H200 SXM 141 GB, PCIe Gen5 x16, 1.5 TB host (built-in)";
  double bf16DenseFlops = 989e12;    ///< tensor-core peak, FLOP/s
  double f32DenseFlops = 67e12;      ///< fp32 peak on CUDA cores (no TF32)
  double matmulEfficiency = 0.70;    ///< achievable fraction on large GEMMs
  double attentionEfficiency = 0.55; ///< fused attention kernels
  double vectorFlops = 60e12;        ///< CUDA-core rate for elementwise work
  double hbmBandwidth = 4.8e12;      ///< B/s
  double hbmEfficiency = 0.80;
  double h2dBandwidth = 53e9;             ///< pinned host -> device, B/s
  double d2hBandwidth = 50e9;             ///< device -> pinned host, B/s
  double transferLatency = 10e-6;         ///< s per copy
  double launchLatency = 4e-6;            ///< s per kernel
  double hostMemoryBandwidth = 350e9;     ///< B/s, all sockets (staging casts)
  double hostAdamWParamsPerSecond = 12e9; ///< fused AdamW, params/s
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
/// Every field, in the order of the file format.
llvm::json::Value toJson(const HardwareModel &hw);

/// Which formula times an instruction.
enum class CostKind : uint8_t {
  None,         ///< no work: views (reshape), events
  Fetch,        ///< staging cast on the host pipelined with the h2d copy
  HostToDevice, ///< PCIe copy to the device
  DeviceToHost, ///< PCIe copy to the host
  HostAdamW,    ///< host optimizer
  Device,       ///< a kernel: roofline of FLOPs and HBM bytes
};

/// The kind of an execution-plan op, as plan/Ops.def declares it: the
/// transfers and the host optimizer by their formula; reshape, record and
/// wait do no work; every other op is a device kernel.
CostKind costKindOf(exec::OpCode op);

/// FLOPs per parameter the host AdamW reports (in CostInputs::otherFlops);
/// its time is the parameter count at host_adamw_params_per_second.
inline constexpr uint64_t kHostAdamWFlopsPerParam = 14;

/// Seconds an instruction of `kind` with `in` takes on `hw`; `resultType`
/// is the element type of its first result (an fp32 op runs its matmul and
/// attention FLOPs at f32_dense_flops, any other at bf16_dense_flops):
///   Fetch        transfer_latency + max(bytes / h2d, (sourceBytes + bytes)
///                / host_memory_bandwidth)
///   HostToDevice transfer_latency + bytes / h2d
///   DeviceToHost transfer_latency + bytes / d2h
///   HostAdamW    otherFlops / kHostAdamWFlopsPerParam / params_per_second
///   Device       launch_latency + max(matmul / (dense * matmul_eff) +
///                attention / (dense * attention_eff) + other / vector,
///                bytes / (hbm * hbm_eff))
///   None         0
double secondsFor(CostKind kind, const exec::CostInputs &in,
                  const HardwareModel &hw,
                  exec::DType resultType = exec::DType::BF16);

/// secondsFor an instruction of `plan`.
double secondsFor(const exec::ExecPlan &plan, const exec::Instruction &inst,
                  const HardwareModel &hw);

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_HARDWAREMODEL_H
