//===- Validate.cpp - What a backend may rely on in a plan ----------------===//
//
// validate() runs named checks in order, each relying on the ones before
// it (ids in range, views of earlier values, events in range), and stops
// at the first error, which names what is wrong and where.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/plan/Validate.h"
#include "megaslide/runtime/plan/HyperParameters.h"
#include "megaslide/runtime/plan/Liveness.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/Twine.h"

#include <array>
#include <string>

using namespace megaslide;
using namespace megaslide::exec;

namespace {
/// Collects the first error of a validation walk with its location.
struct Checker {
  std::string error;
  bool fail(const llvm::Twine &msg) {
    if (error.empty())
      error = msg.str();
    return false;
  }
};

/// Largest tensor a plan may describe: 2^48 bytes (far above any host).
constexpr int64_t kMaxTensorBytes = int64_t(1) << 48;
} // namespace

static bool checkType(Checker &c, const TensorType &t,
                      const llvm::Twine &what) {
  if (t.shape.size() > 8)
    return c.fail(what + ": rank " + llvm::Twine(t.shape.size()) +
                  " is above 8");
  int64_t elements = 1;
  for (int64_t d : t.shape) {
    if (d < 0)
      return c.fail(what + ": negative dimension " + llvm::Twine(d));
    if (d != 0 && elements > kMaxTensorBytes / d)
      return c.fail(what + ": shape too large");
    elements *= d;
  }
  if (elements > kMaxTensorBytes / dtypeBytes(t.dtype))
    return c.fail(what + ": shape too large");
  return true;
}

/// The attributes the backends read, by kind. A plan that gives one the
/// wrong kind (`"lr": "1e-4"`) is rejected here, once for every backend,
/// rather than read as absent and replaced by a default.
static bool checkAttrs(Checker &c, const Instruction &inst,
                       const llvm::Twine &where) {
  enum class Kind { Number, Int, Ints, Unit };
  static const llvm::StringMap<Kind> kinds = {{"scale", Kind::Number},
                                              {"lr", Kind::Number},
                                              {"beta1", Kind::Number},
                                              {"beta2", Kind::Number},
                                              {"eps", Kind::Number},
                                              {"weight_decay", Kind::Number},
                                              {"theta", Kind::Number},
                                              {"max_period", Kind::Number},
                                              {"time_scale", Kind::Number},
                                              {"radius", Kind::Int},
                                              {"inverse", Kind::Int},
                                              {"grid", Kind::Ints},
                                              {"window", Kind::Ints},
                                              {"tile", Kind::Ints},
                                              {"patch", Kind::Ints},
                                              {"dims", Kind::Ints},
                                              {"ranks", Kind::Int},
                                              {"nodes", Kind::Int},
                                              {"send_bytes", Kind::Int},
                                              {kDeferredAttr, Kind::Unit},
                                              {kAppliesUpdateAttr, Kind::Unit}};
  for (const auto &[name, value] : inst.attrs) {
    auto it = kinds.find(name);
    if (it == kinds.end())
      continue;
    bool isInt = std::holds_alternative<int64_t>(value);
    switch (it->second) {
    case Kind::Number:
      if (!isInt && !std::holds_alternative<double>(value))
        return c.fail(where + ": attribute '" + name + "' must be a number");
      break;
    case Kind::Int:
      if (!isInt)
        return c.fail(where + ": attribute '" + name + "' must be an integer");
      break;
    case Kind::Ints:
      if (!std::holds_alternative<std::vector<int64_t>>(value))
        return c.fail(where + ": attribute '" + name +
                      "' must be an integer array");
      break;
    case Kind::Unit:
      if (!isInt || std::get<int64_t>(value) != 1)
        return c.fail(where + ": attribute '" + name +
                      "' is a unit attribute and must be 1");
      break;
    }
  }
  return true;
}

/// The AdamW hyper-parameters a host_adamw gives (backends default the
/// absent ones), by the rule flags and configs are held to.
static bool checkHyperParameters(Checker &c, const Instruction &inst,
                                 const llvm::Twine &where) {
  for (const char *name : {"lr", "beta1", "beta2", "eps", "weight_decay"})
    if (std::optional<double> value = inst.floatAttr(name))
      if (std::optional<std::string> problem =
              checkAdamWHyperParameter(name, *value))
        return c.fail(where + ": attribute '" + name + "' " + *problem);
  return true;
}

