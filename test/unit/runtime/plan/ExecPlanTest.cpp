//===- ExecPlanTest.cpp - The execution plan as untrusted input -----------===//
//
// runtime/plan/ExecPlan: a small hand-built plan that uses every kind of
// instruction (inputs, a fetch of a master with its two AdamW moments,
// events, a graph op with a workspace, a reshape view, a d2h to the host,
// the host AdamW) round-trips through serialize and parseExecPlan field by
// field; corrupted plans, one invariant at a time, give an error that
// names the problem; seeded random byte and number mutations never crash
// the loader; computeLiveness gives the documented intervals; every op
// name of plan/Ops.def decodes to its op. The cpu backend has a kernel for
// every graph op and runs the valid plan with a measured arena equal to the
// planned one.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"
#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/plan/HyperParameters.h"
#include "megaslide/runtime/plan/Liveness.h"
#include "megaslide/runtime/plan/Validate.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include "gtest/gtest.h"

#include <cmath>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace megaslide;
using namespace megaslide::exec;

namespace {

//===----------------------------------------------------------------------===//
// The valid plan
//===----------------------------------------------------------------------===//

/// Value ids of the plan below.
enum : int64_t {
  kLatents, // input f32[2,4]
  kStep,    // input i64[]
  kX,       // device f32[2,4] @0    h2d of latents
  kW,       // device f32[2,4] @32   fetch of master "X"
  kSum,     // device f32[2,4] @64   add(kX, kW)
  kFlat,    // device f32[8]   @64   reshape of kSum, a view
  kGrad,    // host   f32[8]         d2h of kFlat
  kLoss,    // device f32[]    @0    zeros, reusing kX's bytes
  kNumValues
};

/// Instruction indices of the plan below.
enum : int64_t {
  kH2d,
  kFetch,
  kRecord0,
  kWait0,
  kAdd,
  kReshape,
  kRecord1,
  kWait1,
  kD2h,
  kRecord2,
  kWait2,
  kAdamW,
  kZeros,
  kNumInstructions
};

constexpr int64_t kWorkspaceOffset = 96, kWorkspaceSize = 16;
/// The largest offset + size of any device value or workspace.
constexpr int64_t kArenaBytes = kWorkspaceOffset + kWorkspaceSize;

Value makeValue(DType dtype, std::vector<int64_t> shape, Home home,
                int64_t offset = -1) {
  Value v;
  v.type.dtype = dtype;
  v.type.shape = std::move(shape);
  v.home = home;
  v.offset = offset;
  return v;
}

Instruction makeInst(const char *op, Stream stream,
                     std::vector<int64_t> operands = {},
                     std::vector<int64_t> results = {}) {
  Instruction inst;
  inst.op = exec::parseOpCode(op).value();
  inst.stream = stream;
  inst.operands = std::move(operands);
  inst.results = std::move(results);
  return inst;
}

Param makeParam(const char *name, const char *role, const char *of = "") {
  Param p;
  p.name = name;
  p.role = role;
  p.group = "blocks";
  p.layer = 0;
  p.of = of;
  p.type.dtype = DType::F32;
  p.type.shape = {2, 4};
  return p;
}

ExecPlan validPlan() {
  ExecPlan plan;
  plan.model = "hand-built";
  plan.modelConfig = R"({"num_layers": 1, "dim": 4})";
  plan.grid = {1, 2, 2};
  plan.batch = 1;
  plan.arenaBytes = kArenaBytes;
  plan.arenaBudgetBytes = 2 * kArenaBytes;
  plan.alignment = 16;
  plan.plannedLiveBytes = kArenaBytes;
  plan.params = {makeParam("X", "master"),
                 makeParam("X.exp_avg", "moment", "X"),
                 makeParam("X.exp_avg_sq", "moment", "X")};

  plan.values.resize(kNumValues);
  plan.values[kLatents] = makeValue(DType::F32, {2, 4}, Home::Input);
  plan.values[kLatents].name = "latents";
  plan.values[kStep] = makeValue(DType::I64, {}, Home::Input);
  plan.values[kStep].name = "step";
  plan.values[kX] = makeValue(DType::F32, {2, 4}, Home::Device, 0);
  plan.values[kW] = makeValue(DType::F32, {2, 4}, Home::Device, 32);
  plan.values[kSum] = makeValue(DType::F32, {2, 4}, Home::Device, 64);
  plan.values[kFlat] = makeValue(DType::F32, {8}, Home::Device, 64);
  plan.values[kFlat].viewOf = kSum;
  plan.values[kGrad] = makeValue(DType::F32, {8}, Home::Host);
  plan.values[kLoss] = makeValue(DType::F32, {}, Home::Device, 0);
  plan.inputs = {kLatents, kStep};
  plan.outputs = {kLoss};

  plan.instructions.resize(kNumInstructions);
  auto &is = plan.instructions;
  is[kH2d] = makeInst("h2d", Stream::HostToDevice, {kLatents}, {kX});
  is[kH2d].cost.bytes = 32;
  is[kFetch] = makeInst("fetch", Stream::HostToDevice, {}, {kW});
  is[kFetch].param = "X";
  is[kFetch].layer = 0;
  is[kFetch].cost.bytes = 32;
  is[kFetch].cost.sourceBytes = 32;
  is[kRecord0] = makeInst("record", Stream::HostToDevice);
  is[kRecord0].event = 0;
  is[kWait0] = makeInst("wait", Stream::Compute);
  is[kWait0].event = 0;
  is[kAdd] = makeInst("add", Stream::Compute, {kX, kW}, {kSum});
  is[kAdd].layer = 0;
  is[kAdd].workspace = {{kWorkspaceOffset, kWorkspaceSize}};
  is[kAdd].attrs = {{"alpha", 0.5},
                    {"mode", std::string("fast")},
                    {"repeat", int64_t(3)},
                    {"tile", std::vector<int64_t>{2, -4}}};
  is[kAdd].cost.matmulFlops = (uint64_t(1) << 63) + 5; // above INT64_MAX
  is[kAdd].cost.attentionFlops = 7;
  is[kAdd].cost.otherFlops = 8;
  is[kAdd].cost.bytes = 96;
  is[kReshape] = makeInst("reshape", Stream::Compute, {kSum}, {kFlat});
  is[kReshape].attrs = {{"shape", std::vector<int64_t>{8}}};
  is[kRecord1] = makeInst("record", Stream::Compute);
  is[kRecord1].event = 1;
  is[kWait1] = makeInst("wait", Stream::DeviceToHost);
  is[kWait1].event = 1;
  is[kD2h] = makeInst("d2h", Stream::DeviceToHost, {kFlat}, {kGrad});
  is[kRecord2] = makeInst("record", Stream::DeviceToHost);
  is[kRecord2].event = 2;
  is[kWait2] = makeInst("wait", Stream::Host);
  is[kWait2].event = 2;
  is[kAdamW] = makeInst("host_adamw", Stream::Host, {kGrad, kStep});
  is[kAdamW].param = "X";
  is[kAdamW].attrs = {{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.999}};
  is[kZeros] = makeInst("zeros", Stream::Compute, {}, {kLoss});
  plan.numEvents = 3;

  plan.kernelModules = {{"dsa3d_test", "extern \"C\" __global__ void k() {}\n",
                         R"({"kernels": []})"}};
  return plan;
}

std::string errorText(llvm::Expected<ExecPlan> plan) {
  if (plan)
    return "";
  return llvm::toString(plan.takeError());
}

//===----------------------------------------------------------------------===//
// Round trip
//===----------------------------------------------------------------------===//

void expectSameType(const TensorType &a, const TensorType &b,
                    const std::string &what) {
  EXPECT_EQ(a.dtype, b.dtype) << what;
  EXPECT_EQ(a.shape, b.shape) << what;
}

void expectSamePlan(const ExecPlan &a, const ExecPlan &b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.modelConfig, b.modelConfig);
  EXPECT_EQ(a.grid, b.grid);
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.arenaBytes, b.arenaBytes);
  EXPECT_EQ(a.arenaBudgetBytes, b.arenaBudgetBytes);
  EXPECT_EQ(a.alignment, b.alignment);
  EXPECT_EQ(a.plannedLiveBytes, b.plannedLiveBytes);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.outputs, b.outputs);
  EXPECT_EQ(a.numEvents, b.numEvents);

  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const Param &p = a.params[i], &q = b.params[i];
    std::string what = "param " + p.name;
    EXPECT_EQ(p.name, q.name) << what;
    EXPECT_EQ(p.role, q.role) << what;
    EXPECT_EQ(p.group, q.group) << what;
    EXPECT_EQ(p.layer, q.layer) << what;
    EXPECT_EQ(p.of, q.of) << what;
    expectSameType(p.type, q.type, what);
  }

  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t i = 0; i < a.values.size(); ++i) {
    const Value &v = a.values[i], &w = b.values[i];
    std::string what = "value %" + std::to_string(i);
    expectSameType(v.type, w.type, what);
    EXPECT_EQ(v.home, w.home) << what;
    EXPECT_EQ(v.offset, w.offset) << what;
    EXPECT_EQ(v.viewOf, w.viewOf) << what;
    EXPECT_EQ(v.name, w.name) << what;
  }

  ASSERT_EQ(a.instructions.size(), b.instructions.size());
  for (size_t i = 0; i < a.instructions.size(); ++i) {
    const Instruction &x = a.instructions[i], &y = b.instructions[i];
    std::string what = "instruction #" + std::to_string(i);
    EXPECT_EQ(x.op, y.op) << what;
    EXPECT_EQ(x.stream, y.stream) << what;
    EXPECT_EQ(x.operands, y.operands) << what;
    EXPECT_EQ(x.results, y.results) << what;
    EXPECT_EQ(x.attrs, y.attrs) << what;
    EXPECT_EQ(x.layer, y.layer) << what;
    EXPECT_EQ(x.param, y.param) << what;
    EXPECT_EQ(x.event, y.event) << what;
    ASSERT_EQ(x.workspace.size(), y.workspace.size()) << what;
    for (size_t k = 0; k < x.workspace.size(); ++k) {
      EXPECT_EQ(x.workspace[k].offset, y.workspace[k].offset) << what;
      EXPECT_EQ(x.workspace[k].size, y.workspace[k].size) << what;
    }
    EXPECT_EQ(x.cost.matmulFlops, y.cost.matmulFlops) << what;
    EXPECT_EQ(x.cost.attentionFlops, y.cost.attentionFlops) << what;
    EXPECT_EQ(x.cost.otherFlops, y.cost.otherFlops) << what;
    EXPECT_EQ(x.cost.bytes, y.cost.bytes) << what;
    EXPECT_EQ(x.cost.sourceBytes, y.cost.sourceBytes) << what;
  }

  ASSERT_EQ(a.kernelModules.size(), b.kernelModules.size());
  for (size_t i = 0; i < a.kernelModules.size(); ++i) {
    EXPECT_EQ(a.kernelModules[i].name, b.kernelModules[i].name);
    EXPECT_EQ(a.kernelModules[i].source, b.kernelModules[i].source);
    EXPECT_EQ(a.kernelModules[i].manifest, b.kernelModules[i].manifest);
  }
}

