//===- DeviceBuffers.h - Device buffers of a scheduled step -----*- C++ -*-===//
//
// Every device buffer of a training step after insert-transfers, with its
// live range in program order (the rule of runtime/plan/Liveness.h, which
// the runtime applies to the exported plan), size, category and block: the
// input of memory packing, budget checks and the memory report.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_ANALYSIS_DEVICEBUFFERS_H
#define MEGASLIDE_ANALYSIS_DEVICEBUFFERS_H

#include "megaslide/runtime/support/Packing.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include <map>
#include <optional>
#include <string>

namespace megaslide {

struct DeviceBuffer {
  mlir::Value value;      ///< the tensor; null for an attention workspace
  mlir::Operation *owner; ///< op defining it (or using the workspace)
  Slice slice;
  llvm::StringRef category; ///< weights, activations, gradients, ...
  std::optional<int64_t> layer;
  /// e.g. "weights blocks.3.ffn.net.0.proj.weight [32768, 12288] bf16".
  std::string describe() const;
};

struct DeviceBuffers {
  std::vector<DeviceBuffer> buffers;
  /// Program-order index of every op of the step but the bookkeeping ops
  /// msched.pack and msched.budget_check.
  llvm::DenseMap<mlir::Operation *, int64_t> index;
  /// Buffer of each device value (reshapes alias their input).
  llvm::DenseMap<mlir::Value, size_t> bufferOf;
  int64_t numSteps = 0;
};

/// Device values are the tensors produced on the compute, h2d and comm
/// streams (`msched.stream`); attention ops add a workspace
/// (workspaceBytes), live during the op.
DeviceBuffers collectDeviceBuffers(mlir::func::FuncOp step);

/// The operand whose device buffer `op`'s result is a view of (reshape,
/// and the in-place collectives all_gather and reduce_scatter); null for
/// any other op.
mlir::Value viewedValue(mlir::Operation *op);

/// Bytes of scratch an attention op needs beside its results and operands.
/// Global attention: the fp32 log-sum-exp per query and head (forward),
/// plus the fp32 row sums of dO * O (backward). 3D-DSA returns its
/// log-sum-exp as a result, so `dsa3d` needs none; `dsa3d_grad` needs the
/// fp32 row sums of dO * O (B*H*N*4 bytes) plus the fp32 dK and dV
/// accumulators of the CUDA backward (2*B*N*H*Dh*4 bytes). Zero for other
/// ops.
uint64_t workspaceBytes(mlir::Operation *op);

/// Where live device bytes peak, and what is live there.
struct DevicePeak {
  std::vector<int64_t> live; ///< live bytes at every step
  int64_t step = 0;          ///< first step with the most live bytes
  int64_t bytes = 0;         ///< live bytes there (unaligned, no fragmentation)
  /// Buffers live at `step`, largest first.
  std::vector<const DeviceBuffer *> buffers;
  /// Their bytes by category, in name order.
  std::map<std::string, int64_t> byCategory;
};

DevicePeak findDevicePeak(const DeviceBuffers &buffers);

} // namespace megaslide

#endif // MEGASLIDE_ANALYSIS_DEVICEBUFFERS_H