/// Operand and result counts of the schedule ops; graph ops are checked
/// by the backend that runs them.
static bool checkScheduleOp(Checker &c, const ExecPlan &plan,
                            const Instruction &inst, const llvm::Twine &where) {
  auto counts = [&](size_t operands, size_t results) {
    if (inst.operands.size() == operands && inst.results.size() == results)
      return true;
    return c.fail(where + ": '" + opName(inst.op) + "' takes " +
                  llvm::Twine(operands) + " operand(s) and " +
                  llvm::Twine(results) + " result(s), not " +
                  llvm::Twine(inst.operands.size()) + " and " +
                  llvm::Twine(inst.results.size()));
  };
  auto home = [&](int64_t id) { return plan.values[id].home; };
  auto sameBytes = [&](int64_t a, int64_t b) {
    if (plan.values[a].type.bytes() == plan.values[b].type.bytes())
      return true;
    return c.fail(where + ": '" + opName(inst.op) +
                  "' copies between tensors of different sizes");
  };
  switch (inst.op) {
  case OpCode::Fetch: {
    if (!counts(0, 1))
      return false;
    const Param *p = plan.findParam(inst.param);
    if (!p)
      return c.fail(where + ": fetch of unknown parameter '" + inst.param +
                    "'");
    if (p->type.numElements() !=
        plan.values[inst.results[0]].type.numElements())
      return c.fail(where + ": fetch of '" + inst.param +
                    "' into a tensor with another element count");
    if (home(inst.results[0]) != Home::Device)
      return c.fail(where + ": fetch result is not a device value");
    return true;
  }
  case OpCode::HostToDevice:
    if (!counts(1, 1) || !sameBytes(inst.operands[0], inst.results[0]))
      return false;
    if (home(inst.operands[0]) == Home::Device ||
        home(inst.results[0]) != Home::Device)
      return c.fail(where + ": h2d must copy a host value to a device value");
    return true;
  case OpCode::DeviceToHost:
    if (!counts(1, 1) || !sameBytes(inst.operands[0], inst.results[0]))
      return false;
    if (home(inst.operands[0]) != Home::Device ||
        home(inst.results[0]) != Home::Host)
      return c.fail(where + ": d2h must copy a device value to a host value");
    return true;
  case OpCode::HostAdamW: {
    if (!counts(2, 0))
      return false;
    const Param *p = plan.findParam(inst.param);
    if (!p || p->role != "master")
      return c.fail(where + ": host_adamw of '" + inst.param +
                    "', which is not a master parameter");
    if (p->type.numElements() !=
        plan.values[inst.operands[0]].type.numElements())
      return c.fail(where + ": host_adamw gradient of '" + inst.param +
                    "' has another element count than the parameter");
    if (home(inst.operands[0]) == Home::Device)
      return c.fail(where + ": host_adamw gradient must be on the host");
    int moments = 0;
    for (const Param &q : plan.params)
      moments += q.role == "moment" && q.of == inst.param;
    if (moments != 2)
      return c.fail(where + ": parameter '" + inst.param + "' has " +
                    llvm::Twine(moments) + " AdamW moments, not 2");
    // Backends find the moments by name and update them in step with the
    // master, element by element.
    for (const char *suffix : {".exp_avg", ".exp_avg_sq"}) {
      std::string name = inst.param + suffix;
      const Param *m = plan.findParam(name);
      if (!m || m->role != "moment" || m->of != inst.param ||
          m->type.numElements() != p->type.numElements())
        return c.fail(where + ": host_adamw of '" + inst.param +
                      "' needs a moment '" + name +
                      "' of it with its element count");
    }
    return true;
  }
  case OpCode::AllGather:
  case OpCode::ReduceScatter: {
    if (!counts(1, 1))
      return false;
    const Value &result = plan.values[inst.results[0]];
    if (home(inst.operands[0]) != Home::Device || !result.viewOf ||
        *result.viewOf != inst.operands[0])
      return c.fail(where + ": '" + opName(inst.op) +
                    "' works in place: its result must be a view of its "
                    "device operand");
    const CostInputs &job = inst.cost;
    if (job.ranks < 2 || job.nodes < 1 || job.ranks % job.nodes != 0)
      return c.fail(where + ": '" + opName(inst.op) + "' over " +
                    llvm::Twine(job.ranks) + " ranks on " +
                    llvm::Twine(job.nodes) +
                    " nodes; a collective needs at least 2 ranks, the same "
                    "number on every node");
    return true;
  }
  case OpCode::Record:
  case OpCode::Wait:
    return counts(0, 0);
#define MEGASLIDE_GRAPH_OP(Name, Spelling, Cost, Family) case OpCode::Name:
#include "megaslide/runtime/plan/Ops.def"
    return true;
  }
  return true;
}