TEST(ExecPlan, HandBuiltPlanIsValid) {
  llvm::Error err = validate(validPlan());
  EXPECT_FALSE(bool(err)) << llvm::toString(std::move(err));
}

TEST(ExecPlan, SerializeParseRoundTripsEveryField) {
  ExecPlan plan = validPlan();
  std::string text = serialize(plan);
  llvm::Expected<ExecPlan> back = parseExecPlan(text, "plan.json");
  ASSERT_TRUE(bool(back)) << llvm::toString(back.takeError());
  expectSamePlan(plan, *back);
  // The text is a fixed point.
  EXPECT_EQ(serialize(*back), text);
}

/// JSON has one number type: a float attribute with an integral value is
/// written as an integer and read back as one. Readers take float
/// attributes through floatAttr, which accepts both.
TEST(ExecPlan, IntegralFloatAttributesReadBackThroughFloatAttr) {
  ExecPlan plan = validPlan();
  plan.instructions[kAdd].attrs["scale"] = 2.0;
  ExecPlan back = llvm::cantFail(parseExecPlan(serialize(plan), "plan.json"));
  EXPECT_EQ(back.instructions[kAdd].floatAttr("scale"), 2.0);
  EXPECT_EQ(back.instructions[kAdd].floatAttr("alpha"), 0.5);
  EXPECT_EQ(back.instructions[kAdd].intAttr("repeat"), 3);
  EXPECT_EQ(back.instructions[kAdd].intsAttr("tile"),
            (std::vector<int64_t>{2, -4}));
}

/// A plan whose arena was not checked against a budget (exported without
/// megaslide-check-budget) has no arena_budget_bytes, and reads back so.
TEST(ExecPlan, ArenaBudgetIsOptional) {
  ExecPlan plan = validPlan();
  plan.arenaBudgetBytes.reset();
  std::string text = serialize(plan);
  EXPECT_EQ(text.find("arena_budget_bytes"), std::string::npos) << text;
  ExecPlan back = llvm::cantFail(parseExecPlan(text, "plan.json"));
  EXPECT_FALSE(back.arenaBudgetBytes);
  EXPECT_NE(
      serialize(validPlan())
          .find("\"arena_budget_bytes\":" + std::to_string(2 * kArenaBytes)),
      std::string::npos);
}

TEST(ExecPlanFile, SaveAndLoad) {
  ExecPlan plan = validPlan();
  std::string path = ::testing::TempDir() + "/exec_plan_test.json";
  ASSERT_FALSE(bool(saveExecPlan(plan, path)));
  llvm::Expected<ExecPlan> back = loadExecPlan(path);
  ASSERT_TRUE(bool(back)) << llvm::toString(back.takeError());
  expectSamePlan(plan, *back);
  std::string missing = errorText(loadExecPlan(path + ".missing"));
  EXPECT_NE(missing.find("cannot read execution plan"), std::string::npos)
      << missing;
}

//===----------------------------------------------------------------------===//
// Corruptions
//===----------------------------------------------------------------------===//

using PlanEdit = std::function<void(ExecPlan &)>;
using JsonEdit = std::function<void(llvm::json::Object &)>;

/// The valid plan, changed through the data structure.
std::function<std::string()> viaPlan(PlanEdit edit) {
  return [edit] {
    ExecPlan plan = validPlan();
    edit(plan);
    return serialize(plan);
  };
}

/// The valid plan, changed in its JSON.
std::function<std::string()> viaJson(JsonEdit edit) {
  return [edit] {
    llvm::json::Value root =
        llvm::cantFail(llvm::json::parse(serialize(validPlan())));
    edit(*root.getAsObject());
    std::string text;
    llvm::raw_string_ostream(text) << root;
    return text;
  };
}

llvm::json::Object &valueJson(llvm::json::Object &root, size_t id) {
  return *(*root.getArray("values"))[id].getAsObject();
}

struct Corruption {
  const char *name;
  std::function<std::string()> text;
  const char *expected; ///< a substring of the error
};

