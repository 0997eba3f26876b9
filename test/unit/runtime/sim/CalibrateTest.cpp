//===- CalibrateTest.cpp - Fitting the hardware description to a trace ----===//
//
// Traces timed by secondsFor on a description with known, non-default
// rates calibrate back to those rates (to 1e-6 relative), whatever the
// base description; bad traces are refused by name.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/sim/Calibrate.h"

#include <gtest/gtest.h>

#include <cstdlib>

using namespace megaslide;
using namespace megaslide::sim;
using exec::OpCode;

namespace {

/// Rates unlike the built-in ones in every fitted field.
HardwareModel known() {
  HardwareModel hw;
  hw.name = "known";
  hw.gemmEfficiency = 0.52;
  hw.attentionFwdEfficiency = 0.31;
  hw.attentionBwdEfficiency = 0.22;
  hw.dsa3dFwdEfficiency = 0.27;
  hw.dsa3dBwdEfficiency = 0.13;
  hw.dsa3dOffsetsHbmEfficiency = 0.21;
  hw.elementwiseHbmEfficiency = 0.33;
  hw.h2dBandwidth = 31e9;
  hw.d2hBandwidth = 23e9;
  hw.transferLatency = 7e-6;
  hw.hostAdamWParamsPerSecond = 5e9;
  return hw;
}

/// A trace of `ops` (op, bytes, FLOPs) timed on `hw` as the trace-only
/// calibration reads them, one after the other on their streams.
MeasuredTrace
traceOf(const std::vector<std::tuple<OpCode, uint64_t, uint64_t>> &ops,
        const HardwareModel &hw) {
  MeasuredTrace t;
  t.backend = "sim";
  t.steps = 1;
  double at = 0;
  for (auto [i, op] : llvm::enumerate(ops)) {
    auto [code, bytes, flops] = op;
    MeasuredSpan s;
    s.op = code;
    s.stream = exec::Stream::Compute;
    s.instruction = i;
    s.bytes = bytes;
    s.flops = flops;
    exec::CostInputs in;
    in.bytes = bytes;
    KernelFamily f = kernelFamilyOf(code);
    if (f == KernelFamily::Gemm)
      in.matmulFlops = flops;
    else if (isComputeBound(f))
      in.attentionFlops = flops;
    else
      in.otherFlops = flops;
    if (code == OpCode::Fetch)
      in.sourceBytes = 2 * bytes;
    s.seconds = secondsFor(costKindOf(code), f, in, hw);
    s.start = at;
    at += s.seconds;
    t.spans.push_back(s);
  }
  t.seconds = at;
  return t;
}

std::vector<std::tuple<OpCode, uint64_t, uint64_t>> step() {
  std::vector<std::tuple<OpCode, uint64_t, uint64_t>> ops;
  for (uint64_t n : {1ull << 20, 3ull << 22, 5ull << 24}) {
    // Compute-bound GEMMs and attention; memory-bound elementwise work.
    ops.push_back({OpCode::Linear, 6 * n, 4096 * n});
    ops.push_back({OpCode::LinearGradData, 6 * n, 4096 * n});
    ops.push_back({OpCode::Attention, 8 * n, 30000 * n});
    ops.push_back({OpCode::AttentionGrad, 16 * n, 75000 * n});
    ops.push_back({OpCode::Dsa3d, 8 * n, 20000 * n});
    ops.push_back({OpCode::Dsa3dGrad, 16 * n, 50000 * n});
    ops.push_back({OpCode::Dsa3dOffsets, 4 * n, n});
    ops.push_back({OpCode::Gelu, 4 * n, 8 * n});
    ops.push_back({OpCode::LayerNorm, 4 * n, 6 * n});
    // Copies of several sizes and the host optimizer.
    ops.push_back({OpCode::Fetch, 2 * n, 0});
    ops.push_back({OpCode::HostToDevice, 7 * n, 0});
    ops.push_back({OpCode::DeviceToHost, 2 * n, 0});
    ops.push_back({OpCode::HostAdamW, 0, kHostAdamWFlopsPerParam * n});
  }
  return ops;
}

void expectRelative(double actual, double expected, const char *what) {
  EXPECT_NEAR(actual / expected, 1, 1e-6) << what;
}

TEST(Calibrate, RecoversKnownRates) {
  HardwareModel truth = known();
  MeasuredTrace trace = traceOf(step(), truth);
  // The base only supplies what is not fitted (peaks, launch latency).
  Calibration c = llvm::cantFail(calibrate(trace, nullptr, HardwareModel()));
  for (int f = 1; f < kNumKernelFamilies; ++f) {
    auto family = static_cast<KernelFamily>(f);
    expectRelative(efficiencyOf(c.hw, family), efficiencyOf(truth, family),
                   kernelFamilyName(family));
  }
  expectRelative(c.hw.h2dBandwidth, truth.h2dBandwidth, "h2d");
  expectRelative(c.hw.d2hBandwidth, truth.d2hBandwidth, "d2h");
  expectRelative(c.hw.transferLatency, truth.transferLatency, "latency");
  expectRelative(c.hw.hostAdamWParamsPerSecond, truth.hostAdamWParamsPerSecond,
                 "adamw");
  // Every row is then predicted as measured.
  ASSERT_FALSE(c.rows.empty());
  for (const CalibrationRow &r : c.rows) {
    EXPECT_NEAR(r.after / r.measured, 1, 1e-6) << r.what;
    EXPECT_NE(r.fitted, "") << r.what;
  }
}

TEST(Calibrate, CopiesAboveTheLineAreLeftOut) {
  HardwareModel truth = known();
  MeasuredTrace trace = traceOf(step(), truth);
  // A fetch slowed to three times its time (sharing the host).
  for (MeasuredSpan &s : trace.spans)
    if (s.op == OpCode::Fetch) {
      s.seconds *= 3;
      break;
    }
  Calibration c = llvm::cantFail(calibrate(trace, nullptr, HardwareModel()));
  expectRelative(c.hw.h2dBandwidth, truth.h2dBandwidth, "h2d");
  bool noted = llvm::any_of(c.notes, [](const std::string &n) {
    return n.find("h2d: 1 of 6 copies lie more than 2% above") !=
           std::string::npos;
  });
  EXPECT_TRUE(noted);
}

TEST(Calibrate, EmptyFamiliesKeepTheBaseWithANote) {
  MeasuredTrace trace = traceOf({{OpCode::Linear, 1 << 20, 1ull << 40},
                                 {OpCode::Linear, 1 << 22, 1ull << 41}},
                                known());
  HardwareModel base;
  Calibration c = llvm::cantFail(calibrate(trace, nullptr, base));
  expectRelative(c.hw.gemmEfficiency, 0.52, "gemm");
  EXPECT_EQ(c.hw.attentionFwdEfficiency, base.attentionFwdEfficiency);
  EXPECT_EQ(c.hw.h2dBandwidth, base.h2dBandwidth);
  const std::string note =
      "attention_fwd: no events; 'attention_fwd_efficiency' keeps ";
  bool noted = llvm::any_of(c.notes, [&](const std::string &n) {
    return n.rfind(note, 0) == 0 &&
           std::strtod(n.c_str() + note.size(), nullptr) ==
               base.attentionFwdEfficiency;
  });
  EXPECT_TRUE(noted);
}

TEST(Calibrate, ImpossibleTimesAreClampedWithANote) {
  MeasuredTrace trace =
      traceOf({{OpCode::Linear, 1 << 20, 1ull << 40}}, known());
  trace.spans[0].seconds = 1e-9; // faster than the peak
  Calibration c = llvm::cantFail(calibrate(trace, nullptr, HardwareModel()));
  EXPECT_EQ(c.hw.gemmEfficiency, 1);
  bool noted = llvm::any_of(c.notes, [](const std::string &n) {
    return n.find("faster than 'gemm_efficiency' 1 predicts") !=
           std::string::npos;
  });
  EXPECT_TRUE(noted);
}

std::string errorOf(llvm::StringRef json) {
  llvm::Expected<MeasuredTrace> t = parseMeasuredTrace(json, "t.json");
  if (t)
    return "";
  return llvm::toString(t.takeError());
}

TEST(Calibrate, BadTracesAreRefusedByName) {
  EXPECT_EQ(errorOf("{\"a\": 1}"),
            "t.json: not a trace: no \"traceEvents\" array (the Chrome trace "
            "`megaslide-run --trace` writes)");
  EXPECT_NE(errorOf("{").find("t.json: not a trace: invalid JSON"),
            std::string::npos);
  EXPECT_EQ(errorOf(R"({"traceEvents": [{"ph": "X", "name": "fetch w",
      "cat": "h2d", "pid": 1, "tid": 2, "ts": 0, "dur": 5,
      "args": {"instruction": 0, "bytes": 10, "flops": 0}}]})"),
            "t.json: no device kernel events (events named after an op, with "
            "args.instruction, on the compute track): nothing to calibrate");
  EXPECT_EQ(errorOf(R"({"traceEvents": [], "otherData": {"backend": "cpu"}})"),
            "t.json: a trace of the cpu backend: its kernel times describe "
            "no GPU; calibrate from a cuda trace");
  llvm::Expected<MeasuredTrace> ok = parseMeasuredTrace(
      R"j({"traceEvents": [{"name": "process_name", "ph": "M", "pid": 1,
      "args": {"name": "megaslide-run tiny (cuda)"}},
      {"ph": "X", "name": "linear", "cat": "compute", "pid": 1, "tid": 1,
      "ts": 10, "dur": 5, "args": {"instruction": 3, "bytes": 10,
      "flops": 20}}]})j",
      "t.json");
  ASSERT_TRUE(static_cast<bool>(ok)) << llvm::toString(ok.takeError());
  EXPECT_EQ(ok->backend, "cuda");
  ASSERT_EQ(ok->spans.size(), 1u);
  EXPECT_DOUBLE_EQ(ok->spans[0].seconds, 5e-6);
  EXPECT_EQ(ok->spans[0].flops, 20u);
}

} // namespace