static bool isFloatType(DType d) {
  return d == DType::BF16 || d == DType::F16 || d == DType::F32;
}

/// The typing rule of the ops: a graph op other than cast computes in one
/// floating-point type, so its floating operands and results share it
/// (the plan's precision); the exceptions are the fp32 timesteps that
/// timestep_embedding and flow_interpolate read, the fp32 losses of
/// flow_matching_loss, the fp32 per-sample weights of a weighted loss and
/// its gradient (kLossWeightsInput) and the fp32 log-sum-exp dsa3d writes and
/// dsa3d_grad reads. Copies keep the type; fetch and host_adamw convert
/// between the fp32 master and a floating type. Backends widen and narrow
/// by each value's own type, so a plan edited against this rule would run
/// and mix precisions silently.
static bool checkDTypes(Checker &c, const ExecPlan &plan,
                        const Instruction &inst, const llvm::Twine &where) {
  auto dtype = [&](int64_t id) { return plan.values[id].type.dtype; };
  auto floating = [&](int64_t id, llvm::StringRef what) {
    if (isFloatType(dtype(id)))
      return true;
    return c.fail(where + ": " + what + " %" + llvm::Twine(id) + " is " +
                  dtypeName(dtype(id)) + ", not a floating-point type");
  };
  switch (inst.op) {
  case OpCode::HostToDevice:
  case OpCode::DeviceToHost:
    if (dtype(inst.operands[0]) != dtype(inst.results[0]))
      return c.fail(where + ": '" + opName(inst.op) + "' copies %" +
                    llvm::Twine(inst.operands[0]) + " (" +
                    dtypeName(dtype(inst.operands[0])) + ") into %" +
                    llvm::Twine(inst.results[0]) + " (" +
                    dtypeName(dtype(inst.results[0])) +
                    "): a copy keeps the type");
    return true;
  case OpCode::Fetch:
    return floating(inst.results[0], "fetch result");
  case OpCode::HostAdamW:
    return floating(inst.operands[0], "host_adamw gradient");
  case OpCode::Cast:
  case OpCode::Record:
  case OpCode::Wait:
  case OpCode::AllGather:
  case OpCode::ReduceScatter:
    return true;
  default:
    break;
  }
  auto exempt = [&](bool isResult, size_t index) {
    switch (inst.op) {
    case OpCode::TimestepEmbedding:
      return !isResult && index == 0;
    case OpCode::FlowInterpolate:
      return !isResult && index == 2;
    case OpCode::FlowMatchingLoss:
      return isResult || index == 3;
    case OpCode::FlowMatchingLossGrad:
      return !isResult && index == 3;
    case OpCode::Dsa3d: // the fp32 log-sum-exp (docs/Dsa3dKernels.md)
      return isResult && index == 1;
    case OpCode::Dsa3dGrad:
      return !isResult && index == 5;
    default:
      return false;
    }
  };
  std::optional<std::pair<int64_t, llvm::StringRef>> first;
  for (bool isResult : {false, true}) {
    const std::vector<int64_t> &ids = isResult ? inst.results : inst.operands;
    llvm::StringRef what = isResult ? "result" : "operand";
    for (auto [index, id] : llvm::enumerate(ids)) {
      if (!isFloatType(dtype(id)) || exempt(isResult, index))
        continue;
      if (!first) {
        first = {id, what};
        continue;
      }
      if (dtype(id) != dtype(first->first))
        return c.fail(where + ": " + what + " %" + llvm::Twine(id) + " is " +
                      dtypeName(dtype(id)) + " but " + first->second + " %" +
                      llvm::Twine(first->first) + " is " +
                      dtypeName(dtype(first->first)) + "; '" + opName(inst.op) +
                      "' computes in one floating-point type (only 'cast' "
                      "converts)");
    }
  }
  return true;
}

/// What one op needs: its attributes of the right kinds, AdamW's
/// hyper-parameters in range, the schedule ops' operands and results, and
/// every op's types.
static bool checkOp(Checker &c, const ExecPlan &plan, const Instruction &inst,
                    const llvm::Twine &where) {
  return checkAttrs(c, inst, where) &&
         (inst.op != OpCode::HostAdamW ||
          checkHyperParameters(c, inst, where)) &&
         checkScheduleOp(c, plan, inst, where) &&
         checkDTypes(c, plan, inst, where);
}