const std::vector<Corruption> &corruptions() {
  static const std::vector<Corruption> cases = {
      {"not JSON", [] { return std::string("{\"format\": "); },
       "plan.json: not an execution plan (invalid JSON"},
      {"JSON nested too deep for the parser's stack",
       [] { return std::string(1000000, '[') + std::string(1000000, ']'); },
       "nested more than 256 levels deep"},
      {"JSON nested too deep inside a plan", viaJson([](llvm::json::Object &o) {
         llvm::json::Value v = llvm::json::Array{};
         for (int i = 0; i < 300; ++i)
           v = llvm::json::Array{std::move(v)};
         o["model"] = std::move(v);
       }),
       "nested more than 256 levels deep"},
      {"brackets inside strings do not count as nesting",
       viaJson([](llvm::json::Object &o) {
         o["model"] = std::string(1000, '[') + "\\\"" + std::string(1000, '{');
         o["version"] = kPlanFormatVersion + 1;
       }),
       "recompile the plan"},
      {"JSON but not an object", [] { return std::string("[1, 2]"); },
       "not an execution plan (no \"format\""},
      {"wrong format",
       viaJson([](llvm::json::Object &o) { o["format"] = "some-other-plan"; }),
       "not an execution plan (no \"format\": \"megaslide-exec-plan\")"},
      {"unsupported version",
       viaJson([](llvm::json::Object &o) { o["version"] = 7; }),
       "format version 7 is not supported (this runtime reads 2 to 6; "
       "recompile the plan)"},
      {"version before runtime_version",
       viaJson([](llvm::json::Object &o) { o["version"] = 1; }),
       "format version 1 is not supported (this runtime reads 2 to 6; "
       "recompile the plan)"},
      {"version of the wrong type",
       viaJson([](llvm::json::Object &o) { o["version"] = "2"; }),
       "at plan.version"},
      {"plan of another release",
       viaJson([](llvm::json::Object &o) { o["runtime_version"] = "0.0.1"; }),
       "the plan was compiled for MegaSlide runtime 0.0.1, this is "
       "runtime " MEGASLIDE_VERSION},
      {"plan without its release",
       viaJson([](llvm::json::Object &o) { o.erase("runtime_version"); }),
       "missing value at plan.runtime_version"},
      {"missing required field",
       viaJson([](llvm::json::Object &o) { o.erase("arena_bytes"); }),
       "missing value at plan.arena_bytes"},
      {"arena budget not positive",
       viaPlan([](ExecPlan &p) { p.arenaBudgetBytes = 0; }),
       "invalid execution plan: arena_budget_bytes 0 is not positive"},
      {"arena budget not a number",
       viaJson([](llvm::json::Object &o) { o["arena_budget_bytes"] = "1GB"; }),
       "at plan.arena_budget_bytes"},
      {"missing value field",
       viaJson([](llvm::json::Object &o) { valueJson(o, kW).erase("home"); }),
       "missing value at plan.values[3].home"},
      {"wrong field type", viaJson([](llvm::json::Object &o) {
         valueJson(o, kX)["shape"] = "2x4";
       }),
       "at plan.values[2].shape"},
      {"unknown dtype",
       viaJson([](llvm::json::Object &o) { valueJson(o, kX)["dtype"] = "f8"; }),
       "expected one of bf16, f16, f32, i32, i64 at plan.values[2].dtype"},
      {"unknown op", viaJson([](llvm::json::Object &o) {
         (*(*o.getArray("instructions"))[kAdd].getAsObject())["op"] =
             "frobnicate";
       }),
       "unknown op 'frobnicate' at plan.instructions[4].op"},
      {"op not a name", viaJson([](llvm::json::Object &o) {
         (*(*o.getArray("instructions"))[kAdd].getAsObject())["op"] = 7;
       }),
       "expected the name of an op at plan.instructions[4].op"},
      {"unknown stream", viaJson([](llvm::json::Object &o) {
         (*(*o.getArray("instructions"))[kAdd].getAsObject())["stream"] = "gpu";
       }),
       "at plan.instructions[4].stream"},
      {"attribute of the wrong type", viaJson([](llvm::json::Object &o) {
         (*(*o.getArray("instructions"))[kAdd].getAsObject())["attrs"] =
             llvm::json::Object{{"bad", llvm::json::Object{}}};
       }),
       "at plan.instructions[4].attrs.bad"},
      {"negative dimension", viaPlan([](ExecPlan &p) {
         p.values[kX].type.shape = {2, -4};
       }),
       "value %2: negative dimension -4"},
      {"negative parameter dimension",
       viaPlan([](ExecPlan &p) { p.params[1].type.shape = {-1}; }),
       "parameter 'X.exp_avg': negative dimension -1"},
      {"unknown parameter role",
       viaPlan([](ExecPlan &p) { p.params[0].role = "teacher"; }),
       "parameter 'X' has unknown role 'teacher'"},
      {"moment of an unknown parameter",
       viaPlan([](ExecPlan &p) { p.params[2].of = "Y"; }),
       "parameter 'X.exp_avg_sq' belongs to unknown parameter 'Y'"},
      {"huge shape", viaPlan([](ExecPlan &p) {
         p.values[kX].type.shape = {int64_t(1) << 40, int64_t(1) << 40};
       }),
       "value %2: shape too large"},
      {"huge shape that wraps to zero bytes", viaPlan([](ExecPlan &p) {
         p.values[kGrad].type.shape = {int64_t(1) << 62, 4};
       }),
       "value %6: shape too large"},
      {"rank above 8", viaPlan([](ExecPlan &p) {
         p.values[kX].type.shape = std::vector<int64_t>(9, 1);
       }),
       "value %2: rank 9 is above 8"},
      {"device value past the arena end",
       viaPlan([](ExecPlan &p) { p.values[kSum].offset = kArenaBytes - 16; }),
       "value %4 at offset 96 with 32 bytes does not fit the arena of 112 "
       "bytes"},
      {"device value with an offset near INT64_MAX", viaPlan([](ExecPlan &p) {
         p.values[kSum].offset = std::numeric_limits<int64_t>::max() - 8;
       }),
       "does not fit the arena"},
      {"negative offset",
       viaPlan([](ExecPlan &p) { p.values[kW].offset = -32; }),
       "value %3 at offset -32 with 32 bytes does not fit the arena"},
      {"negative arena", viaPlan([](ExecPlan &p) { p.arenaBytes = -1; }),
       "arena size -1 is out of range"},
      {"view of a later value",
       viaPlan([](ExecPlan &p) { p.values[kFlat].viewOf = kLoss; }),
       "value %5 is a view of %7, which is not an earlier value"},
      {"view of itself",
       viaPlan([](ExecPlan &p) { p.values[kFlat].viewOf = kFlat; }),
       "which is not an earlier value"},
      {"view of a negative id",
       viaPlan([](ExecPlan &p) { p.values[kFlat].viewOf = -3; }),
       "which is not an earlier value"},
      {"view larger than its base",
       viaPlan([](ExecPlan &p) { p.values[kFlat].type.shape = {16}; }),
       "value %5 is a view that does not lie within %4"},
      {"view at another offset than its base",
       viaPlan([](ExecPlan &p) { p.values[kFlat].offset = 80; }),
       "value %5 is a view that does not lie within %4"},
      {"view of a host value",
       viaPlan([](ExecPlan &p) { p.values[kFlat].viewOf = kLatents; }),
       "value %5 is a view but not of a device value"},
      {"operand not yet defined", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].operands = {kX, kSum};
       }),
       "instruction #4 ('add') reads %4, which is out of range or not yet "
       "defined"},
      {"operand out of range", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].operands = {kX, 99};
       }),
       "reads %99, which is out of range"},
      {"result defined twice",
       viaPlan([](ExecPlan &p) { p.instructions[kReshape].results = {kSum}; }),
       "instruction #5 ('reshape') defines %4, which is out of range, an "
       "input or defined twice"},
      {"result that is an input",
       viaPlan([](ExecPlan &p) { p.instructions[kAdd].results = {kLatents}; }),
       "defines %0, which is out of range, an input or defined twice"},
      {"input that is not an input value", viaPlan([](ExecPlan &p) {
         p.inputs = {kLatents, kStep, kX};
       }),
       "input %2 is out of range, repeated, or not an input value"},
      {"event waited before recorded",
       viaPlan([](ExecPlan &p) { p.instructions[kWait0].event = 1; }),
       "instruction #3 ('wait') waits on event 1 before it is recorded"},
      {"event id out of range",
       viaPlan([](ExecPlan &p) { p.instructions[kRecord2].event = 3; }),
       "instruction #9 ('record') names no valid event"},
      {"negative event id",
       viaPlan([](ExecPlan &p) { p.instructions[kWait1].event = -1; }),
       "instruction #7 ('wait') names no valid event"},
      {"record without an event",
       viaPlan([](ExecPlan &p) { p.instructions[kRecord0].event.reset(); }),
       "instruction #2 ('record') names no valid event"},
      {"negative event count", viaPlan([](ExecPlan &p) { p.numEvents = -1; }),
       "event count -1 is out of range"},
      {"event count above the instruction count",
       viaPlan([](ExecPlan &p) { p.numEvents = int64_t(1) << 32; }),
       "event count 4294967296 is out of range (the plan has 13 "
       "instructions)"},
      {"fetch of an unknown parameter",
       viaPlan([](ExecPlan &p) { p.instructions[kFetch].param = "Y"; }),
       "instruction #1 ('fetch'): fetch of unknown parameter 'Y'"},
      {"fetch into another element count",
       viaPlan([](ExecPlan &p) { p.params[0].type.shape = {4}; }),
       "fetch of 'X' into a tensor with another element count"},
      {"host_adamw of a non-master",
       viaPlan([](ExecPlan &p) { p.instructions[kAdamW].param = "X.exp_avg"; }),
       "host_adamw of 'X.exp_avg', which is not a master parameter"},
      {"host_adamw of an unknown parameter",
       viaPlan([](ExecPlan &p) { p.instructions[kAdamW].param = "Z"; }),
       "host_adamw of 'Z', which is not a master parameter"},
      {"host_adamw with a missing moment",
       viaPlan([](ExecPlan &p) { p.params.pop_back(); }),
       "parameter 'X' has 1 AdamW moments, not 2"},
      {"host_adamw with a moment of another role",
       viaPlan([](ExecPlan &p) { p.params[1].role = "frozen"; }),
       "parameter 'X' has 1 AdamW moments, not 2"},
      {"host_adamw with a moment of another element count",
       viaPlan([](ExecPlan &p) {
         p.params[2].type.shape = {2, 2};
       }),
       "host_adamw of 'X' needs a moment 'X.exp_avg_sq' of it with its "
       "element count"},
      {"host_adamw with a misnamed moment",
       viaPlan([](ExecPlan &p) { p.params[1].name = "X.m"; }),
       "host_adamw of 'X' needs a moment 'X.exp_avg' of it"},
      {"host_adamw with a device gradient", viaPlan([](ExecPlan &p) {
         p.instructions[kAdamW].operands = {kFlat, kStep};
       }),
       "host_adamw gradient must be on the host"},
      {"host_adamw with the wrong operand count",
       viaPlan([](ExecPlan &p) { p.instructions[kAdamW].operands = {kGrad}; }),
       "'host_adamw' takes 2 operand(s) and 0 result(s), not 1 and 0"},
      {"h2d between mismatched sizes", viaPlan([](ExecPlan &p) {
         p.values[kLatents].type.shape = {2, 2};
       }),
       "instruction #0 ('h2d'): 'h2d' copies between tensors of different "
       "sizes"},
      {"h2d into a host value", viaPlan([](ExecPlan &p) {
         p.values[kX] = makeValue(DType::F32, {2, 4}, Home::Host);
       }),
       "h2d must copy a host value to a device value"},
      {"d2h between mismatched sizes",
       viaPlan([](ExecPlan &p) { p.values[kGrad].type.dtype = DType::BF16; }),
       "'d2h' copies between tensors of different sizes"},
      {"workspace outside the arena", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].workspace = {{kWorkspaceOffset, 32}};
       }),
       "instruction #4 ('add') has a workspace outside the arena"},
      {"negative workspace", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].workspace = {{-16, 16}};
       }),
       "has a workspace outside the arena"},
      {"workspace over a live device value", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].workspace = {{32, 16}};
       }),
       "instruction #4 ('add') has a workspace over live %3"},
      {"workspaces overlapping each other", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].workspace.push_back({96, 4});
       }),
       "instruction #4 ('add') has workspaces that share arena bytes"},
      {"live device values overlapping",
       viaPlan([](ExecPlan &p) { p.values[kW].offset = 16; }),
       "device values %2 and %3 are live at the same time but share arena "
       "bytes"},
      {"a view's base overlapped while the view is live",
       viaPlan([](ExecPlan &p) {
         // The zeros moves to just after the reshape and into kSum's
         // bytes: kSum itself is last read there, but the d2h still reads
         // it through the view.
         Instruction zeros = p.instructions.back();
         p.instructions.pop_back();
         p.instructions.insert(p.instructions.begin() + kReshape + 1, zeros);
         p.values[kLoss].offset = 64;
       }),
       "device values %4 and %7 are live at the same time"},
      {"alignment not a power of two",
       viaPlan([](ExecPlan &p) { p.alignment = 24; }),
       "alignment 24 is not a power of two"},
      {"alignment zero", viaPlan([](ExecPlan &p) { p.alignment = 0; }),
       "alignment 0 is not a power of two"},
      {"batch zero", viaPlan([](ExecPlan &p) { p.batch = 0; }),
       "batch 0 is not positive"},
      {"duplicate parameter",
       viaPlan([](ExecPlan &p) { p.params.push_back(p.params[0]); }),
       "parameter #3 has an empty or duplicate name"},
      {"d2h with the wrong operand count",
       viaPlan([](ExecPlan &p) { p.instructions[kD2h].operands = {}; }),
       "'d2h' takes 1 operand(s) and 1 result(s), not 0 and 1"},
      {"output never defined", viaPlan([](ExecPlan &p) {
         p.instructions.pop_back(); // the zeros defining the loss
       }),
       "output %7 is never defined"},
      {"output out of range", viaPlan([](ExecPlan &p) { p.outputs = {-1}; }),
       "output %-1 is never defined"},
  };
  return cases;
}

