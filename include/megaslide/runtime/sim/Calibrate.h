//===- Calibrate.h - Hardware rates fitted to a measured trace --*- C++ -*-===//
//
// megaslide-calibrate's library: reads the Chrome trace a backend writes
// (include/megaslide/runtime/trace/ChromeTrace.h: one event per
// instruction, named after its op, with its instruction index, bytes and
// FLOPs) and fits the hardware description's per-family efficiencies,
// link bandwidths, transfer latency and host AdamW rate so that
// sim::secondsFor reproduces the measured times (docs/CostModel.md,
// "Calibration"). No MLIR.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SIM_CALIBRATE_H
#define MEGASLIDE_RUNTIME_SIM_CALIBRATE_H

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/sim/HardwareModel.h"

#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace megaslide::sim {

/// One instruction's span as a trace records it.
struct MeasuredSpan {
  exec::OpCode op;
  exec::Stream stream;
  double start = 0, seconds = 0;
  int64_t instruction = -1;
  uint64_t bytes = 0, flops = 0;
};

struct MeasuredTrace {
  std::vector<MeasuredSpan> spans;
  std::string backend; ///< "cuda", "sim", ... ("" when the trace omits it)
  int64_t steps = 0;   ///< how often its first instruction appears
  double seconds = 0;  ///< from the first start to the last end
};

/// Parses a Chrome trace (validateChromeTrace's format) into the spans of
/// its instructions: complete events whose name starts with an op of
/// plan/Ops.def and whose args carry `instruction`. `source` names the
/// trace in errors. Fails on invalid JSON, a document that is not a trace,
/// a trace of the cpu backend (its kernel times describe no GPU) and a
/// trace without device kernels.
llvm::Expected<MeasuredTrace> parseMeasuredTrace(llvm::StringRef json,
                                                 llvm::StringRef source);

/// Predicted and measured time of one family, transfer direction or the
/// host optimizer over the whole trace.
struct CalibrationRow {
  std::string what; ///< kernelFamilyName, "h2d", "d2h", "host_adamw"
  int64_t events = 0;
  double measured = 0; ///< summed seconds
  double before = 0;   ///< predicted on the base description
  double after = 0;    ///< predicted on the calibrated one
  std::string fitted;  ///< "gemm_efficiency 0.612", ...; "" if kept
};

struct Calibration {
  HardwareModel hw; ///< the base description with the fitted fields
  std::vector<CalibrationRow> rows;
  std::vector<std::string> notes; ///< fields kept, clamps, assumptions
};

/// Fits `base`'s rates to `trace`. With `plan` (the plan the trace ran;
/// its instruction indices must match) each span's cost inputs are the
/// plan's: FLOPs by category, source bytes of a fetch, result type.
/// Without it they come from the trace: a compute-bound family's FLOPs
/// are all of its kind (matmul for gemm, attention for the attention and
/// DSA families), the result is bf16 and a fetch reads an fp32 master.
///
/// Per kernel family the efficiency is the one in [0.001, 1] for which the
/// family's summed secondsFor equals its summed measured time (bisection;
/// for a compute-bound family without memory-bound spans this is
/// sum FLOPs / (sum seconds - spans x launch_latency) / peak). h2d and
/// d2h bandwidth and the transfer latency are least-squares lines through
/// (bytes, seconds) of the copies, refitted without the spans more than
/// 2% above the line (a fetch slowed by the host, say); the host AdamW
/// rate is its parameters over its seconds, from the updates that overlap
/// no fetch when there are any. What cannot be fitted keeps `base`'s value
/// and gets a note. Fails when `plan` does not match the trace.
llvm::Expected<Calibration> calibrate(const MeasuredTrace &trace,
                                      const exec::ExecPlan *plan,
                                      const HardwareModel &base);

} // namespace megaslide::sim

#endif // MEGASLIDE_RUNTIME_SIM_CALIBRATE_H