/// Only the version: a runtime that does not know it reads nothing else.
static bool checkVersion(Checker &c, const ExecPlan &plan) {
  if (plan.version >= kOldestPlanFormatVersion &&
      plan.version <= kPlanFormatVersion)
    return true;
  return c.fail("format version " + llvm::Twine(plan.version) +
                " is not supported (this runtime reads versions " +
                llvm::Twine(kOldestPlanFormatVersion) + " to " +
                llvm::Twine(kPlanFormatVersion) + "; recompile the plan)");
}

/// The plan's scalar fields: the arena, the recipe, the step's size and
/// the event count.
static bool checkPlanFields(Checker &c, const ExecPlan &plan) {
  if (plan.arenaBytes < 0 || plan.arenaBytes > kMaxTensorBytes)
    return c.fail("arena size " + llvm::Twine(plan.arenaBytes) +
                  " is out of range");
  // msched.budget_check's budget is positive.
  if (plan.arenaBudgetBytes && *plan.arenaBudgetBytes <= 0)
    return c.fail("arena_budget_bytes " +
                  llvm::Twine(*plan.arenaBudgetBytes) + " is not positive");
  if (plan.alignment <= 0 || (plan.alignment & (plan.alignment - 1)))
    return c.fail("alignment " + llvm::Twine(plan.alignment) +
                  " is not a power of two");
  if (plan.batch <= 0)
    return c.fail("batch " + llvm::Twine(plan.batch) + " is not positive");
  if (plan.gradAccum < 1 || plan.gradAccum > kMaxGradAccum)
    return c.fail("grad_accum " + llvm::Twine(plan.gradAccum) +
                  " is not in [1, " + llvm::Twine(kMaxGradAccum) + "]");
  if (plan.hasLeanMoments() && plan.hostState != kInt8Moments &&
      plan.hostState != kFactoredMoments)
    return c.fail(llvm::Twine("host_state '") + plan.hostState + "' is not " +
                  kInt8Moments + " or " + kFactoredMoments);
  if (plan.hasLeanMoments() && plan.version < kHostStateFormatVersion)
    return c.fail(
        llvm::Twine("host_state '") + plan.hostState +
        "', which format version " + llvm::Twine(kHostStateFormatVersion) +
        " introduced, but the plan says version " + llvm::Twine(plan.version));
  if (plan.emaDtype != "none" && plan.emaDtype != "f32" &&
      plan.emaDtype != "bf16")
    return c.fail("ema_dtype '" + plan.emaDtype + "' is not none, f32 or bf16");
  if (!plan.tierRoles.empty() && plan.version < kNvmeTierFormatVersion)
    return c.fail("host_tier, which format version " +
                  llvm::Twine(kNvmeTierFormatVersion) +
                  " introduced, but the plan says version " +
                  llvm::Twine(plan.version));
  for (const std::string &role : plan.tierRoles)
    if (!llvm::is_contained(kTierRoles, llvm::StringRef(role)))
      return c.fail("host_tier role '" + role +
                    "' is not one the NVMe tier holds (moment, ema)");
  if (!plan.tierRoles.empty() &&
      (plan.tierWindowBytes <= 0 || plan.tierWindowBytes > kMaxTensorBytes))
    return c.fail("host_tier window_bytes " +
                  llvm::Twine(plan.tierWindowBytes) + " is out of range");
  if (!plan.tierRoles.empty() && (plan.tierDrives < 1 || plan.tierDrives > 64))
    return c.fail("host_tier drives " + llvm::Twine(plan.tierDrives) +
                  " is not in [1, 64]");
  if (plan.gradientBuffers < 1 || plan.gradientBuffers > 64)
    return c.fail("gradient_buffers " + llvm::Twine(plan.gradientBuffers) +
                  " is not in [1, 64]");
  // The planner's bound on a step (ModelBuilder): larger batches could
  // overflow the byte counts of the tensors a backend allocates per sample.
  int64_t gridTokens = 1;
  for (int64_t d : plan.grid) {
    if (d <= 0 || gridTokens > kMaxTokensPerStep / d)
      return c.fail("grid extent " + llvm::Twine(d) +
                    " is not positive or the grid has more than 2^31 tokens");
    gridTokens *= d;
  }
  if (plan.batch > kMaxTokensPerStep / gridTokens)
    return c.fail("batch " + llvm::Twine(plan.batch) + " of " +
                  llvm::Twine(gridTokens) +
                  " tokens per sample is more than 2^31 tokens per step, the "
                  "most the planner plans for");
  // Each event is recorded by an instruction; a larger count would only
  // make the loader and the backends allocate per-event state for nothing.
  if (plan.numEvents < 0 ||
      plan.numEvents > static_cast<int64_t>(plan.instructions.size()))
    return c.fail("event count " + llvm::Twine(plan.numEvents) +
                  " is out of range (the plan has " +
                  llvm::Twine(plan.instructions.size()) + " instructions)");
  return true;
}