//===----------------------------------------------------------------------===//
// Corruptions the command line refuses (issue 11, item 10): hyper-parameters,
// alignment, event coverage, batch
//===----------------------------------------------------------------------===//

/// The valid plan with one host_adamw attribute set.
std::function<std::string()> withAdamW(const char *name, double value) {
  return viaPlan([name, value](ExecPlan &p) {
    p.instructions[kAdamW].attrs[name] = value;
  });
}

/// The valid plan without instruction `index`.
std::function<std::string()> without(int64_t index) {
  return viaPlan([index](ExecPlan &p) {
    p.instructions.erase(p.instructions.begin() + index);
  });
}

const std::vector<Corruption> &commandLineCorruptions() {
  static const std::vector<Corruption> cases = {
      {"AdamW lr negative", withAdamW("lr", -1),
       "instruction #11 ('host_adamw'): attribute 'lr' must be a positive "
       "number, got -1"},
      {"AdamW lr zero", withAdamW("lr", 0),
       "attribute 'lr' must be a positive number, got 0"},
      {"AdamW beta1 negative", withAdamW("beta1", -1),
       "instruction #11 ('host_adamw'): attribute 'beta1' must be in [0, 1), "
       "got -1"},
      {"AdamW beta2 above one", withAdamW("beta2", 1.5),
       "attribute 'beta2' must be in [0, 1), got 1.5"},
      {"AdamW beta2 of one", withAdamW("beta2", 1),
       "attribute 'beta2' must be in [0, 1), got 1"},
      {"AdamW eps zero", withAdamW("eps", 0),
       "attribute 'eps' must be a positive number, got 0"},
      {"AdamW eps negative", withAdamW("eps", -1e-8),
       "attribute 'eps' must be a positive number, got -1e-08"},
      {"AdamW weight decay negative", withAdamW("weight_decay", -0.01),
       "attribute 'weight_decay' must be a non-negative number, got -0.01"},
      {"AdamW lr as an integer", viaPlan([](ExecPlan &p) {
         p.instructions[kAdamW].attrs["lr"] = int64_t(-2);
       }),
       "attribute 'lr' must be a positive number, got -2"},
      {"misaligned device value",
       viaPlan([](ExecPlan &p) { p.values[kW].offset = 40; }),
       "value %3 at offset 40 is not a multiple of the alignment 16"},
      {"misaligned workspace", viaPlan([](ExecPlan &p) {
         p.instructions[kAdd].workspace = {{104, 8}};
       }),
       "instruction #4 ('add') has a workspace at offset 104, not a multiple "
       "of the alignment 16"},
      {"wait for a copy to the device deleted", without(kWait0),
       "instruction #3 ('add') on stream compute reads %2, written by "
       "instruction #0 on stream h2d, without waiting for an event recorded "
       "after that write"},
      {"wait for the compute stream deleted", without(kWait1),
       "instruction #7 ('d2h') on stream d2h reads %5, written by instruction "
       "#5 on stream compute, without waiting"},
      {"wait for the copy to the host deleted", without(kWait2),
       "instruction #10 ('host_adamw') on stream host reads %6, written by "
       "instruction #8 on stream d2h, without waiting"},
      {"event recorded before the write", viaPlan([](ExecPlan &p) {
         std::swap(p.instructions[kFetch], p.instructions[kRecord0]);
       }),
       "instruction #4 ('add') on stream compute reads %3, written by "
       "instruction #2 on stream h2d, without waiting"},
      {"wait on the wrong stream", viaPlan([](ExecPlan &p) {
         p.instructions[kWait2].stream = Stream::Compute;
       }),
       "instruction #11 ('host_adamw') on stream host reads %6, written by "
       "instruction #8 on stream d2h"},
      {"event recorded on another stream than the write",
       viaPlan([](ExecPlan &p) {
         p.instructions[kRecord2].stream = Stream::Compute;
       }),
       "instruction #11 ('host_adamw') on stream host reads %6"},
      {"batch of 10^12", viaPlan([](ExecPlan &p) { p.batch = 1000000000000; }),
       "batch 1000000000000 of 4 tokens per sample is more than 2^31 tokens "
       "per step, the most the planner plans for"},
      {"batch just above the bound",
       viaPlan([](ExecPlan &p) { p.batch = (int64_t(1) << 29) + 1; }),
       "is more than 2^31 tokens per step"},
      {"grid extent zero", viaPlan([](ExecPlan &p) {
         p.grid = {1, 0, 2};
       }),
       "grid extent 0 is not positive"},
      {"grid beyond 2^31 tokens", viaPlan([](ExecPlan &p) {
         p.grid = {int64_t(1) << 20, int64_t(1) << 20, 1};
       }),
       "grid has more than 2^31 tokens"},
  };
  return cases;
}

