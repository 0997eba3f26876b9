//===- SimBackendTest.cpp - The sim backend and the shared cost formula ---===//
//
// runtime/sim: the hardware description (parsing, defaults, the formula of
// docs/CostModel.md on its worked examples) and simulateStep on hand-built
// execution plans with round hardware figures: dependencies through values
// and events, copy/compute overlap, write-after-read reuse of arena bytes,
// releases through views and workspaces, replayed memory, the trace, and
// errors for malformed plans.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/sim/SimBackend.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"

#include "gtest/gtest.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

using namespace megaslide;
using namespace megaslide::sim;
using exec::Home;
using exec::Stream;

namespace {

//===----------------------------------------------------------------------===//
// Hardware description and formula
//===----------------------------------------------------------------------===//

std::string errorOf(llvm::StringRef json) {
  llvm::Expected<HardwareModel> hw = parseHardwareModel(json, "hw.json");
  if (hw)
    return "";
  return llvm::toString(hw.takeError());
}

TEST(HardwareModel, AbsentFieldsKeepTheBuiltInH200) {
  HardwareModel hw = llvm::cantFail(
      parseHardwareModel(R"({"h2d_bandwidth": 25e9})", "a.json"));
  EXPECT_EQ(hw.name, "a.json");
  EXPECT_DOUBLE_EQ(hw.h2dBandwidth, 25e9);
  EXPECT_DOUBLE_EQ(hw.bf16DenseFlops, HardwareModel().bf16DenseFlops);
  HardwareModel named = llvm::cantFail(parseHardwareModel(
      R"({"name": "Gen4 box", "gemm_efficiency": 1})", "b.json"));
  EXPECT_EQ(named.name, "Gen4 box");
  EXPECT_DOUBLE_EQ(named.gemmEfficiency, 1);
}

TEST(HardwareModel, ErrorsNameTheSourceAndTheField) {
  EXPECT_EQ(errorOf(R"({"bogus": 1})"),
            "hw.json: hardware field 'bogus': unknown field; see "
            "docs/CostModel.md for the list");
  EXPECT_EQ(errorOf(R"({"gemm_efficiency": 1.5})"),
            "hw.json: hardware field 'gemm_efficiency': an efficiency is a "
            "fraction in [0.001, 1], got 1.5");
  // Fields of earlier descriptions say what replaced them.
  EXPECT_EQ(errorOf(R"({"matmul_efficiency": 0.7})"),
            "hw.json: hardware field 'matmul_efficiency': no longer a field: "
            "replaced by 'gemm_efficiency'; see docs/CostModel.md");
  EXPECT_NE(errorOf(R"({"attention_efficiency": 0.55})")
                .find("'attention_efficiency': no longer a field: replaced by "
                      "one efficiency per kernel family: "
                      "'attention_fwd_efficiency'"),
            std::string::npos);
  EXPECT_EQ(errorOf(R"({"h2d_bandwidth": 0})"),
            "hw.json: hardware field 'h2d_bandwidth': expected a positive "
            "number in B/s");
  EXPECT_EQ(errorOf(R"({"name": 3})"),
            "hw.json: hardware field 'name': expected a string");
  EXPECT_EQ(errorOf("[1]"),
            "hw.json: a hardware description must be a JSON object");
  EXPECT_NE(errorOf("{").find("hw.json: invalid JSON: "), std::string::npos);
  // Memory sizes are budgets, not hardware.
  EXPECT_NE(errorOf(R"({"gpu_memory_bytes": 1})").find("unknown field"),
            std::string::npos);
}

// Issue 11, item 9: values that made a figure non-finite ("h2d_bandwidth":
// 1e-308 gave "predicted_seconds": inf) are refused by name.
TEST(HardwareModel, ValuesOutsideTheirRangeAreRefusedByName) {
  EXPECT_EQ(errorOf(R"({"h2d_bandwidth": 1e-308})"),
            "hw.json: hardware field 'h2d_bandwidth': expected a number in "
            "[1e6, 1e15] B/s, got 1e-308");
  EXPECT_EQ(errorOf(R"({"hbm_bandwidth": 1e300})"),
            "hw.json: hardware field 'hbm_bandwidth': expected a number in "
            "[1e6, 1e15] B/s, got 1e+300");
  EXPECT_EQ(errorOf(R"({"bf16_dense_flops": 5})"),
            "hw.json: hardware field 'bf16_dense_flops': expected a number in "
            "[1e6, 1e18] FLOP/s, got 5");
  EXPECT_EQ(errorOf(R"({"dsa3d_bwd_efficiency": 1e-300})"),
            "hw.json: hardware field 'dsa3d_bwd_efficiency': an efficiency is "
            "a fraction in [0.001, 1], got 1e-300");
  EXPECT_EQ(errorOf(R"({"launch_latency": 3600})"),
            "hw.json: hardware field 'launch_latency': expected a number in "
            "(0, 1] s, got 3600");
  EXPECT_EQ(errorOf(R"({"host_adamw_params_per_second": 1})"),
            "hw.json: hardware field 'host_adamw_params_per_second': expected "
            "a number in [1e3, 1e15] params/s, got 1");
  EXPECT_EQ(errorOf(R"({"h2d_bandwidth": 1e999})"),
            "hw.json: hardware field 'h2d_bandwidth': expected a finite "
            "number in B/s");
}

/// Every field at one end of its range.
std::string extremeHardware(bool low) {
  std::string json = "{";
  llvm::json::Value fields = toJson(HardwareModel());
  for (const auto &[key, value] : *fields.getAsObject()) {
    if (key == "name")
      continue;
    llvm::StringRef k = key;
    double v = k.ends_with("efficiency")             ? (low ? 1e-3 : 1)
               : k.ends_with("latency")              ? (low ? 1e-300 : 1)
               : k == "host_adamw_params_per_second" ? (low ? 1e3 : 1e15)
               : k.ends_with("flops")                ? (low ? 1e6 : 1e18)
                                                     : (low ? 1e6 : 1e15);
    char number[32];
    std::snprintf(number, sizeof(number), "%.17g", v);
    json += (json.size() > 1 ? ", \"" : "\"") + k.str() + "\": " + number;
  }
  return json + "}";
}

TEST(HardwareModel, EveryFigureIsFiniteAtTheEndsOfTheRanges) {
  exec::CostInputs most;
  most.matmulFlops = most.attentionFlops = most.otherFlops = UINT64_MAX;
  most.bytes = most.sourceBytes = UINT64_MAX;
  for (bool low : {true, false}) {
    SCOPED_TRACE(low ? "lowest" : "highest");
    HardwareModel hw =
        llvm::cantFail(parseHardwareModel(extremeHardware(low), "x.json"));
    for (CostKind kind :
         {CostKind::None, CostKind::Fetch, CostKind::HostToDevice,
          CostKind::DeviceToHost, CostKind::HostAdamW, CostKind::Device})
      for (exec::DType type : {exec::DType::BF16, exec::DType::F32}) {
        double s = secondsFor(kind, KernelFamily::Gemm, most, hw, type);
        EXPECT_TRUE(std::isfinite(s) && s >= 0) << s;
        // A step of a million such instructions still sums finitely.
        EXPECT_TRUE(std::isfinite(s * 1e6)) << s;
      }
  }
}

TEST(HardwareModel, JsonRoundTrips) {
  HardwareModel hw;
  hw.name = "x";
  hw.hostMemoryBandwidth = 100e9;
  hw.f32DenseFlops = 50e12;
  std::string text;
  llvm::raw_string_ostream(text) << toJson(hw);
  HardwareModel back = llvm::cantFail(parseHardwareModel(text, "y"));
  EXPECT_EQ(back.name, "x");
  EXPECT_DOUBLE_EQ(back.hostMemoryBandwidth, 100e9);
  EXPECT_DOUBLE_EQ(back.f32DenseFlops, 50e12);
  EXPECT_EQ(toJson(back), toJson(hw));
}

TEST(HardwareModel, OpsChooseTheFormula) {
  using exec::OpCode;
  EXPECT_EQ(costKindOf(OpCode::Fetch), CostKind::Fetch);
  EXPECT_EQ(costKindOf(OpCode::HostToDevice), CostKind::HostToDevice);
  EXPECT_EQ(costKindOf(OpCode::DeviceToHost), CostKind::DeviceToHost);
  EXPECT_EQ(costKindOf(OpCode::HostAdamW), CostKind::HostAdamW);
  // Every other op is a kernel but the three that do no work.
  for (OpCode op : exec::kAllOpCodes) {
    if (exec::isScheduleOp(op) && op != OpCode::Record && op != OpCode::Wait)
      continue;
    bool free =
        op == OpCode::Reshape || op == OpCode::Record || op == OpCode::Wait;
    EXPECT_EQ(costKindOf(op), free ? CostKind::None : CostKind::Device)
        << exec::opName(op);
  }
}

// The worked examples of docs/CostModel.md on the built-in description.
TEST(HardwareModel, FormulaMatchesTheWorkedExamples) {
  HardwareModel hw;
  // FFN up projection of megaslide-105b: compute-bound, 88.0 ms.
  exec::CostInputs ffn;
  ffn.matmulFlops = 2ull * 75600 * 32768 * 12288;
  ffn.otherFlops = 2ull * 75600 * 32768 / 2 * 2; // the bias, 2.48e9
  ffn.bytes = 7617839104;
  double ffnSeconds = secondsFor(CostKind::Device, KernelFamily::Gemm, ffn, hw);
  EXPECT_NEAR(ffnSeconds,
              4e-6 + ffn.matmulFlops / (989e12 * 0.70) + ffn.otherFlops / 60e12,
              1e-15);
  EXPECT_NEAR(ffnSeconds, 0.0880, 5e-5);
  // The same op with an fp32 result runs at f32_dense_flops.
  EXPECT_NEAR(secondsFor(CostKind::Device, KernelFamily::Gemm, ffn, hw,
                         exec::DType::F32),
              4e-6 + ffn.matmulFlops / (67e12 * 0.70) + ffn.otherFlops / 60e12,
              1e-12);
  // Without arithmetic a kernel is memory-bound.
  exec::CostInputs copy;
  copy.bytes = 3840000000; // 1 ms at 80% of 4.8 TB/s
  EXPECT_NEAR(secondsFor(CostKind::Device, KernelFamily::Gemm, copy, hw),
              4e-6 + 1e-3, 1e-15);
  // A bf16 fetch of ffn.net.0.proj.weight from its fp32 master: bound by
  // the copy (15.2 ms), not by the staging cast.
  exec::CostInputs fetch;
  fetch.bytes = 805306368;
  fetch.sourceBytes = 2 * fetch.bytes;
  EXPECT_DOUBLE_EQ(secondsFor(CostKind::Fetch, KernelFamily::None, fetch, hw),
                   10e-6 + 805306368 / 53e9);
  HardwareModel slowHost = hw;
  slowHost.hostMemoryBandwidth = 100e9;
  EXPECT_DOUBLE_EQ(
      secondsFor(CostKind::Fetch, KernelFamily::None, fetch, slowHost),
      10e-6 + 3.0 * 805306368 / 100e9);
  EXPECT_DOUBLE_EQ(
      secondsFor(CostKind::HostToDevice, KernelFamily::None, fetch, hw),
      10e-6 + 805306368 / 53e9);
  EXPECT_DOUBLE_EQ(
      secondsFor(CostKind::DeviceToHost, KernelFamily::None, fetch, hw),
      10e-6 + 805306368 / 50e9);
  // One block's AdamW: 2,013,556,736 params at 12e9/s.
  exec::CostInputs adamw;
  adamw.otherFlops = kHostAdamWFlopsPerParam * 2013556736;
  EXPECT_DOUBLE_EQ(
      secondsFor(CostKind::HostAdamW, KernelFamily::None, adamw, hw),
      2013556736 / 12e9);
  EXPECT_EQ(secondsFor(CostKind::None, KernelFamily::None, ffn, hw), 0);
}

//===----------------------------------------------------------------------===//
// Plans
//===----------------------------------------------------------------------===//

/// Round figures: 1000 B/s up, 500 B/s down, 1000 FLOP/s at full
/// efficiency, free HBM and host memory, no latencies, 100 params/s.
HardwareModel roundHardware() {
  HardwareModel hw;
  hw.name = "round";
  hw.bf16DenseFlops = 1000;
  hw.gemmEfficiency = 1;
  hw.attentionFwdEfficiency = hw.attentionBwdEfficiency = 1;
  hw.dsa3dFwdEfficiency = hw.dsa3dBwdEfficiency = 1;
  hw.elementwiseHbmEfficiency = hw.dsa3dOffsetsHbmEfficiency = 1;
  hw.vectorFlops = 1000;
  hw.hbmBandwidth = 1e30;
  hw.hbmEfficiency = 1;
  hw.h2dBandwidth = 1000;
  hw.d2hBandwidth = 500;
  hw.transferLatency = 0;
  hw.launchLatency = 0;
  hw.hostMemoryBandwidth = 1e30;
  hw.hostAdamWParamsPerSecond = 100;
  return hw;
}

/// Builds plans instruction by instruction; values are bf16 vectors, so a
/// value of n elements has 2n bytes.
class PlanBuilder {
public:
  PlanBuilder() { plan.alignment = 1; }