/// Parameters: unique names, known roles, types in range, and `of` naming
/// another parameter.
static bool checkParams(Checker &c, const ExecPlan &plan) {
  llvm::StringMap<size_t> paramIndex;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const Param &p = plan.params[i];
    // A std::string: a Twine would point at the destroyed temporary.
    std::string where = "parameter '" + p.name + "'";
    if (p.name.empty() || !paramIndex.try_emplace(p.name, i).second)
      return c.fail("parameter #" + llvm::Twine(i) +
                    " has an empty or duplicate name");
    if (!llvm::is_contained(
            {"master", "moment", "weight", "gradient", "frozen"}, p.role))
      return c.fail(where + " has unknown role '" + p.role + "'");
    if (!checkType(c, p.type, where))
      return false;
  }
  for (const Param &p : plan.params)
    if (!p.of.empty() && !paramIndex.count(p.of))
      return c.fail("parameter '" + p.name +
                    "' belongs to unknown parameter '" + p.of + "'");
  return true;
}

/// Values: types in range, views of earlier device values within their
/// bytes, device values inside the arena at aligned offsets.
static bool checkValues(Checker &c, const ExecPlan &plan) {
  for (size_t id = 0; id < plan.values.size(); ++id) {
    const Value &v = plan.values[id];
    std::string where = "value %" + std::to_string(id);
    if (!checkType(c, v.type, where))
      return false;
    if (v.viewOf) {
      int64_t base = *v.viewOf;
      if (base < 0 || base >= static_cast<int64_t>(id))
        return c.fail(where + " is a view of %" + std::to_string(base) +
                      ", which is not an earlier value");
      if (v.home != Home::Device || plan.values[base].home != Home::Device)
        return c.fail(where + " is a view but not of a device value");
      if (v.type.bytes() > plan.values[base].type.bytes() ||
          v.offset != plan.values[bufferOf(plan, base)].offset)
        return c.fail(where + " is a view that does not lie within %" +
                      std::to_string(base));
      continue;
    }
    if (v.home != Home::Device)
      continue;
    if (v.offset < 0 || v.offset > plan.arenaBytes ||
        v.type.bytes() > plan.arenaBytes - v.offset)
      return c.fail(where + " at offset " + std::to_string(v.offset) +
                    " with " + std::to_string(v.type.bytes()) +
                    " bytes does not fit the arena of " +
                    std::to_string(plan.arenaBytes) + " bytes");
    // Backends rely on the planner's alignment (vector loads, cuBLASLt).
    if (v.offset % plan.alignment != 0)
      return c.fail(where + " at offset " + std::to_string(v.offset) +
                    " is not a multiple of the alignment " +
                    std::to_string(plan.alignment));
  }
  return true;
}

namespace {

/// Cross-stream reads need an event (docs/ExecutionPlan.md): the cuda
/// backend orders write-after-read and write-after-write reuse itself but
/// a read after a write on another stream only through the plan's
/// record/wait pairs. Vector clocks over the four streams: clock[s][w] is
/// the last instruction of stream w that is ordered before the current
/// point of stream s (program order on one stream, waits across streams,
/// transitively), so each read is checked in constant time.
class StreamOrder {
public:
  explicit StreamOrder(int64_t numEvents) : recorded(numEvents, 0) {
    Clock none;
    none.fill(-1);
    clock.fill(none);
    eventClock.assign(numEvents, none);
  }
  /// Whether stream `s` has passed instruction `i` of stream `from`.
  bool isAfter(int s, Stream from, int64_t i) const {
    return clock[s][static_cast<int>(from)] >= i;
  }
  /// Instruction `i` issues on stream `s`.
  void issue(int s, int64_t i) { clock[s][s] = i; }
  void record(int s, int64_t event) {
    recorded[event] = 1;
    eventClock[event] = clock[s];
  }
  /// Stream `s` waits for `event`; false if it was not recorded yet.
  bool wait(int s, int64_t event) {
    if (!recorded[event])
      return false;
    for (int w = 0; w < kNumStreams; ++w)
      clock[s][w] = std::max(clock[s][w], eventClock[event][w]);
    return true;
  }

private:
  using Clock = std::array<int64_t, kNumStreams>;
  std::array<Clock, kNumStreams> clock;
  std::vector<Clock> eventClock;
  std::vector<char> recorded;
};

/// The program in one pass over the instructions: inputs, then for each
/// instruction its op and stream, its reads (defined before, and ordered
/// after a write on another stream), its results (each value defined
/// once), its workspace, its event and what its op needs (checkOp); then
/// the outputs.
class ProgramChecker {
public:
  ProgramChecker(Checker &c, const ExecPlan &plan)
      : c(c), plan(plan), defined(plan.values.size(), 0),
        writer(plan.values.size(), -1), order(plan.numEvents) {}