TEST(ExecPlanCorruption, WhatTheCommandLineRefusesThePlanLoaderRefuses) {
  for (const Corruption &c : commandLineCorruptions()) {
    SCOPED_TRACE(c.name);
    std::string message = errorText(parseExecPlan(c.text(), "plan.json"));
    if (message.empty()) {
      ADD_FAILURE() << "accepted";
      continue;
    }
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "message: " << message;
    EXPECT_EQ(message.rfind("plan.json: invalid execution plan: ", 0), 0u)
        << message;
  }
}

/// JSON cannot spell nan; a plan built in code can.
TEST(ExecPlanCorruption, NonFiniteHyperParametersAreRefused) {
  for (const char *name : {"lr", "beta1", "beta2", "eps", "weight_decay"}) {
    SCOPED_TRACE(name);
    ExecPlan plan = validPlan();
    plan.instructions[kAdamW].attrs[name] = std::nan("");
    std::string message = llvm::toString(validate(plan));
    EXPECT_NE(message.find("attribute '" + std::string(name) + "' must be"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("got nan"), std::string::npos) << message;
  }
  ExecPlan plan = validPlan();
  plan.instructions[kAdamW].attrs["lr"] = HUGE_VAL;
  EXPECT_NE(llvm::toString(validate(plan)).find("got inf"), std::string::npos);
}

TEST(ExecPlanCorruption, EventCoverageFollowsWaitsTransitively) {
  // The d2h no longer waits for the compute stream itself: the h2d stream
  // waits for it and the d2h stream for an event the h2d stream records
  // after that wait. Ordered, so valid.
  ExecPlan plan = validPlan();
  auto &is = plan.instructions;
  is[kWait1].stream = Stream::HostToDevice;
  Instruction record = makeInst("record", Stream::HostToDevice);
  record.event = 3;
  Instruction wait = makeInst("wait", Stream::DeviceToHost);
  wait.event = 3;
  is.insert(is.begin() + kWait1 + 1, {record, wait});
  plan.numEvents = 4;
  llvm::Error err = validate(plan);
  EXPECT_FALSE(bool(err)) << llvm::toString(std::move(err));

  // Without the h2d stream's wait the chain is broken.
  plan.instructions.erase(plan.instructions.begin() + kWait1);
  std::string message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("('d2h') on stream d2h reads %5, written by "
                         "instruction #5 on stream compute"),
            std::string::npos)
      << message;
}

TEST(ExecPlanCorruption, BoundsTheCommandLineAcceptsAreAccepted) {
  ExecPlan plan = validPlan();
  plan.batch = int64_t(1) << 29; // 4 tokens per sample: exactly 2^31
  plan.instructions[kAdamW].attrs = {{"lr", 1e-300},
                                     {"beta1", 0.0},
                                     {"beta2", 0.999999},
                                     {"eps", 1e-300},
                                     {"weight_decay", 0.0}};
  llvm::Error err = validate(plan);
  EXPECT_FALSE(bool(err)) << llvm::toString(std::move(err));
}

TEST(HyperParameters, OneRuleForFlagsConfigsAndPlans) {
  struct Case {
    const char *name;
    double value;
    const char *problem; ///< nullptr: valid
  };
  const Case cases[] = {
      {"lr", 1e-4, nullptr},
      {"lr", 1e30, nullptr},
      {"lr", 0, "must be a positive number, got 0"},
      {"lr", -1, "must be a positive number, got -1"},
      {"lr", HUGE_VAL, "must be a positive number, got inf"},
      {"lr", std::nan(""), "must be a positive number, got nan"},
      {"beta1", 0, nullptr},
      {"beta1", 0.9, nullptr},
      {"beta1", -1, "must be in [0, 1), got -1"},
      {"beta2", 1, "must be in [0, 1), got 1"},
      {"beta2", 1.5, "must be in [0, 1), got 1.5"},
      {"beta2", std::nan(""), "must be in [0, 1), got nan"},
      {"eps", 1e-8, nullptr},
      {"eps", 0, "must be a positive number, got 0"},
      {"eps", -1e-8, "must be a positive number, got -1e-08"},
      {"weight_decay", 0, nullptr},
      {"weight_decay", 0.1, nullptr},
      {"weight_decay", -0.1, "must be a non-negative number, got -0.1"},
      {"weight_decay", HUGE_VAL, "must be a non-negative number, got inf"},
      {"momentum", 0.9, "is not an AdamW hyper-parameter"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(std::string(c.name) + " = " + std::to_string(c.value));
    std::optional<std::string> problem =
        checkAdamWHyperParameter(c.name, c.value);
    if (!c.problem)
      EXPECT_FALSE(problem) << *problem;
    else
      EXPECT_EQ(problem.value_or("(valid)"), c.problem);
  }
}

TEST(ExecPlanCorruption, EachGivesAnErrorNamingTheProblem) {
  for (const Corruption &c : corruptions()) {
    SCOPED_TRACE(c.name);
    std::string message = errorText(parseExecPlan(c.text(), "plan.json"));
    ASSERT_FALSE(message.empty()) << "accepted";
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "message: " << message;
    // Every error names the source.
    EXPECT_EQ(message.rfind("plan.json: ", 0), 0u) << message;
  }
}

/// validate itself, without the JSON, reports the same problems.
TEST(ExecPlanCorruption, ValidateRejectsWhatTheLoaderRejects) {
  ExecPlan plan = validPlan();
  plan.values[kW].offset = 16;
  std::string message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("invalid execution plan: device values %2 and %3"),
            std::string::npos)
      << message;
  plan = validPlan();
  plan.version = 0;
  message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("recompile the plan"), std::string::npos) << message;
}