  int64_t input(int64_t bytes, const char *name) {
    int64_t id = value(bytes, Home::Input, -1);
    plan.values[id].name = name;
    plan.inputs.push_back(id);
    return id;
  }
  int64_t device(int64_t bytes, int64_t offset) {
    plan.arenaBytes = std::max(plan.arenaBytes, offset + bytes);
    return value(bytes, Home::Device, offset);
  }
  int64_t host(int64_t bytes) { return value(bytes, Home::Host, -1); }
  int64_t view(int64_t of) {
    const exec::Value &base = plan.values[of];
    int64_t id = value(base.type.bytes(), base.home, base.offset);
    plan.values[id].viewOf = of;
    return id;
  }

  int64_t add(const std::string &op, Stream stream,
              std::vector<int64_t> operands, std::vector<int64_t> results,
              exec::CostInputs cost = {}) {
    exec::Instruction inst;
    inst.op = exec::parseOpCode(op).value();
    inst.stream = stream;
    inst.operands = std::move(operands);
    inst.results = std::move(results);
    inst.cost = cost;
    plan.instructions.push_back(std::move(inst));
    return plan.instructions.size() - 1;
  }
  /// A fetch of `bytes` (1000 B/s: bytes / 1000 seconds).
  int64_t fetch(const std::string &param, int64_t result) {
    exec::CostInputs c;
    c.bytes = c.sourceBytes = plan.values[result].type.bytes();
    int64_t i = add("fetch", Stream::HostToDevice, {}, {result}, c);
    plan.instructions[i].param = param;
    return i;
  }
  /// A matmul kernel of `seconds` (1000 FLOP/s).
  int64_t kernel(std::vector<int64_t> operands, std::vector<int64_t> results,
                 double seconds, const char *op = "linear") {
    exec::CostInputs c;
    c.matmulFlops = static_cast<uint64_t>(seconds * 1000);
    return add(op, Stream::Compute, std::move(operands), std::move(results), c);
  }
  int64_t copy(const char *op, Stream stream, int64_t from, int64_t to) {
    exec::CostInputs c;
    c.bytes = plan.values[to].type.bytes();
    return add(op, stream, {from}, {to}, c);
  }
  /// Records an event on `stream` and makes `on` wait for it.
  void sync(Stream stream, Stream on) {
    int64_t event = plan.numEvents++;
    int64_t r = add("record", stream, {}, {});
    plan.instructions[r].event = event;
    int64_t w = add("wait", on, {}, {});
    plan.instructions[w].event = event;
  }