  bool run() {
    if (!checkInputs())
      return false;
    for (size_t i = 0; i < plan.instructions.size(); ++i)
      if (!checkInstruction(i))
        return false;
    for (int64_t id : plan.outputs)
      if (!isValue(id) || !defined[id])
        return c.fail("output %" + llvm::Twine(id) + " is never defined");
    return true;
  }

private:
  bool isValue(int64_t id) const {
    return id >= 0 && id < static_cast<int64_t>(plan.values.size());
  }

  bool checkInputs() {
    for (int64_t id : plan.inputs) {
      if (!isValue(id) || plan.values[id].home != Home::Input || defined[id])
        return c.fail("input %" + llvm::Twine(id) +
                      " is out of range, repeated, or not an input value");
      defined[id] = 1;
    }
    return true;
  }

  bool checkInstruction(size_t i) {
    const Instruction &inst = plan.instructions[i];
    if (static_cast<size_t>(inst.op) >= kNumOpCodes)
      return c.fail("instruction #" + llvm::Twine(i) + " has no valid op");
    std::string where =
        "instruction #" + std::to_string(i) + " ('" + opName(inst.op) + "')";
    int s = static_cast<int>(inst.stream);
    if (s < 0 || s >= kNumStreams)
      return c.fail(where + " has no valid stream");
    if (!checkReads(inst, where))
      return false;
    order.issue(s, i);
    return checkResults(i, inst, where) && checkWorkspace(inst, where) &&
           checkEvent(inst, where) && checkOp(c, plan, inst, where);
  }

  bool checkReads(const Instruction &inst, const std::string &where) {
    for (int64_t o : inst.operands) {
      if (!isValue(o) || !defined[o])
        return c.fail(where + " reads %" + std::to_string(o) +
                      ", which is out of range or not yet defined");
      int64_t d = writer[o];
      if (d < 0)
        continue;
      Stream from = plan.instructions[d].stream;
      if (from != inst.stream &&
          !order.isAfter(static_cast<int>(inst.stream), from, d))
        return c.fail(where + " on stream " + streamName(inst.stream) +
                      " reads %" + std::to_string(o) +
                      ", written by instruction #" + std::to_string(d) +
                      " on stream " + streamName(from) +
                      ", without waiting for an event recorded after that "
                      "write");
    }
    return true;
  }

  bool checkResults(size_t i, const Instruction &inst,
                    const std::string &where) {
    for (int64_t r : inst.results) {
      if (!isValue(r) || defined[r] || plan.values[r].home == Home::Input)
        return c.fail(where + " defines %" + std::to_string(r) +
                      ", which is out of range, an input or defined twice");
      defined[r] = 1;
      writer[r] = i;
    }
    return true;
  }

  bool checkWorkspace(const Instruction &inst, const std::string &where) {
    for (const Range &w : inst.workspace) {
      if (w.offset < 0 || w.size < 0 || w.offset > plan.arenaBytes ||
          w.size > plan.arenaBytes - w.offset)
        return c.fail(where + " has a workspace outside the arena");
      if (w.offset % plan.alignment != 0)
        return c.fail(where + " has a workspace at offset " +
                      std::to_string(w.offset) +
                      ", not a multiple of the alignment " +
                      std::to_string(plan.alignment));
    }
    return true;
  }