/// One value's dtype edited by hand (bf16 -> f32 in a saved plan) still
/// fits the arena, so only the ops' typing rule shows it: a graph op
/// computes in one floating-point type, and a copy keeps the type.
TEST(ExecPlanCorruption, DTypesFollowTheOpsTypingRule) {
  ExecPlan plan = validPlan();
  plan.values[kW].type.dtype = DType::BF16;
  std::string message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("instruction #4 ('add'): operand %3 is bf16 but "
                         "operand %2 is f32; 'add' computes in one "
                         "floating-point type (only 'cast' converts)"),
            std::string::npos)
      << message;
  plan = validPlan();
  plan.values[kSum].type.dtype = DType::BF16;
  plan.values[kFlat].type.dtype = DType::BF16;
  message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("result %4 is bf16 but operand %2 is f32"),
            std::string::npos)
      << message;
  // Same bytes, another type: the copy would reinterpret the bits.
  plan = validPlan();
  plan.values[kGrad].type = {DType::F16, {16}};
  message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("'d2h' copies %5 (f32) into %6 (f16): a copy keeps "
                         "the type"),
            std::string::npos)
      << message;
  plan = validPlan();
  plan.values[kW].type.dtype = DType::I32;
  message = llvm::toString(validate(plan));
  EXPECT_NE(message.find("fetch result %3 is i32, not a floating-point type"),
            std::string::npos)
      << message;
}

//===----------------------------------------------------------------------===//
// Random mutations
//===----------------------------------------------------------------------===//

/// Where numbers start in `text` (a digit or a minus sign not preceded by a
/// digit, letter or dot).
std::vector<size_t> numberStarts(const std::string &text) {
  std::vector<size_t> starts;
  for (size_t i = 0; i < text.size(); ++i) {
    bool startsNumber = std::isdigit(static_cast<unsigned char>(text[i])) ||
                        (text[i] == '-' && i + 1 < text.size() &&
                         std::isdigit(static_cast<unsigned char>(text[i + 1])));
    bool inWord =
        i > 0 && (std::isalnum(static_cast<unsigned char>(text[i - 1])) ||
                  text[i - 1] == '.' || text[i - 1] == '-');
    if (startsNumber && !inWord)
      starts.push_back(i);
  }
  return starts;
}

std::string mutate(const std::string &valid, std::mt19937_64 &rng) {
  static const char *const kNumbers[] = {"-1",
                                         "0",
                                         "1",
                                         "-9223372036854775808",
                                         "9223372036854775807",
                                         "4611686018427387904",
                                         "281474976710656",
                                         "4294967296",
                                         "65536",
                                         "18446744073709551615",
                                         "99999999999999999999999",
                                         "1e308",
                                         "-1e308",
                                         "0.5",
                                         "-0",
                                         "3",
                                         "7",
                                         "112",
                                         "113",
                                         "96"};
  std::string text = valid;
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  int edits = 1 + pick(3);
  for (int e = 0; e < edits && !text.empty(); ++e) {
    switch (pick(5)) {
    case 0: // flip a bit
      text[pick(text.size())] ^= static_cast<char>(1u << pick(8));
      break;
    case 1: // insert a byte
      text.insert(text.begin() + pick(text.size() + 1),
                  "{}[],:\"-0123456789e."[pick(20)]);
      break;
    case 2: // delete a byte
      text.erase(pick(text.size()), 1);
      break;
    default: { // replace a number
      std::vector<size_t> starts = numberStarts(text);
      if (starts.empty())
        break;
      size_t begin = starts[pick(starts.size())], end = begin + 1;
      while (end < text.size() &&
             (std::isdigit(static_cast<unsigned char>(text[end])) ||
              text[end] == '.' || text[end] == 'e' || text[end] == '+' ||
              text[end] == '-'))
        ++end;
      text.replace(begin, end - begin, kNumbers[pick(std::size(kNumbers))]);
      break;
    }
    }
  }
  return text;
}

TEST(ExecPlanMutation, NeverCrashesAndAcceptedPlansStayValid) {
  const std::string valid = serialize(validPlan());
  std::mt19937_64 rng(20240611);
  int accepted = 0, rejected = 0, invalid = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string text = mutate(valid, rng);
    llvm::Expected<ExecPlan> plan = parseExecPlan(text, "mutant.json");
    if (!plan) {
      std::string message = llvm::toString(plan.takeError());
      ASSERT_EQ(message.rfind("mutant.json: ", 0), 0u) << message;
      ++rejected;
      invalid += message.find("invalid execution plan") != std::string::npos;
      continue;
    }
    ++accepted;
    // What the loader accepts, the rest of the runtime may rely on.
    Liveness live = computeLiveness(*plan);
    ASSERT_EQ(live.def.size(), plan->values.size());
    ASSERT_EQ(live.liveBytes.size(), plan->instructions.size());
    llvm::Expected<ExecPlan> again =
        parseExecPlan(serialize(*plan), "mutant.json");
    ASSERT_TRUE(bool(again))
        << llvm::toString(again.takeError()) << "\nmutant: " << text;
  }
  // All outcomes occur: the mutations reach the validator, not only the
  // JSON parser.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, invalid);
  EXPECT_GT(invalid, 0);
  RecordProperty("accepted", accepted);
  RecordProperty("invalid", invalid);
}

//===----------------------------------------------------------------------===//
// Liveness
//===----------------------------------------------------------------------===//

TEST(ExecPlanLiveness, IntervalsOfTheHandBuiltPlan) {
  ExecPlan plan = validPlan();
  Liveness live = computeLiveness(plan);
  // Inputs are live from the start to their last reader.
  EXPECT_EQ(live.def[kLatents], 0);
  EXPECT_EQ(live.lastUse[kLatents], kH2d);
  EXPECT_EQ(live.def[kStep], 0);
  EXPECT_EQ(live.lastUse[kStep], kAdamW);
  EXPECT_EQ(live.def[kX], kH2d);
  EXPECT_EQ(live.lastUse[kX], kAdd);
  EXPECT_EQ(live.def[kW], kFetch);
  EXPECT_EQ(live.lastUse[kW], kAdd);
  // The view's readers (reshape defines it, d2h reads it) keep its base
  // live; the view itself owns no bytes.
  EXPECT_EQ(live.def[kSum], kAdd);
  EXPECT_EQ(live.lastUse[kSum], kD2h);
  EXPECT_EQ(live.def[kFlat], kReshape);
  EXPECT_EQ(live.lastUse[kFlat], -1);
  EXPECT_EQ(live.def[kGrad], kD2h);
  EXPECT_EQ(live.lastUse[kGrad], kAdamW);
  // Outputs are live to the end.
  EXPECT_EQ(live.def[kLoss], kZeros);
  EXPECT_EQ(live.lastUse[kLoss], kNumInstructions - 1);

  EXPECT_EQ(live.deviceBuffers, (std::vector<int64_t>{kX, kW, kSum, kLoss}));
  //                         h2d fetch rec wait add+ws reshape ... d2h ...
  std::vector<int64_t> expected = {
      32, 64, 64, 64, 96 + kWorkspaceSize, 32, 32, 32, 32, 0, 0, 0, 4};
  EXPECT_EQ(live.liveBytes, expected);
  EXPECT_EQ(live.peakLiveBytes, 96 + kWorkspaceSize);
}

TEST(ExecPlanLiveness, ViewKeepsItsBaseLive) {
  ExecPlan plan = validPlan();
  // The d2h reads only the view, yet kSum lives to it; without that read
  // kSum dies at the reshape that makes the view.
  ASSERT_EQ(plan.instructions[kD2h].operands, std::vector<int64_t>{kFlat});
  EXPECT_EQ(computeLiveness(plan).lastUse[kSum], kD2h);
  plan.instructions[kD2h] = makeInst("record", Stream::DeviceToHost);
  EXPECT_EQ(computeLiveness(plan).lastUse[kSum], kReshape);
}

TEST(ExecPlanLiveness, PeakIncludesWorkspace) {
  ExecPlan plan = validPlan();
  EXPECT_EQ(computeLiveness(plan).peakLiveBytes, 96 + kWorkspaceSize);
  plan.instructions[kAdd].workspace.push_back({0, 1000});
  EXPECT_EQ(computeLiveness(plan).liveBytes[kAdd], 96 + kWorkspaceSize + 1000);
  plan.instructions[kAdd].workspace.clear();
  EXPECT_EQ(computeLiveness(plan).peakLiveBytes, 96);
}