  exec::ExecPlan plan;

private:
  int64_t value(int64_t bytes, Home home, int64_t offset) {
    exec::Value v;
    v.type.dtype = exec::DType::BF16;
    v.type.shape = {bytes / 2};
    v.home = home;
    v.offset = offset;
    plan.values.push_back(std::move(v));
    return plan.values.size() - 1;
  }
};

/// One block: two weights streamed in (the second prefetched while the
/// first is used), two kernels, the result copied out and consumed by the
/// host optimizer.
///
///   #0 fetch w0 -> v0 @0       h2d      0..1
///   #1 record h2d, #2 wait compute
///   #3 fetch w1 -> v1 @1000    h2d      1..2  (overlaps #4)
///   #4 linear v0 -> v2 @2000   compute  1..3
///   #5 record h2d, #6 wait compute
///   #7 linear v2, v1 -> v3 @0  compute  3..6  (reuses v0's bytes)
///   #8 record compute, #9 wait d2h
///   #10 d2h v3 -> v4 (host)    d2h      6..8
///   #11 record d2h, #12 wait host
///   #13 host_adamw v4, step    host     8..18 (1000 params at 100/s)
struct Block {
  PlanBuilder b;
  int64_t v0, v1, v2, v3, v4, step;
  Block() {
    step = b.input(8, "step");
    v0 = b.device(1000, 0);
    v1 = b.device(1000, 1000);
    v2 = b.device(1000, 2000);
    v3 = b.device(1000, 0);
    v4 = b.host(1000);
    b.fetch("w0", v0);
    b.sync(Stream::HostToDevice, Stream::Compute);
    b.fetch("w1", v1);
    b.kernel({v0}, {v2}, 2);
    b.sync(Stream::HostToDevice, Stream::Compute);
    b.kernel({v2, v1}, {v3}, 3);
    b.sync(Stream::Compute, Stream::DeviceToHost);
    b.copy("d2h", Stream::DeviceToHost, v3, v4);
    b.sync(Stream::DeviceToHost, Stream::Host);
    exec::CostInputs adamw;
    adamw.otherFlops = kHostAdamWFlopsPerParam * 1000;
    int64_t i = b.add("host_adamw", Stream::Host, {v4, step}, {}, adamw);
    b.plan.instructions[i].param = "w1";
    b.plan.outputs = {};
  }
};

std::vector<int64_t> usersOf(const Release &r) { return r.users; }

// Tests that a deferred host_adamw retains its gradient (its 1000 B read
// and written at the host bandwidth: 0.02 s) and that its update, timed as
// the host_adamw (1000 params at 100/s: 10 s), runs on the host stream
// right before the fetch that applies it, which waits for it: w1's fetch
// starts at 10 instead of 1, the second kernel at 11, the d2h at 14, the
// retain at 16. w0, updated by nobody, is fetched at once.
TEST(SimBackend, DeferredUpdateRunsBeforeTheFetchThatAppliesIt) {
  Block block;
  exec::ExecPlan &plan = block.b.plan;
  for (const char *name : {"w0", "w1"}) {
    exec::Param p;
    p.name = name;
    p.role = "master";
    p.type.shape = {500};
    plan.params.push_back(p);
  }
  exec::setDeferredUpdates(plan, /*deferred=*/true);
  HardwareModel hw = roundHardware();
  hw.hostMemoryBandwidth = 1e5;

  StepTasks step = llvm::cantFail(buildTasks(plan, hw));
  ASSERT_EQ(step.tasks.size(), 15u);
  ASSERT_EQ(step.updates.size(), 1u);
  EXPECT_EQ(step.updates[0].fetch, 3);
  EXPECT_EQ(step.updates[0].hostAdamW, 13);
  EXPECT_EQ(step.updates[0].task, 3);
  EXPECT_EQ(step.taskOf[3], 4);
  EXPECT_EQ(step.tasks[3].stream, Stream::Host);
  EXPECT_DOUBLE_EQ(step.tasks[3].seconds, 10);
  EXPECT_EQ(step.tasks[4].deps, (std::vector<int64_t>{3}));
  EXPECT_DOUBLE_EQ(step.tasks[14].seconds, 0.02);

  SimResult r = llvm::cantFail(simulateStep(plan, hw));
  EXPECT_DOUBLE_EQ(r.start[0], 0);
  EXPECT_DOUBLE_EQ(r.start[3], 10);
  EXPECT_DOUBLE_EQ(r.start[7], 11);
  EXPECT_DOUBLE_EQ(r.start[10], 14);
  EXPECT_DOUBLE_EQ(r.start[13], 16);
  EXPECT_DOUBLE_EQ(r.makespan, 16.02);
  EXPECT_DOUBLE_EQ(r.busy[static_cast<int>(Stream::Host)], 10.02);
  ASSERT_EQ(r.updates.size(), 1u);
  EXPECT_DOUBLE_EQ(r.updates[0].start, 0);
  EXPECT_DOUBLE_EQ(r.updates[0].end, 10);

  // Unmarked again, the replay is the streaming one: the update is the
  // host_adamw after the d2h, 8..18.
  exec::setDeferredUpdates(plan, /*deferred=*/false);
  SimResult streaming = llvm::cantFail(simulateStep(plan, hw));
  EXPECT_DOUBLE_EQ(streaming.start[13], 8);
  EXPECT_DOUBLE_EQ(streaming.makespan, 18);
  EXPECT_TRUE(streaming.updates.empty());
}

// Tests the NVMe tier's I/O lane: w1's moments (2 x 1000 B) are read
// before its host_adamw and written after it, at 2 drives x 100 B/s read
// (10 s) and 2 x 50 B/s write (20 s). The read starts with the step (the
// window holds them), so the update waits until 10 instead of starting at
// 8, and the write runs 20..40: the tier adds 22 s to the 18 s step.
TEST(SimBackend, TieredStateIsReadBeforeItsUpdateAndWrittenAfter) {
  Block block;
  exec::ExecPlan &plan = block.b.plan;
  exec::Param master;
  master.name = "w1";
  master.role = "master";
  master.type.shape = {250};
  plan.params.push_back(master);
  for (const char *name : {"w1.exp_avg", "w1.exp_avg_sq"}) {
    exec::Param m = master;
    m.name = name;
    m.role = "moment";
    m.of = "w1";
    plan.params.push_back(m);
  }
  plan.tierRoles = {"moment"};
  plan.tierDrives = 2;
  plan.tierWindowBytes = 4000;
  HardwareModel hw = roundHardware();
  hw.nvmeReadBandwidth = 100;
  hw.nvmeWriteBandwidth = 50;

  StepTasks step = llvm::cantFail(buildTasks(plan, hw));
  EXPECT_EQ(step.tierBytes, 2000u);
  SimResult r = llvm::cantFail(simulateStep(plan, hw));
  EXPECT_DOUBLE_EQ(r.start[13], 10);
  EXPECT_DOUBLE_EQ(r.end[13], 20);
  EXPECT_DOUBLE_EQ(r.makespan, 40);
  EXPECT_DOUBLE_EQ(r.ioBusy, 30);
  EXPECT_DOUBLE_EQ(r.tierGrowth, 22);
  EXPECT_EQ(r.tierBytes, 2000u);
  EXPECT_DOUBLE_EQ(withoutTierIo(step, hw.hostMemoryBandwidth), 18);
}

// Tests read-ahead through the window: a second host_adamw (w0's, after
// w1's) with 2000 B of moments too. A window of 4000 B holds both, so
// both reads run from the start (0..10, 10..20) and the second update
// runs 20..30 right after the first (10..20); the writes follow their
// updates on the lane (20..40, 40..60). A window of 2000 B holds one, so
// w0's read waits for w1's write (40..50), and its update for that read
// (50..60), its write 60..80.
TEST(SimBackend, ReadsRunAheadAsFarAsTheWindowHolds) {
  Block block;
  exec::ExecPlan &plan = block.b.plan;
  exec::CostInputs adamw;
  adamw.otherFlops = kHostAdamWFlopsPerParam * 1000;
  int64_t second = block.b.add("host_adamw", Stream::Host,
                               {block.v4, block.step}, {}, adamw);
  plan.instructions[second].param = "w0";
  for (const char *name : {"w1", "w0"}) {
    exec::Param master;
    master.name = name;
    master.role = "master";
    master.type.shape = {250};
    plan.params.push_back(master);
    for (const char *moment : {".exp_avg", ".exp_avg_sq"}) {
      exec::Param m = master;
      m.name = std::string(name) + moment;
      m.role = "moment";
      m.of = name;
      plan.params.push_back(m);
    }
  }
  plan.tierRoles = {"moment"};
  plan.tierDrives = 2;
  HardwareModel hw = roundHardware();
  hw.nvmeReadBandwidth = 100;
  hw.nvmeWriteBandwidth = 50;

  plan.tierWindowBytes = 4000;
  SimResult wide = llvm::cantFail(simulateStep(plan, hw));
  EXPECT_DOUBLE_EQ(wide.start[13], 10);
  EXPECT_DOUBLE_EQ(wide.start[second], 20);
  EXPECT_DOUBLE_EQ(wide.makespan, 60);
  EXPECT_EQ(wide.tierBytes, 4000u);
  EXPECT_DOUBLE_EQ(wide.ioBusy, 60);

  plan.tierWindowBytes = 2000;
  SimResult narrow = llvm::cantFail(simulateStep(plan, hw));
  EXPECT_DOUBLE_EQ(narrow.start[13], 10);
  EXPECT_DOUBLE_EQ(narrow.start[second], 50);
  EXPECT_DOUBLE_EQ(narrow.makespan, 80);
}

TEST(SimBackend, TasksFollowThePlannersRules) {
  Block block;
  std::vector<Task> tasks =
      llvm::cantFail(buildTasks(block.b.plan, roundHardware())).tasks;
  ASSERT_EQ(tasks.size(), 14u);
  // Streams and durations from the formula.
  EXPECT_EQ(tasks[3].stream, Stream::HostToDevice);
  EXPECT_DOUBLE_EQ(tasks[3].seconds, 1);
  EXPECT_EQ(tasks[7].stream, Stream::Compute);
  EXPECT_DOUBLE_EQ(tasks[7].seconds, 3);
  EXPECT_DOUBLE_EQ(tasks[10].seconds, 2);
  EXPECT_DOUBLE_EQ(tasks[13].seconds, 10);
  // Events are zero-length: a wait depends on its record.
  EXPECT_DOUBLE_EQ(tasks[1].seconds, 0);
  EXPECT_EQ(tasks[1].stream, Stream::HostToDevice);
  EXPECT_EQ(tasks[2].stream, Stream::Compute);
  EXPECT_EQ(tasks[2].deps, std::vector<int64_t>{1});
  // Dependencies are the producers of the values read (inputs have none).
  EXPECT_EQ(tasks[4].deps, std::vector<int64_t>{0});
  EXPECT_EQ(tasks[7].deps, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(tasks[13].deps, std::vector<int64_t>{10});
  // Writes: device results only.
  ASSERT_EQ(tasks[7].writes.size(), 1u);
  EXPECT_EQ(tasks[7].writes[0].offset, 0);
  EXPECT_EQ(tasks[7].writes[0].size, 1000);
  EXPECT_TRUE(tasks[10].writes.empty());
  // Each buffer is released by its last reader, after its producer and
  // all readers.
  ASSERT_EQ(tasks[4].frees.size(), 1u); // v0
  EXPECT_EQ(tasks[4].frees[0].range.offset, 0);
  EXPECT_EQ(usersOf(tasks[4].frees[0]), (std::vector<int64_t>{0, 4}));
  ASSERT_EQ(tasks[7].frees.size(), 2u); // v1, v2
  EXPECT_EQ(usersOf(tasks[7].frees[0]), (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(usersOf(tasks[7].frees[1]), (std::vector<int64_t>{4, 7}));
  ASSERT_EQ(tasks[10].frees.size(), 1u); // v3
  EXPECT_EQ(usersOf(tasks[10].frees[0]), (std::vector<int64_t>{7, 10}));
  EXPECT_TRUE(tasks[13].frees.empty()); // a host value
}

TEST(SimBackend, CopiesOverlapComputeAndTheStepIsPredicted) {
  Block block;
  SimResult r = llvm::cantFail(simulateStep(block.b.plan, roundHardware()));
  // The record of w1 (#5) is reached when w1 is in (2); compute passes the
  // wait (#6) when it is free again (3).
  EXPECT_EQ(r.start,
            (std::vector<double>{0, 1, 1, 1, 1, 2, 3, 3, 6, 6, 6, 8, 8, 8}));
  EXPECT_EQ(r.end,
            (std::vector<double>{1, 1, 1, 2, 3, 2, 3, 6, 6, 6, 8, 8, 8, 18}));
  // The prefetch of w1 (1..2) runs under the first kernel (1..3).
  EXPECT_LT(r.start[4], r.end[3]);
  EXPECT_LT(r.start[3], r.end[4]);
  EXPECT_DOUBLE_EQ(r.makespan, 18);
  EXPECT_DOUBLE_EQ(r.busy[0], 5);
  EXPECT_DOUBLE_EQ(r.busy[1], 2);
  EXPECT_DOUBLE_EQ(r.busy[2], 2);
  EXPECT_DOUBLE_EQ(r.busy[3], 10);
  EXPECT_DOUBLE_EQ(r.lowerBound, 10);
  EXPECT_EQ(r.boundBy, Stream::Host);
  EXPECT_EQ(r.deviceFlops, 5000u);
  EXPECT_EQ(r.h2dBytes, 2000u);
  EXPECT_EQ(r.d2hBytes, 1000u);
  // v0 (0..3), v1 (1..3) and v2 (1..6) are live together; v3 reuses v0's
  // bytes once v0's reader is done.
  EXPECT_EQ(r.arenaHighWater, 3000);
  EXPECT_EQ(r.peakLiveBytes, 3000);
}

TEST(SimBackend, ReusedBytesWaitForTheirLastReader) {
  // The second weight goes where the first was, so its fetch waits for the
  // kernel reading the first, although the copy stream is idle.
  PlanBuilder b;
  int64_t w0 = b.device(1000, 0), out = b.device(1000, 1000);
  int64_t w1 = b.device(1000, 0), out2 = b.device(1000, 2000);
  b.fetch("w0", w0);              // #0 0..1
  b.kernel({w0}, {out}, 4);       // #1 1..5
  int64_t f = b.fetch("w1", w1);  // #2 waits for #1: 5..6
  b.kernel({out, w1}, {out2}, 1); // #3 6..7
  SimResult r = llvm::cantFail(simulateStep(b.plan, roundHardware()));
  EXPECT_DOUBLE_EQ(r.start[f], 5);
  EXPECT_DOUBLE_EQ(r.makespan, 7);

  // At another offset it is prefetched under the kernel.
  b.plan.values[w1].offset = 3000;
  r = llvm::cantFail(simulateStep(b.plan, roundHardware()));
  EXPECT_DOUBLE_EQ(r.start[f], 1);
  EXPECT_DOUBLE_EQ(r.makespan, 6);
}

// Tests that two layers' gradients through one pinned buffer
// (--gradient-buffers 1, host values sharing bytes) hold back the issuing
// thread: layer 1's copy (#10) reuses layer 0's bytes, so the cuda backend
// waits for layer 0's host AdamW (#6, 3..13) before it issues that copy and
// the kernel after it (#11). With bytes of their own, or two buffers,
// nothing waits: the copy runs at 3..5 and the kernel at 2..3.
TEST(SimBackend, GradientCopiesIntoABusyRingSlotHoldBackTheIssuingThread) {
  PlanBuilder b;
  int64_t step = b.input(8, "step");
  int64_t d0 = b.device(1000, 0), d1 = b.device(1000, 1000),
          d2 = b.device(1000, 2000);
  int64_t h0 = b.host(1000), h1 = b.host(1000);
  auto adamw = [&](int64_t gradient, const char *param) {
    exec::CostInputs c;
    c.otherFlops = kHostAdamWFlopsPerParam * 1000;
    int64_t i = b.add("host_adamw", Stream::Host, {gradient, step}, {}, c);
    b.plan.instructions[i].param = param;
    return i;
  };
  b.kernel({}, {d0}, 1);                                    // #0 0..1
  b.sync(Stream::Compute, Stream::DeviceToHost);            // #1, #2
  int64_t c0 = b.copy("d2h", Stream::DeviceToHost, d0, h0); // #3 1..3
  b.sync(Stream::DeviceToHost, Stream::Host);               // #4, #5
  int64_t a0 = adamw(h0, "w0");                             // #6 3..13
  b.kernel({}, {d1}, 1);                                    // #7 1..2
  b.sync(Stream::Compute, Stream::DeviceToHost);            // #8, #9
  int64_t c1 = b.copy("d2h", Stream::DeviceToHost, d1, h1); // #10
  int64_t k2 = b.kernel({}, {d2}, 1);                       // #11
  b.sync(Stream::DeviceToHost, Stream::Host);
  adamw(h1, "w1");
  b.plan.instructions[c0].layer = 0;
  b.plan.instructions[c1].layer = 1;
  b.plan.outputs = {};
  HardwareModel hw = roundHardware();

  b.plan.gradientBuffers = 1;
  SimResult ring = llvm::cantFail(simulateStep(b.plan, hw, nullptr, 0));
  EXPECT_DOUBLE_EQ(ring.end[a0], 13);
  EXPECT_DOUBLE_EQ(ring.start[c1], 13);
  EXPECT_DOUBLE_EQ(ring.start[k2], 13);
  EXPECT_DOUBLE_EQ(ring.makespan, 25);
  EXPECT_EQ(ring.issueWaits.instructions, 1);
  EXPECT_DOUBLE_EQ(ring.issueWaits.seconds, 2);

  for (auto [buffers, noReuse] :
       {std::pair<int64_t, int64_t>{1, exec::kHostPoolNoReuseBytes}, {2, 0}}) {
    b.plan.gradientBuffers = buffers;
    SimResult free = llvm::cantFail(simulateStep(b.plan, hw, nullptr, noReuse));
    EXPECT_DOUBLE_EQ(free.start[c1], 3) << buffers;
    EXPECT_DOUBLE_EQ(free.start[k2], 2) << buffers;
    EXPECT_DOUBLE_EQ(free.makespan, 23) << buffers;
    EXPECT_EQ(free.issueWaits.instructions, 0) << buffers;
  }
}

TEST(SimBackend, ViewsAndWorkspacesHoldTheirBytes) {
  // A reshape shares its operand's bytes: they are released only after the
  // view's reader. An attention workspace is released by its own op.
  PlanBuilder b;
  int64_t in = b.input(1000, "x");
  int64_t x = b.device(1000, 0);
  b.copy("h2d", Stream::HostToDevice, in, x); // #0 0..1
  int64_t view = b.view(x);
  int64_t r = b.add("reshape", Stream::Compute, {x}, {view}); // #1 1..1
  int64_t y = b.device(1000, 1000);
  int64_t attn = b.kernel({view}, {y}, 2, "attention"); // #2 1..3
  b.plan.instructions[attn].workspace = {{2000, 500}};
  int64_t z = b.device(1000, 0);        // over x
  int64_t late = b.kernel({y}, {z}, 1); // #3 3..4
  int64_t w = b.device(1000, 2000);     // over the workspace
  int64_t copyIn = b.copy("h2d", Stream::HostToDevice, in, w); // #4

  std::vector<Task> tasks =
      llvm::cantFail(buildTasks(b.plan, roundHardware())).tasks;
  EXPECT_TRUE(tasks[r].writes.empty());
  EXPECT_DOUBLE_EQ(tasks[r].seconds, 0);
  // x's release goes with the view's reader and waits for the reshape.
  ASSERT_EQ(tasks[attn].frees.size(), 2u);
  EXPECT_EQ(tasks[attn].frees[0].range.offset, 0);
  EXPECT_EQ(usersOf(tasks[attn].frees[0]), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(tasks[attn].frees[1].range.offset, 2000);
  EXPECT_EQ(tasks[attn].frees[1].range.size, 500);
  ASSERT_EQ(tasks[attn].writes.size(), 2u);
  EXPECT_EQ(tasks[attn].writes[1].offset, 2000);

  SimResult s = llvm::cantFail(simulateStep(b.plan, roundHardware()));
  EXPECT_DOUBLE_EQ(s.start[late], 3);
  // The second copy is issued after #3 but only waits for the workspace.
  EXPECT_DOUBLE_EQ(s.start[copyIn], 3);
  EXPECT_DOUBLE_EQ(s.makespan, 4);
  EXPECT_EQ(s.arenaHighWater, 3000);
  // x, y and the workspace (2500 B) until 3, then y, z and w.
  EXPECT_EQ(s.peakLiveBytes, 3000);
}

TEST(SimBackend, AWaitHoldsBackLaterWorkOnItsStream) {
  // Events are honoured even where no value flows: compute waits for the
  // copy stream before an unrelated kernel.
  PlanBuilder b;
  int64_t in = b.input(4000, "x");
  int64_t x = b.device(4000, 0);
  b.copy("h2d", Stream::HostToDevice, in, x);    // #0 0..4
  b.sync(Stream::HostToDevice, Stream::Compute); // #1, #2
  int64_t y = b.device(1000, 4000);
  int64_t k = b.kernel({}, {y}, 1, "zeros"); // #3
  SimResult r = llvm::cantFail(simulateStep(b.plan, roundHardware()));
  EXPECT_DOUBLE_EQ(r.start[k], 4);
  EXPECT_DOUBLE_EQ(r.makespan, 5);
}

TEST(SimBackend, ReturnedBuffersAreNeverReleased) {
  PlanBuilder b;
  int64_t loss = b.device(1000, 0);
  b.kernel({}, {loss}, 1, "zeros"); // #0 0..1, read by nobody
  int64_t other = b.device(1000, 1000);
  b.kernel({}, {other}, 2, "zeros"); // #1 1..3
  b.plan.outputs = {loss};
  std::vector<Task> tasks =
      llvm::cantFail(buildTasks(b.plan, roundHardware())).tasks;
  EXPECT_TRUE(tasks[0].frees.empty());
  ASSERT_EQ(tasks[1].frees.size(), 1u);

  std::string text;
  llvm::raw_string_ostream os(text);
  trace::ChromeTrace trace(os, "p");
  SimResult r = llvm::cantFail(simulateStep(b.plan, roundHardware(), &trace));
  llvm::cantFail(trace.finish());
  EXPECT_DOUBLE_EQ(r.makespan, 3);
  // The loss holds its bytes to the end of the step, beside `other`.
  EXPECT_EQ(r.peakLiveBytes, 2000);
  llvm::json::Value parsed = llvm::cantFail(llvm::json::parse(text));
  std::vector<std::pair<double, int64_t>> memory;
  for (const llvm::json::Value &e :
       *parsed.getAsObject()->getArray("traceEvents"))
    if (const llvm::json::Object *c = e.getAsObject();
        c->getString("ph") == "C")
      memory.push_back(
          {*c->getNumber("ts"), *c->getObject("args")->getInteger("bytes")});
  EXPECT_EQ(memory, (std::vector<std::pair<double, int64_t>>{
                        {0, 1000}, {1e6, 2000}, {3e6, 0}}));
}

TEST(SimBackend, TraceHasASpanPerInstructionAndDeviceMemory) {
  Block block;
  std::string text;
  llvm::raw_string_ostream os(text);
  trace::ChromeTrace trace(os, "megaslide-run (sim)");
  SimResult r =
      llvm::cantFail(simulateStep(block.b.plan, roundHardware(), &trace));
  llvm::cantFail(trace.finish());
  ASSERT_FALSE(bool(trace::validateChromeTrace(text)));

  llvm::json::Value parsed = llvm::cantFail(llvm::json::parse(text));
  std::map<int64_t, std::string> tracks;
  std::vector<const llvm::json::Object *> spans, memory;
  for (const llvm::json::Value &e :
       *parsed.getAsObject()->getArray("traceEvents")) {
    const llvm::json::Object *o = e.getAsObject();
    if (o->getString("ph") == "M" && o->getString("name") == "thread_name")
      tracks[*o->getInteger("tid")] =
          o->getObject("args")->getString("name")->str();
    if (o->getString("ph") == "X")
      spans.push_back(o);
    if (o->getString("ph") == "C")
      memory.push_back(o);
  }
  // Every instruction but record and wait, in program order.
  ASSERT_EQ(spans.size(), 6u);
  std::vector<std::string> names, streams;
  for (const llvm::json::Object *s : spans) {
    names.push_back(s->getString("name")->str());
    streams.push_back(tracks[*s->getInteger("tid")]);
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"fetch w0", "fetch w1", "linear",
                                      "linear", "d2h", "host_adamw w1"}));
  EXPECT_EQ(streams, (std::vector<std::string>{"h2d", "h2d", "compute",
                                               "compute", "d2h", "host"}));
  const llvm::json::Object *second = spans[3];
  EXPECT_DOUBLE_EQ(*second->getNumber("ts"), 3e6);
  EXPECT_DOUBLE_EQ(*second->getNumber("dur"), 3e6);
  EXPECT_EQ(second->getObject("args")->getInteger("instruction"), 7);
  EXPECT_EQ(second->getObject("args")->getInteger("flops"), 3000);
  EXPECT_EQ(spans[0]->getObject("args")->getInteger("bytes"), 1000);

  // Device memory from 0 to its peak and back to 0.
  ASSERT_FALSE(memory.empty());
  int64_t peak = 0;
  double lastTs = -1;
  for (const llvm::json::Object *c : memory) {
    EXPECT_EQ(c->getString("name"), "device memory");
    EXPECT_GT(*c->getNumber("ts"), lastTs);
    lastTs = *c->getNumber("ts");
    peak = std::max(peak, *c->getObject("args")->getInteger("bytes"));
  }
  EXPECT_EQ(memory.front()->getObject("args")->getInteger("bytes"), 1000);
  EXPECT_EQ(memory.back()->getObject("args")->getInteger("bytes"), 0);
  EXPECT_EQ(peak, r.peakLiveBytes);

  const llvm::json::Object *other =
      parsed.getAsObject()->getObject("otherData");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->getString("backend"), "sim");
  EXPECT_EQ(other->getString("hardware"), "round");
  EXPECT_EQ(other->getNumber("predicted_seconds"), 18);
}

TEST(SimBackend, BackendStepsTakeThePredictedTime) {
  Block block;
  auto backend =
      llvm::cantFail(SimBackend::create(block.b.plan, roundHardware()));
  EXPECT_STREQ(backend->name(), "sim");
  EXPECT_FALSE(backend->computesLoss());
  host::HostState state;
  exec::StepOptions options;
  options.trace = true;
  exec::StepResult step = llvm::cantFail(backend->step({}, state, options));
  EXPECT_DOUBLE_EQ(step.seconds, 18);
  EXPECT_EQ(step.memory.plannedArenaBytes, 3000);
  EXPECT_EQ(step.memory.measuredArenaBytes, 3000);
  EXPECT_EQ(step.memory.measuredLiveBytes, 3000);
  ASSERT_EQ(step.spans.size(), 6u);
  EXPECT_EQ(step.spans[2].instruction, 4);
  EXPECT_EQ(step.spans[2].stream, Stream::Compute);
  EXPECT_DOUBLE_EQ(step.spans[2].start, 1);
  EXPECT_DOUBLE_EQ(step.spans[2].seconds, 2);
  EXPECT_EQ(state.step, 0);
  options.trace = false;
  EXPECT_TRUE(llvm::cantFail(backend->step({}, state, options)).spans.empty());
}

TEST(SimBackend, MalformedPlansAreErrorsNamingTheInstruction) {
  auto errorOfPlan = [](const exec::ExecPlan &plan) -> std::string {
    llvm::Expected<SimResult> r = simulateStep(plan, roundHardware());
    return r ? "" : llvm::toString(r.takeError());
  };
  {
    PlanBuilder b;
    b.add("wait", Stream::Compute, {}, {});
    EXPECT_EQ(errorOfPlan(b.plan), "instruction #0: 'wait' has no event in "
                                   "range");
    b.plan.numEvents = 1;
    b.plan.instructions[0].event = 0;
    EXPECT_EQ(errorOfPlan(b.plan), "instruction #0: waits for event 0, which "
                                   "is not recorded before");
  }
  {
    PlanBuilder b;
    b.kernel({7}, {}, 1);
    EXPECT_EQ(errorOfPlan(b.plan), "instruction #0: value id 7 is out of "
                                   "range");
  }
  {
    PlanBuilder b;
    int64_t x = b.device(10, 0);
    b.plan.values[x].viewOf = x;
    EXPECT_EQ(errorOfPlan(b.plan),
              "value 0 is a view of 0, which is not an earlier value");
  }
}

// A model built in code skips parseHardwareModel's ranges: an infinite
// time is an error naming the instruction, not a replay that then reports
// memory figures differing from the plan (megaslide-run exited 4).
TEST(SimBackend, AnInfiniteTimeIsAnErrorNamingTheInstruction) {
  Block block;
  HardwareModel hw = roundHardware();
  hw.h2dBandwidth = 1e-308;
  llvm::Expected<SimResult> r = simulateStep(block.b.plan, hw);
  ASSERT_FALSE(bool(r));
  EXPECT_EQ(llvm::toString(r.takeError()),
            "instruction #0: the hardware model 'round' gives it a time of "
            "inf s; check its rates and efficiencies");
}

} // namespace
