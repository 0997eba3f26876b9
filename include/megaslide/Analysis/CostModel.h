//===- CostModel.h - Hardware description and op costs ----------*- C++ -*-===//
//
// A hardware description (JSON, docs/CostModel.md) with a built-in default
// for one H200 SXM on PCIe Gen5 x16 and a 1.5 TB host, and the time each
// op of a schedule takes on it: roofline for device compute, bandwidth for
// transfers, parameter throughput for the host optimizer.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_COSTMODEL_H
#define MEGASLIDE_ANALYSIS_COSTMODEL_H

#include "mlir/IR/Operation.h"
#include "mlir/IR/SymbolTable.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/JSON.h"

#include <string>

namespace megaslide {

struct HardwareModel {
  std::string name =
      "1x NVIDIA H200 SXM 141 GB, PCIe Gen5 x16, 1.5 TB host (built-in)";
  double bf16DenseFlops = 989e12;    ///< tensor-core peak, FLOP/s
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
/// defaults, unknown fields are errors naming the field.
llvm::Expected<HardwareModel> parseHardwareModel(llvm::StringRef json,
                                                 llvm::StringRef source);
llvm::Expected<HardwareModel> loadHardwareModel(llvm::StringRef path);
llvm::json::Value toJson(const HardwareModel &hw);

/// Bytes of a ranked tensor type.
uint64_t tensorBytes(mlir::Type type);

/// Where an op's time goes on `hw`.
struct OpCost {
  uint64_t flops = 0;
  uint64_t bytes = 0; ///< moved through HBM, PCIe or host memory
  double seconds = 0;
};

/// The cost of one op of a scheduled training step: graph ops on the
/// device, `msched.fetch` / `h2d` / `d2h` on PCIe, `msched.host_adamw` on
/// the host. Ops that do no work cost nothing. `symbols` caches the
/// lookups of fetched parameters across calls.
OpCost costOf(mlir::Operation *op, const HardwareModel &hw,
              mlir::SymbolTableCollection &symbols);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_COSTMODEL_H