  bool checkEvent(const Instruction &inst, const std::string &where) {
    if (inst.op != OpCode::Record && inst.op != OpCode::Wait)
      return true;
    if (!inst.event || *inst.event < 0 || *inst.event >= plan.numEvents)
      return c.fail(where + " names no valid event");
    int s = static_cast<int>(inst.stream);
    if (inst.op == OpCode::Record)
      order.record(s, *inst.event);
    else if (!order.wait(s, *inst.event))
      return c.fail(where + " waits on event " + std::to_string(*inst.event) +
                    " before it is recorded");
    return true;
  }

  Checker &c;
  const ExecPlan &plan;
  std::vector<char> defined;
  std::vector<int64_t> writer; ///< defining instruction; -1: input
  StreamOrder order;
};

} // namespace

/// A job's plan (ExecPlan::jobRanks): every collective, and every fetch and
/// device-to-host copy that moves one rank's shard (`ranks`), is for the
/// same number of ranks; the backends shard by it.
static bool checkJob(Checker &c, const ExecPlan &plan) {
  int64_t ranks = plan.jobRanks();
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    bool collective =
        inst.op == OpCode::AllGather || inst.op == OpCode::ReduceScatter;
    std::optional<int64_t> shard = inst.intAttr("ranks");
    if (shard && !collective && inst.op != OpCode::Fetch &&
        inst.op != OpCode::DeviceToHost)
      return c.fail("instruction #" + std::to_string(i) + " ('" +
                    opName(inst.op) +
                    "'): attribute 'ranks' is for fetch, d2h and the "
                    "collectives only");
    int64_t of = collective ? inst.cost.ranks : shard.value_or(ranks);
    if (of != ranks)
      return c.fail("instruction #" + std::to_string(i) + " ('" +
                    opName(inst.op) + "') is for " + std::to_string(of) +
                    " ranks, the plan's first collective for " +
                    std::to_string(ranks) + ": a plan is for one job");
  }
  return true;
}

/// Deferred updates (kDeferredAttr): all host_adamw or none, each
/// deferred parameter applied by exactly one fetch, its first in the step,
/// and no applies_update fetch without a deferred update; a version that
/// knows them.
static bool checkDeferredUpdates(Checker &c, const ExecPlan &plan) {
  auto where = [&](size_t i) {
    return "instruction #" + std::to_string(i) + " ('" +
           opName(plan.instructions[i].op) + "')";
  };
  std::optional<size_t> firstUpdate;
  llvm::StringMap<size_t> deferred, applied, firstFetch;
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    bool isDeferred = inst.hasAttr(kDeferredAttr);
    if (isDeferred && inst.op != OpCode::HostAdamW)
      return c.fail(where(i) + ": attribute '" + kDeferredAttr +
                    "' is for host_adamw only");
    if (inst.hasAttr(kAppliesUpdateAttr) && inst.op != OpCode::Fetch)
      return c.fail(where(i) + ": attribute '" + kAppliesUpdateAttr +
                    "' is for fetch only");
    if (inst.hasAttr(kExactAttr) && inst.op != OpCode::Gelu &&
        inst.op != OpCode::GeluGrad)
      return c.fail(where(i) + ": attribute '" + kExactAttr +
                    "' is for gelu and gelu_grad only");
    if (inst.hasAttr(kExactAttr) && plan.version < kExactGeluFormatVersion)
      return c.fail(where(i) + " runs the exact GELU, which format version " +
                    std::to_string(kExactGeluFormatVersion) +
                    " introduced, but the plan says version " +
                    std::to_string(plan.version));
    if ((inst.op == OpCode::FlowMatchingLoss ||
         inst.op == OpCode::FlowMatchingLossGrad) &&
        inst.operands.size() == 4 && plan.version < kWeightedLossFormatVersion)
      return c.fail(where(i) +
                    " weights the loss per sample, which format "
                    "version " +
                    std::to_string(kWeightedLossFormatVersion) +
                    " introduced, but the plan says version " +
                    std::to_string(plan.version));
    if (inst.op == OpCode::HostAdamW) {
      if (!firstUpdate)
        firstUpdate = i;
      else if (isDeferred !=
               plan.instructions[*firstUpdate].hasAttr(kDeferredAttr))
        return c.fail(where(i) + " of '" + inst.param + "' is " +
                      (isDeferred ? "" : "not ") + "deferred but " +
                      where(*firstUpdate) + " is" + (isDeferred ? " not" : "") +
                      ": a plan defers every update or none");
      if (isDeferred && plan.version < kDeferredUpdateFormatVersion)
        return c.fail(where(i) + " is deferred, which format version " +
                      std::to_string(kDeferredUpdateFormatVersion) +
                      " introduced, but the plan says version " +
                      std::to_string(plan.version));
      if (isDeferred && !deferred.try_emplace(inst.param, i).second)
        return c.fail(where(i) + " defers the update of '" + inst.param +
                      "' a second time");
    }
    if (inst.op != OpCode::Fetch)
      continue;
    const Param *updated = plan.updatedParam(inst.param);
    if (updated)
      firstFetch.try_emplace(updated->name, i);
    if (!inst.hasAttr(kAppliesUpdateAttr))
      continue;
    if (!updated)
      return c.fail(where(i) + " of '" + inst.param +
                    "' applies an update, but it fetches no master parameter "
                    "or persistent copy of one");
    if (auto [it, fresh] = applied.try_emplace(updated->name, i); !fresh)
      return c.fail(where(i) + " applies the update of '" + updated->name +
                    "', which " + where(it->second) + " applies already");
    if (size_t first = firstFetch.lookup(updated->name); first != i)
      return c.fail(where(i) + " applies the update of '" + updated->name +
                    "', but " + where(first) +
                    " fetches it earlier in the step and would read it stale");
  }
  for (const auto &[name, at] : applied)
    if (!deferred.count(name))
      return c.fail(where(at) + " applies the update of '" + name.str() +
                    "', which no deferred host_adamw makes");
  for (const auto &[name, at] : deferred)
    if (!applied.count(name))
      return c.fail(where(at) + " defers the update of '" + name.str() +
                    "', but no fetch applies it ('" + kAppliesUpdateAttr +
                    "')");
  return true;
}