//===----------------------------------------------------------------------===//
// The op vocabulary (plan/Ops.def)
//===----------------------------------------------------------------------===//

TEST(ExecPlanOps, NamesDecodeToTheirOp) {
  std::set<std::string> names;
  for (exec::OpCode op : exec::kAllOpCodes) {
    EXPECT_EQ(exec::parseOpCode(exec::opName(op)), op) << exec::opName(op);
    EXPECT_TRUE(names.insert(exec::opName(op)).second) << exec::opName(op);
  }
  EXPECT_EQ(names.size(), exec::kNumOpCodes);
  EXPECT_EQ(exec::parseOpCode("frobnicate"), std::nullopt);
  // The IR name, with its dialect prefix, is not a plan name.
  EXPECT_EQ(exec::parseOpCode("megaslide.linear"), std::nullopt);
}

//===----------------------------------------------------------------------===//
// The cpu backend on hand-built plans
//===----------------------------------------------------------------------===//

TEST(ExecPlanCpuBackend, EveryGraphOpHasAKernel) {
  // Ops.def lists what plans may carry (generated from the dialects' op
  // definitions); the cpu backend runs all of it.
  for (exec::OpCode op : exec::kAllOpCodes)
    EXPECT_EQ(cpu::findGraphKernel(op) != nullptr, !exec::isScheduleOp(op))
        << exec::opName(op);
}

TEST(ExecPlanCpuBackend, RunsTheValidPlanInItsPlannedArena) {
  ExecPlan plan = validPlan();
  std::unique_ptr<cpu::CpuBackend> backend =
      llvm::cantFail(cpu::CpuBackend::create(plan));
  host::HostState state = host::initHostState(plan, /*seed=*/7);
  std::vector<float> master = state.find("X")->data;

  std::vector<float> latents = {1, -2, 3, -4, 0.5f, 0.25f, -8, 16};
  std::vector<float> gradient;
  StepOptions options;
  options.onGradient = [&](llvm::StringRef name, llvm::ArrayRef<float> g) {
    EXPECT_EQ(name, "X");
    gradient.assign(g.begin(), g.end());
  };
  llvm::Expected<StepResult> result =
      backend->step({{"latents", latents}}, state, options);
  ASSERT_TRUE(bool(result)) << llvm::toString(result.takeError());

  EXPECT_EQ(result->loss, 0.0f);
  EXPECT_EQ(result->memory.plannedArenaBytes, kArenaBytes);
  EXPECT_EQ(result->memory.measuredArenaBytes,
            result->memory.plannedArenaBytes);
  EXPECT_EQ(result->memory.measuredLiveBytes,
            computeLiveness(plan).peakLiveBytes);

  // The gradient reached the host through the add, the view and the d2h.
  ASSERT_EQ(gradient.size(), 8u);
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(gradient[i], latents[i] + master[i]) << i;
  // One AdamW step on it: m = (1 - beta1) g.
  EXPECT_EQ(state.step, 1);
  const host::HostTensor *m = state.expAvg("X");
  ASSERT_NE(m, nullptr);
  for (size_t i = 0; i < 8; ++i)
    EXPECT_NEAR(m->data[i], 0.1f * gradient[i], 1e-6f) << i;
  EXPECT_NE(state.find("X")->data, master);
}

// Tests that a non-finite gradient stops the step before its update, names
// the parameter and the global step, and that the moments and master of
// that parameter stay as they were.
TEST(ExecPlanCpuBackend, NonFiniteGradientStopsBeforeItsUpdate) {
  ExecPlan plan = validPlan();
  std::unique_ptr<cpu::CpuBackend> backend =
      llvm::cantFail(cpu::CpuBackend::create(plan));
  host::HostState state = host::initHostState(plan, /*seed=*/7);
  state.step = 41; // as after a resume
  std::vector<float> master = state.find("X")->data;
  std::vector<float> latents = {1, 2, 3, std::nanf(""), 5, 6, 7, 8};
  llvm::Expected<StepResult> result =
      backend->step({{"latents", latents}}, state, {});
  ASSERT_FALSE(bool(result));
  std::string message = llvm::toString(result.takeError());
  EXPECT_NE(message.find("step 42: the gradient of 'X' holds nan at "
                         "element 3"),
            std::string::npos)
      << message;
  EXPECT_EQ(state.step, 41);
  EXPECT_EQ(state.find("X")->data, master);
  for (float m : state.expAvg("X")->data)
    EXPECT_EQ(m, 0.0f);
}

//===----------------------------------------------------------------------===//
// Deferred updates
//===----------------------------------------------------------------------===//

/// The valid plan with its update deferred, as megaslide-defer-updates
/// marks it: the host_adamw retains, the fetch applies the update.
ExecPlan deferredPlan() {
  ExecPlan plan = validPlan();
  setDeferredUpdates(plan, /*deferred=*/true);
  return plan;
}

/// A second fetch of X at the end of the step, unmarked, into bytes no
/// live value holds by then.
Instruction &appendFetch(ExecPlan &plan) {
  Instruction again = plan.instructions[kFetch];
  again.attrs.clear();
  plan.values.push_back(makeValue(DType::F32, {2, 4}, Home::Device, 32));
  again.results = {static_cast<int64_t>(plan.values.size() - 1)};
  plan.instructions.push_back(again);
  return plan.instructions.back();
}

std::string validationError(const ExecPlan &plan) {
  llvm::Error err = validate(plan);
  return err ? llvm::toString(std::move(err)) : "";
}

// Tests that setDeferredUpdates marks the host_adamw and the first fetch
// of its parameter, makes the plan version 3, and that the marks survive
// a round trip as unit attributes backends test with hasAttr.
TEST(ExecPlanDeferredUpdates, MarkedPlanIsValidAndRoundTrips) {
  ExecPlan plan = deferredPlan();
  EXPECT_EQ(plan.version, kDeferredUpdateFormatVersion);
  EXPECT_TRUE(plan.instructions[kAdamW].hasAttr(kDeferredAttr));
  EXPECT_TRUE(plan.instructions[kFetch].hasAttr(kAppliesUpdateAttr));
  EXPECT_FALSE(plan.instructions[kAdd].hasAttr(kDeferredAttr));
  EXPECT_TRUE(plan.defersUpdates());
  EXPECT_EQ(validationError(plan), "");
  ExecPlan back = llvm::cantFail(parseExecPlan(serialize(plan), "plan.json"));
  expectSamePlan(plan, back);
  EXPECT_NE(back.instructions[kFetch].attr("applies_update"), nullptr);
  EXPECT_NE(back.instructions[kAdamW].attr("deferred"), nullptr);

  // Unmarked again, it is the version 2 plan it was.
  setDeferredUpdates(plan, /*deferred=*/false);
  EXPECT_EQ(plan.version, kOldestPlanFormatVersion);
  EXPECT_EQ(serialize(plan), [] {
    ExecPlan p = validPlan();
    p.version = kOldestPlanFormatVersion;
    return serialize(p);
  }());
}

// Tests that the exact GELU's attribute makes a plan version 4, and that it
// is refused on any op but gelu and gelu_grad and in an older plan.
TEST(ExecPlanExactGelu, NeedsVersion4AndAGelu) {
  ExecPlan plan = validPlan();
  EXPECT_EQ(plan.oldestVersion(), kOldestPlanFormatVersion);
  plan.instructions[kAdd].attrs[std::string(kExactAttr)] = int64_t(1);
  EXPECT_TRUE(plan.hasExactGelu());
  EXPECT_EQ(plan.oldestVersion(), kExactGeluFormatVersion);
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: instruction #4 ('add'): attribute "
            "'exact' is for gelu and gelu_grad only");
  plan.instructions[kAdd].op = OpCode::Gelu;
  plan.instructions[kAdd].operands.resize(1);
  plan.version = kDeferredUpdateFormatVersion;
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: instruction #4 ('gelu') runs the exact "
            "GELU, which format version 4 introduced, but the plan says "
            "version 3");
}