/// No two device buffers live at the same time share bytes, nor does an
/// instruction's workspace share bytes with a buffer live across it or with
/// its other workspace: the backend writes all of them.
static bool checkArena(Checker &c, const ExecPlan &plan) {
  // Sweep the buffers by start, keeping those still live.
  Liveness live = computeLiveness(plan);
  std::vector<int64_t> order = live.deviceBuffers;
  llvm::sort(order,
             [&](int64_t a, int64_t b) { return live.def[a] < live.def[b]; });
  std::vector<int64_t> active;
  for (int64_t id : order) {
    int64_t start = live.def[id];
    llvm::erase_if(active, [&](int64_t a) { return live.end(a) < start; });
    const Value &v = plan.values[id];
    for (int64_t a : active) {
      const Value &w = plan.values[a];
      if (v.offset < w.offset + w.type.bytes() &&
          w.offset < v.offset + v.type.bytes() && v.type.bytes() &&
          w.type.bytes())
        return c.fail("device values %" + std::to_string(a) + " and %" +
                      std::to_string(id) +
                      " are live at the same time but share arena bytes");
    }
    active.push_back(id);
  }

  size_t next = 0;
  std::vector<int64_t> liveAt;
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const Instruction &inst = plan.instructions[i];
    if (inst.workspace.empty())
      continue;
    int64_t at = i;
    for (; next < order.size() && live.def[order[next]] <= at; ++next)
      liveAt.push_back(order[next]);
    llvm::erase_if(liveAt, [&](int64_t a) { return live.end(a) < at; });
    std::string where =
        "instruction #" + std::to_string(i) + " ('" + opName(inst.op) + "')";
    for (size_t k = 0; k < inst.workspace.size(); ++k) {
      const Range &w = inst.workspace[k];
      auto overlaps = [&](int64_t offset, int64_t size) {
        return size && w.size && offset < w.offset + w.size &&
               w.offset < offset + size;
      };
      for (int64_t a : liveAt)
        if (overlaps(plan.values[a].offset, plan.values[a].type.bytes()))
          return c.fail(where + " has a workspace over live %" +
                        std::to_string(a));
      for (size_t j = 0; j < k; ++j)
        if (overlaps(inst.workspace[j].offset, inst.workspace[j].size))
          return c.fail(where + " has workspaces that share arena bytes");
    }
  }
  return true;
}

llvm::Error exec::validate(const ExecPlan &plan) {
  Checker c;
  if (checkVersion(c, plan) && checkPlanFields(c, plan) &&
      checkParams(c, plan) && checkValues(c, plan) &&
      ProgramChecker(c, plan).run() && checkJob(c, plan) &&
      checkDeferredUpdates(c, plan) && checkArena(c, plan))
    return llvm::Error::success();
  return llvm::createStringError("invalid execution plan: " + c.error);
}