// Tests that a weighted loss (the fourth operand of the loss's ops) makes a
// plan version 5, and that an older plan with one is refused.
TEST(ExecPlanWeightedLoss, NeedsVersion5) {
  ExecPlan plan = validPlan();
  Instruction &loss = plan.instructions[kAdd];
  loss.op = OpCode::FlowMatchingLossGrad;
  loss.attrs.clear();
  loss.operands = {kX, kW, kW};
  EXPECT_FALSE(plan.hasWeightedLoss());
  EXPECT_EQ(plan.oldestVersion(), kOldestPlanFormatVersion);
  loss.operands.push_back(kW);
  EXPECT_TRUE(plan.hasWeightedLoss());
  EXPECT_EQ(plan.oldestVersion(), kWeightedLossFormatVersion);
  plan.version = kWeightedLossFormatVersion;
  EXPECT_EQ(validationError(plan), "");
  plan.version = kExactGeluFormatVersion;
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: instruction #4 "
            "('flow_matching_loss_grad') weights the loss per sample, which "
            "format version 5 introduced, but the plan says version 4");
}

// Tests that an NVMe tier makes a plan version 6, round-trips through the
// file, and that an older plan with one, an unknown role or no window is
// refused.
TEST(ExecPlanNvmeTier, NeedsVersion6) {
  ExecPlan plan = validPlan();
  EXPECT_EQ(plan.oldestVersion(), kOldestPlanFormatVersion);
  plan.tierRoles = {"moment", "ema"};
  plan.tierWindowBytes = 1 << 20;
  plan.tierDrives = 2;
  EXPECT_EQ(plan.oldestVersion(), kNvmeTierFormatVersion);
  plan.version = kNvmeTierFormatVersion;
  EXPECT_EQ(validationError(plan), "");
  llvm::Expected<ExecPlan> back = parseExecPlan(serialize(plan), "tier.json");
  ASSERT_TRUE(static_cast<bool>(back)) << llvm::toString(back.takeError());
  EXPECT_EQ(back->tierRoles, plan.tierRoles);
  EXPECT_EQ(back->tierWindowBytes, plan.tierWindowBytes);
  EXPECT_EQ(back->tierDrives, plan.tierDrives);
  plan.version = kWeightedLossFormatVersion;
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: host_tier, which format version 6 "
            "introduced, but the plan says version 5");
  plan.version = kNvmeTierFormatVersion;
  plan.tierRoles = {"master"};
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: host_tier role 'master' is not one the "
            "NVMe tier holds (moment, ema)");
  plan.tierRoles = {"moment"};
  plan.tierDrives = 0;
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: host_tier drives 0 is not in [1, 64]");
  plan.tierDrives = 2;
  plan.tierWindowBytes = 0;
  EXPECT_EQ(validationError(plan), "invalid execution plan: host_tier "
                                   "window_bytes 0 is out of range");
}

// Tests that int8 or factored moments (host_state) make a plan version 6,
// that an older plan with them is refused and an unknown one named.
TEST(ExecPlanHostState, NeedsVersion6) {
  ExecPlan plan = validPlan();
  EXPECT_EQ(plan.oldestVersion(), kOldestPlanFormatVersion);
  plan.hostState = std::string(kInt8Moments);
  EXPECT_EQ(plan.oldestVersion(), kHostStateFormatVersion);
  plan.version = kHostStateFormatVersion;
  EXPECT_EQ(validationError(plan), "");
  plan.version = kWeightedLossFormatVersion;
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: host_state 'int8-moments', which format "
            "version 6 introduced, but the plan says version 5");
  plan.version = kHostStateFormatVersion;
  plan.hostState = "int4-moments";
  EXPECT_EQ(validationError(plan),
            "invalid execution plan: host_state 'int4-moments' is not "
            "int8-moments or factored-moments");
}

// Tests that a persistent bf16 copy's fetch applies its master's update.
TEST(ExecPlanDeferredUpdates, CopyFetchAppliesItsMastersUpdate) {
  ExecPlan plan = validPlan();
  plan.params.push_back(makeParam("X.bf16", "weight", "X"));
  plan.instructions[kFetch].param = "X.bf16";
  setDeferredUpdates(plan, /*deferred=*/true);
  EXPECT_TRUE(plan.instructions[kFetch].hasAttr(kAppliesUpdateAttr));
  EXPECT_EQ(validationError(plan), "");
  EXPECT_EQ(plan.updatedParam("X.bf16"), plan.findParam("X"));
  EXPECT_EQ(plan.updatedParam("X.exp_avg"), nullptr);
}

// Tests that each broken pairing of deferred updates and the fetches that
// apply them is refused, naming the instruction.
TEST(ExecPlanDeferredUpdates, BrokenPairingsAreRefused) {
  struct Case {
    const char *name;
    std::function<void(ExecPlan &)> corrupt;
    const char *expected;
  };
  const Case cases[] = {
      {"deferred update no fetch applies",
       [](ExecPlan &p) {
         p.instructions[kFetch].attrs.erase(std::string(kAppliesUpdateAttr));
       },
       "instruction #11 ('host_adamw') defers the update of 'X', but no "
       "fetch applies it ('applies_update')"},
      {"fetch applies an update nobody defers",
       [](ExecPlan &p) {
         p.instructions[kAdamW].attrs.erase(std::string(kDeferredAttr));
         p.version = kDeferredUpdateFormatVersion;
       },
       "instruction #1 ('fetch') applies the update of 'X', which no "
       "deferred host_adamw makes"},
      {"two fetches apply one update",
       [](ExecPlan &p) {
         auto marked = p.instructions[kFetch].attrs;
         appendFetch(p).attrs = marked;
       },
       "instruction #13 ('fetch') applies the update of 'X', which "
       "instruction #1 ('fetch') applies already"},
      {"mixed deferred and streaming updates",
       [](ExecPlan &p) {
         Instruction streaming = p.instructions[kAdamW];
         streaming.attrs.erase(std::string(kDeferredAttr));
         p.instructions.push_back(streaming);
       },
       "instruction #13 ('host_adamw') of 'X' is not deferred but "
       "instruction #11 ('host_adamw') is: a plan defers every update or "
       "none"},
      {"deferred in a version 2 plan",
       [](ExecPlan &p) { p.version = kOldestPlanFormatVersion; },
       "instruction #11 ('host_adamw') is deferred, which format version 3 "
       "introduced, but the plan says version 2"},
      {"deferred on another op",
       [](ExecPlan &p) { p.instructions[kAdd].attrs["deferred"] = int64_t(1); },
       "instruction #4 ('add'): attribute 'deferred' is for host_adamw only"},
      {"a unit attribute that is not 1",
       [](ExecPlan &p) {
         p.instructions[kFetch].attrs["applies_update"] = int64_t(0);
       },
       "instruction #1 ('fetch'): attribute 'applies_update' is a unit "
       "attribute and must be 1"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.name);
    ExecPlan plan = deferredPlan();
    c.corrupt(plan);
    std::string message = validationError(plan);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "message: " << message;
  }
}

// Tests that a fetch applying an update must be the parameter's first in
// the step: an earlier fetch would read the weights before their update.
TEST(ExecPlanDeferredUpdates, TheApplyingFetchIsTheFirst) {
  ExecPlan plan = deferredPlan();
  appendFetch(plan);
  EXPECT_EQ(validationError(plan), "");
  // The mark moved onto the second fetch.
  plan.instructions[kFetch].attrs.clear();
  plan.instructions.back().attrs.emplace(kAppliesUpdateAttr.str(), int64_t(1));
  std::string message = validationError(plan);
  EXPECT_NE(message.find("instruction #13 ('fetch') applies the update of "
                         "'X', but instruction #1 ('fetch') fetches it "
                         "earlier in the step and would read it stale"),
            std::string::npos)
      << message;
}

} // namespace
