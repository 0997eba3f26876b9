//===- ExecPlan.cpp - Execution plan: types, JSON, validation -------------===//

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/HyperParameters.h"

#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <array>

using namespace megaslide;
using namespace megaslide::exec;

const char *exec::dtypeName(DType dtype) {
  switch (dtype) {
  case DType::BF16:
    return "bf16";
  case DType::F16:
    return "f16";
  case DType::F32:
    return "f32";
  case DType::I32:
    return "i32";
  case DType::I64:
    return "i64";
  }
  return "?";
}

std::optional<DType> exec::parseDType(llvm::StringRef name) {
  for (DType d : {DType::BF16, DType::F16, DType::F32, DType::I32, DType::I64})
    if (name == dtypeName(d))
      return d;
  return std::nullopt;
}

int64_t exec::dtypeBytes(DType dtype) {
  switch (dtype) {
  case DType::BF16:
  case DType::F16:
    return 2;
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::I64:
    return 8;
  }
  return 0;
}

int64_t TensorType::numElements() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

const Attr *Instruction::attr(llvm::StringRef name) const {
  auto it = attrs.find(name);
  return it == attrs.end() ? nullptr : &it->second;
}

std::optional<int64_t> Instruction::intAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name))
    if (auto *i = std::get_if<int64_t>(a))
      return *i;
  return std::nullopt;
}

std::optional<double> Instruction::floatAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name)) {
    if (auto *d = std::get_if<double>(a))
      return *d;
    if (auto *i = std::get_if<int64_t>(a))
      return static_cast<double>(*i);
  }
  return std::nullopt;
}

std::optional<std::vector<int64_t>>
Instruction::intsAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name))
    if (auto *v = std::get_if<std::vector<int64_t>>(a))
      return *v;
  return std::nullopt;
}

const Param *ExecPlan::findParam(llvm::StringRef name) const {
  for (const Param &p : params)
    if (p.name == name)
      return &p;
  return nullptr;
}

const Param *ExecPlan::updatedParam(llvm::StringRef fetched) const {
  const Param *p = findParam(fetched);
  if (p && p->role == "weight" && !p->of.empty())
    p = findParam(p->of);
  return p && p->role == "master" ? p : nullptr;
}

void exec::setDeferredUpdates(ExecPlan &plan, bool deferred) {
  llvm::StringSet<> updated, applied;
  for (Instruction &inst : plan.instructions) {
    inst.attrs.erase(std::string(kDeferredAttr));
    inst.attrs.erase(std::string(kAppliesUpdateAttr));
    if (deferred && inst.op == OpCode::HostAdamW) {
      inst.attrs.emplace(kDeferredAttr.str(), int64_t(1));
      updated.insert(inst.param);
    }
  }
  for (Instruction &inst : plan.instructions)
    if (inst.op == OpCode::Fetch)
      if (const Param *p = plan.updatedParam(inst.param))
        if (updated.contains(p->name) && applied.insert(p->name).second)
          inst.attrs.emplace(kAppliesUpdateAttr.str(), int64_t(1));
  plan.version =
      deferred ? kDeferredUpdateFormatVersion : kOldestPlanFormatVersion;
}

bool ExecPlan::defersUpdates() const {
  for (const Instruction &inst : instructions)
    if (inst.op == OpCode::HostAdamW)
      return inst.hasAttr(kDeferredAttr);
  return false;
}

//===----------------------------------------------------------------------===//
// Liveness
//===----------------------------------------------------------------------===//

/// The value whose arena bytes `id` occupies (itself unless a view).
static int64_t baseOf(const ExecPlan &plan, int64_t id) {
  // Views are validated to point at earlier ids, so this terminates.
  while (plan.values[id].viewOf)
    id = *plan.values[id].viewOf;
  return id;
}

Liveness exec::computeLiveness(const ExecPlan &plan) {
  Liveness l;
  size_t n = plan.values.size();
  int64_t steps = plan.instructions.size();
  l.def.assign(n, -1);
  l.lastUse.assign(n, -1);
  for (int64_t id : plan.inputs)
    l.def[id] = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const Instruction &inst = plan.instructions[i];
    for (int64_t r : inst.results) {
      l.def[r] = i;
      l.lastUse[baseOf(plan, r)] = std::max(l.lastUse[baseOf(plan, r)], i);
    }
    for (int64_t o : inst.operands)
      l.lastUse[baseOf(plan, o)] = std::max(l.lastUse[baseOf(plan, o)], i);
  }
  for (int64_t id : plan.outputs)
    l.lastUse[baseOf(plan, id)] = steps - 1;

  std::vector<int64_t> delta(steps + 1, 0);
  for (size_t id = 0; id < n; ++id) {
    const Value &v = plan.values[id];
    if (v.home != Home::Device || v.viewOf || l.def[id] < 0)
      continue;
    l.deviceBuffers.push_back(id);
    delta[l.def[id]] += v.type.bytes();
    delta[std::max(l.def[id], l.lastUse[id]) + 1] -= v.type.bytes();
  }
  l.liveBytes.resize(steps);
  int64_t running = 0;
  for (int64_t i = 0; i < steps; ++i) {
    running += delta[i];
    int64_t workspace = 0;
    for (const Range &r : plan.instructions[i].workspace)
      workspace += r.size;
    l.liveBytes[i] = running + workspace;
    l.peakLiveBytes = std::max(l.peakLiveBytes, l.liveBytes[i]);
  }
  return l;
}

//===----------------------------------------------------------------------===//
// Validation
//===----------------------------------------------------------------------===//

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
  static const llvm::StringMap<Kind> kinds = {
      {"scale", Kind::Number},      {"lr", Kind::Number},
      {"beta1", Kind::Number},      {"beta2", Kind::Number},
      {"eps", Kind::Number},        {"weight_decay", Kind::Number},
      {"theta", Kind::Number},      {"max_period", Kind::Number},
      {"time_scale", Kind::Number}, {"radius", Kind::Int},
      {"inverse", Kind::Int},       {"grid", Kind::Ints},
      {"window", Kind::Ints},       {"tile", Kind::Ints},
      {"patch", Kind::Ints},        {"dims", Kind::Ints},
      {kDeferredAttr, Kind::Unit},  {kAppliesUpdateAttr, Kind::Unit}};
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
/// timestep_embedding and flow_interpolate read, the fp32 loss of
/// flow_matching_loss and the fp32 log-sum-exp dsa3d writes and
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
      return isResult && index == 0;
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

llvm::Error exec::validate(const ExecPlan &plan) {
  Checker c;
  auto done = [&]() -> llvm::Error {
    if (c.error.empty())
      return llvm::Error::success();
    return llvm::createStringError("invalid execution plan: " + c.error);
  };
  if (plan.version < kOldestPlanFormatVersion ||
      plan.version > kPlanFormatVersion) {
    c.fail("format version " + llvm::Twine(plan.version) +
           " is not supported (this runtime reads versions " +
           llvm::Twine(kOldestPlanFormatVersion) + " to " +
           llvm::Twine(kPlanFormatVersion) + "; recompile the plan)");
    return done();
  }
  if (plan.arenaBytes < 0 || plan.arenaBytes > kMaxTensorBytes)
    c.fail("arena size " + llvm::Twine(plan.arenaBytes) + " is out of range");
  // msched.budget_check's budget is positive.
  if (plan.arenaBudgetBytes && *plan.arenaBudgetBytes <= 0)
    c.fail("arena_budget_bytes " + llvm::Twine(*plan.arenaBudgetBytes) +
           " is not positive");
  if (plan.alignment <= 0 || (plan.alignment & (plan.alignment - 1)))
    c.fail("alignment " + llvm::Twine(plan.alignment) +
           " is not a power of two");
  if (plan.batch <= 0)
    c.fail("batch " + llvm::Twine(plan.batch) + " is not positive");
  if (plan.gradAccum < 1 || plan.gradAccum > kMaxGradAccum)
    c.fail("grad_accum " + llvm::Twine(plan.gradAccum) + " is not in [1, " +
           llvm::Twine(kMaxGradAccum) + "]");
  if (plan.emaDtype != "none" && plan.emaDtype != "f32" &&
      plan.emaDtype != "bf16")
    c.fail("ema_dtype '" + plan.emaDtype + "' is not none, f32 or bf16");
  if (plan.gradientBuffers < 1 || plan.gradientBuffers > 64)
    c.fail("gradient_buffers " + llvm::Twine(plan.gradientBuffers) +
           " is not in [1, 64]");
  // The planner's bound on a step (ModelBuilder): larger batches could
  // overflow the byte counts of the tensors a backend allocates per sample.
  int64_t gridTokens = 1;
  for (int64_t d : plan.grid) {
    if (d <= 0 || gridTokens > kMaxTokensPerStep / d) {
      c.fail("grid extent " + llvm::Twine(d) +
             " is not positive or the grid has more than 2^31 tokens");
      break;
    }
    gridTokens *= d;
  }
  if (c.error.empty() && plan.batch > kMaxTokensPerStep / gridTokens)
    c.fail("batch " + llvm::Twine(plan.batch) + " of " +
           llvm::Twine(gridTokens) +
           " tokens per sample is more than 2^31 tokens per step, the most "
           "the planner plans for");
  // Each event is recorded by an instruction; a larger count would only
  // make the loader and the backends allocate per-event state for nothing.
  if (plan.numEvents < 0 ||
      plan.numEvents > static_cast<int64_t>(plan.instructions.size()))
    c.fail("event count " + llvm::Twine(plan.numEvents) +
           " is out of range (the plan has " +
           llvm::Twine(plan.instructions.size()) + " instructions)");
  if (!c.error.empty())
    return done();

  llvm::StringMap<size_t> paramIndex;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const Param &p = plan.params[i];
    // A std::string: a Twine would point at the destroyed temporary.
    std::string where = "parameter '" + p.name + "'";
    if (p.name.empty() || !paramIndex.try_emplace(p.name, i).second)
      c.fail("parameter #" + llvm::Twine(i) +
             " has an empty or duplicate name");
    if (!llvm::is_contained(
            {"master", "moment", "weight", "gradient", "frozen"}, p.role))
      c.fail(where + " has unknown role '" + p.role + "'");
    checkType(c, p.type, where);
  }
  for (const Param &p : plan.params)
    if (!p.of.empty() && !paramIndex.count(p.of))
      c.fail("parameter '" + p.name + "' belongs to unknown parameter '" +
             p.of + "'");

  size_t n = plan.values.size();
  for (size_t id = 0; id < n && c.error.empty(); ++id) {
    const Value &v = plan.values[id];
    std::string where = "value %" + std::to_string(id);
    if (!checkType(c, v.type, where))
      break;
    if (v.viewOf) {
      int64_t base = *v.viewOf;
      if (base < 0 || base >= static_cast<int64_t>(id))
        c.fail(where + " is a view of %" + std::to_string(base) +
               ", which is not an earlier value");
      else if (v.home != Home::Device || plan.values[base].home != Home::Device)
        c.fail(where + " is a view but not of a device value");
      else if (v.type.bytes() > plan.values[base].type.bytes() ||
               v.offset != plan.values[baseOf(plan, base)].offset)
        c.fail(where + " is a view that does not lie within %" +
               std::to_string(base));
      continue;
    }
    if (v.home == Home::Device && (v.offset < 0 || v.offset > plan.arenaBytes ||
                                   v.type.bytes() > plan.arenaBytes - v.offset))
      c.fail(where + " at offset " + std::to_string(v.offset) + " with " +
             std::to_string(v.type.bytes()) +
             " bytes does not fit the arena of " +
             std::to_string(plan.arenaBytes) + " bytes");
    // Backends rely on the planner's alignment (vector loads, cuBLASLt).
    else if (v.home == Home::Device && v.offset % plan.alignment != 0)
      c.fail(where + " at offset " + std::to_string(v.offset) +
             " is not a multiple of the alignment " +
             std::to_string(plan.alignment));
  }
  if (!c.error.empty())
    return done();

  std::vector<char> defined(n, 0);
  for (int64_t id : plan.inputs) {
    if (id < 0 || id >= static_cast<int64_t>(n) ||
        plan.values[id].home != Home::Input || defined[id]) {
      c.fail("input %" + llvm::Twine(id) +
             " is out of range, repeated, or not an input value");
      return done();
    }
    defined[id] = 1;
  }
  std::vector<char> recorded(plan.numEvents, 0);
  // Cross-stream reads need an event (docs/ExecutionPlan.md): the cuda
  // backend orders write-after-read and write-after-write reuse itself but
  // a read after a write on another stream only through the plan's
  // record/wait pairs. Vector clocks over the four streams: clock[s][w] is
  // the last instruction of stream w that is ordered before the current
  // point of stream s (program order on one stream, waits across streams,
  // transitively), so each read is checked in constant time.
  using Clock = std::array<int64_t, kNumStreams>;
  Clock none;
  none.fill(-1);
  std::array<Clock, kNumStreams> clock;
  clock.fill(none);
  std::vector<Clock> eventClock(plan.numEvents, none);
  std::vector<int64_t> writer(n, -1); ///< defining instruction; -1: input
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const Instruction &inst = plan.instructions[i];
    if (static_cast<size_t>(inst.op) >= kNumOpCodes) {
      c.fail("instruction #" + llvm::Twine(i) + " has no valid op");
      return done();
    }
    std::string where =
        "instruction #" + std::to_string(i) + " ('" + opName(inst.op) + "')";
    int s = static_cast<int>(inst.stream);
    if (s < 0 || s >= kNumStreams) {
      c.fail(where + " has no valid stream");
      return done();
    }
    for (int64_t o : inst.operands) {
      if (o < 0 || o >= static_cast<int64_t>(n) || !defined[o]) {
        c.fail(where + " reads %" + std::to_string(o) +
               ", which is out of range or not yet defined");
        return done();
      }
      int64_t d = writer[o];
      if (d < 0)
        continue;
      Stream from = plan.instructions[d].stream;
      if (from != inst.stream && clock[s][static_cast<int>(from)] < d) {
        c.fail(where + " on stream " + streamName(inst.stream) + " reads %" +
               std::to_string(o) + ", written by instruction #" +
               std::to_string(d) + " on stream " + streamName(from) +
               ", without waiting for an event recorded after that write");
        return done();
      }
    }
    clock[s][s] = i;
    for (int64_t r : inst.results) {
      if (r < 0 || r >= static_cast<int64_t>(n) || defined[r] ||
          plan.values[r].home == Home::Input) {
        c.fail(where + " defines %" + std::to_string(r) +
               ", which is out of range, an input or defined twice");
        return done();
      }
      defined[r] = 1;
      writer[r] = i;
    }
    for (const Range &w : inst.workspace)
      if (w.offset < 0 || w.size < 0 || w.offset > plan.arenaBytes ||
          w.size > plan.arenaBytes - w.offset)
        c.fail(where + " has a workspace outside the arena");
      else if (w.offset % plan.alignment != 0)
        c.fail(where + " has a workspace at offset " +
               std::to_string(w.offset) + ", not a multiple of the alignment " +
               std::to_string(plan.alignment));
    if (inst.op == OpCode::Record || inst.op == OpCode::Wait) {
      if (!inst.event || *inst.event < 0 || *inst.event >= plan.numEvents) {
        c.fail(where + " names no valid event");
        return done();
      }
      Clock &event = eventClock[*inst.event];
      if (inst.op == OpCode::Record) {
        recorded[*inst.event] = 1;
        event = clock[s];
      } else if (!recorded[*inst.event]) {
        c.fail(where + " waits on event " + std::to_string(*inst.event) +
               " before it is recorded");
      } else {
        for (int w = 0; w < kNumStreams; ++w)
          clock[s][w] = std::max(clock[s][w], event[w]);
      }
    }
    checkAttrs(c, inst, where);
    if (inst.op == OpCode::HostAdamW)
      checkHyperParameters(c, inst, where);
    if (checkScheduleOp(c, plan, inst, where))
      checkDTypes(c, plan, inst, where);
    if (!c.error.empty())
      return done();
  }
  for (int64_t id : plan.outputs)
    if (id < 0 || id >= static_cast<int64_t>(n) || !defined[id])
      c.fail("output %" + llvm::Twine(id) + " is never defined");
  if (!c.error.empty() || !checkDeferredUpdates(c, plan))
    return done();

  // No two device buffers live at the same time may share bytes: sweep the
  // buffers by start, keeping those still live.
  Liveness live = computeLiveness(plan);
  std::vector<int64_t> order = live.deviceBuffers;
  llvm::sort(order,
             [&](int64_t a, int64_t b) { return live.def[a] < live.def[b]; });
  std::vector<int64_t> active;
  for (int64_t id : order) {
    int64_t start = live.def[id];
    llvm::erase_if(active, [&](int64_t a) {
      return std::max(live.def[a], live.lastUse[a]) < start;
    });
    const Value &v = plan.values[id];
    for (int64_t a : active) {
      const Value &w = plan.values[a];
      if (v.offset < w.offset + w.type.bytes() &&
          w.offset < v.offset + v.type.bytes() && v.type.bytes() &&
          w.type.bytes()) {
        c.fail("device values %" + std::to_string(a) + " and %" +
               std::to_string(id) +
               " are live at the same time but share "
               "arena bytes");
        return done();
      }
    }
    active.push_back(id);
  }

  // Nor may an instruction's workspace share bytes with a buffer live
  // across it or with its other workspace: the backend writes all of them.
  size_t next = 0;
  std::vector<int64_t> liveAt;
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const Instruction &inst = plan.instructions[i];
    if (inst.workspace.empty())
      continue;
    int64_t at = i;
    for (; next < order.size() && live.def[order[next]] <= at; ++next)
      liveAt.push_back(order[next]);
    llvm::erase_if(liveAt, [&](int64_t a) {
      return std::max(live.def[a], live.lastUse[a]) < at;
    });
    std::string where =
        "instruction #" + std::to_string(i) + " ('" + opName(inst.op) + "')";
    for (size_t k = 0; k < inst.workspace.size(); ++k) {
      const Range &w = inst.workspace[k];
      auto overlaps = [&](int64_t offset, int64_t size) {
        return size && w.size && offset < w.offset + w.size &&
               w.offset < offset + size;
      };
      for (int64_t a : liveAt)
        if (overlaps(plan.values[a].offset, plan.values[a].type.bytes())) {
          c.fail(where + " has a workspace over live %" + std::to_string(a));
          return done();
        }
      for (size_t j = 0; j < k; ++j)
        if (overlaps(inst.workspace[j].offset, inst.workspace[j].size)) {
          c.fail(where + " has workspaces that share arena bytes");
          return done();
        }
    }
  }
  return done();
}

//===----------------------------------------------------------------------===//
// JSON
//===----------------------------------------------------------------------===//

namespace megaslide::exec {

static bool fromJSON(const llvm::json::Value &v, DType &d,
                     llvm::json::Path path) {
  std::optional<llvm::StringRef> s = v.getAsString();
  std::optional<DType> parsed = s ? parseDType(*s) : std::nullopt;
  if (!parsed) {
    path.report("expected one of bf16, f16, f32, i32, i64");
    return false;
  }
  d = *parsed;
  return true;
}

static bool fromJSON(const llvm::json::Value &v, Stream &s,
                     llvm::json::Path path) {
  std::optional<llvm::StringRef> name = v.getAsString();
  if (std::optional<Stream> parsed = name ? parseStream(*name) : std::nullopt) {
    s = *parsed;
    return true;
  }
  path.report("expected one of compute, h2d, d2h, host");
  return false;
}

static bool fromJSON(const llvm::json::Value &v, OpCode &op,
                     llvm::json::Path path) {
  std::optional<llvm::StringRef> name = v.getAsString();
  std::optional<OpCode> parsed = name ? parseOpCode(*name) : std::nullopt;
  if (!parsed) {
    // parseExecPlan names an unknown op before mapping gets here.
    path.report("expected the name of an op");
    return false;
  }
  op = *parsed;
  return true;
}

static bool fromJSON(const llvm::json::Value &v, Home &h,
                     llvm::json::Path path) {
  std::optional<llvm::StringRef> name = v.getAsString();
  if (name && *name == "device")
    h = Home::Device;
  else if (name && *name == "input")
    h = Home::Input;
  else if (name && *name == "host")
    h = Home::Host;
  else {
    path.report("expected one of device, input, host");
    return false;
  }
  return true;
}

static bool fromJSON(const llvm::json::Value &v, Param &p,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  return o && o.map("name", p.name) && o.map("role", p.role) &&
         o.map("group", p.group) && o.mapOptional("layer", p.layer) &&
         o.mapOptional("of", p.of) && o.map("dtype", p.type.dtype) &&
         o.map("shape", p.type.shape);
}

static bool fromJSON(const llvm::json::Value &v, Value &val,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  return o && o.map("dtype", val.type.dtype) &&
         o.map("shape", val.type.shape) && o.map("home", val.home) &&
         o.mapOptional("offset", val.offset) &&
         o.mapOptional("view_of", val.viewOf) &&
         o.mapOptional("name", val.name);
}

static bool fromJSON(const llvm::json::Value &v, Range &r,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  return o && o.map("offset", r.offset) && o.map("size", r.size);
}

static bool fromJSON(const llvm::json::Value &v, CostInputs &c,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  return o && o.mapOptional("matmul_flops", c.matmulFlops) &&
         o.mapOptional("attention_flops", c.attentionFlops) &&
         o.mapOptional("other_flops", c.otherFlops) &&
         o.mapOptional("bytes", c.bytes) &&
         o.mapOptional("source_bytes", c.sourceBytes);
}

static bool fromJSON(const llvm::json::Value &v, Attr &a,
                     llvm::json::Path path) {
  if (std::optional<int64_t> i = v.getAsInteger()) {
    a = *i;
    return true;
  }
  if (std::optional<double> d = v.getAsNumber()) {
    a = *d;
    return true;
  }
  if (std::optional<llvm::StringRef> s = v.getAsString()) {
    a = s->str();
    return true;
  }
  std::vector<int64_t> ints;
  if (v.getAsArray() && fromJSON(v, ints, path)) {
    a = std::move(ints);
    return true;
  }
  path.report("expected an integer, number, string or integer array");
  return false;
}

static bool fromJSON(const llvm::json::Value &v, Instruction &inst,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  if (!o || !o.map("op", inst.op) || !o.map("stream", inst.stream) ||
      !o.mapOptional("operands", inst.operands) ||
      !o.mapOptional("results", inst.results) ||
      !o.mapOptional("layer", inst.layer) ||
      !o.mapOptional("param", inst.param) ||
      !o.mapOptional("event", inst.event) ||
      !o.mapOptional("workspace", inst.workspace) ||
      !o.mapOptional("cost", inst.cost))
    return false;
  if (const llvm::json::Value *attrs = v.getAsObject()->get("attrs")) {
    const llvm::json::Object *obj = attrs->getAsObject();
    if (!obj) {
      path.field("attrs").report("expected an object");
      return false;
    }
    for (const auto &[key, value] : *obj) {
      Attr a;
      if (!fromJSON(value, a, path.field("attrs").field(key)))
        return false;
      inst.attrs.emplace(key.str(), std::move(a));
    }
  }
  return true;
}

static bool fromJSON(const llvm::json::Value &v, KernelModule &k,
                     llvm::json::Path path) {
  llvm::json::ObjectMapper o(v, path);
  return o && o.map("name", k.name) && o.map("source", k.source) &&
         o.map("manifest", k.manifest);
}

static llvm::json::Value attrToJSON(const Attr &a) {
  return std::visit([](const auto &x) { return llvm::json::Value(x); }, a);
}

} // namespace megaslide::exec

std::string exec::serialize(const ExecPlan &plan) {
  using llvm::json::Array;
  using llvm::json::Object;
  Array params;
  for (const Param &p : plan.params) {
    Object o{{"name", p.name},
             {"role", p.role},
             {"group", p.group},
             {"dtype", dtypeName(p.type.dtype)},
             {"shape", p.type.shape}};
    if (p.layer)
      o["layer"] = *p.layer;
    if (!p.of.empty())
      o["of"] = p.of;
    params.push_back(std::move(o));
  }
  Array values;
  for (const Value &v : plan.values) {
    Object o{{"dtype", dtypeName(v.type.dtype)},
             {"shape", v.type.shape},
             {"home", v.home == Home::Device  ? "device"
                      : v.home == Home::Input ? "input"
                                              : "host"}};
    if (v.home == Home::Device)
      o["offset"] = v.offset;
    if (v.viewOf)
      o["view_of"] = *v.viewOf;
    if (!v.name.empty())
      o["name"] = v.name;
    values.push_back(std::move(o));
  }
  Array instructions;
  for (const Instruction &inst : plan.instructions) {
    Object o{{"op", opName(inst.op)}, {"stream", streamName(inst.stream)}};
    if (!inst.operands.empty())
      o["operands"] = inst.operands;
    if (!inst.results.empty())
      o["results"] = inst.results;
    if (!inst.attrs.empty()) {
      Object attrs;
      for (const auto &[k, a] : inst.attrs)
        attrs[k] = attrToJSON(a);
      o["attrs"] = std::move(attrs);
    }
    if (inst.layer)
      o["layer"] = *inst.layer;
    if (!inst.param.empty())
      o["param"] = inst.param;
    if (inst.event)
      o["event"] = *inst.event;
    if (!inst.workspace.empty()) {
      Array ws;
      for (const Range &r : inst.workspace)
        ws.push_back(Object{{"offset", r.offset}, {"size", r.size}});
      o["workspace"] = std::move(ws);
    }
    const CostInputs &c = inst.cost;
    Object cost;
    if (c.matmulFlops)
      cost["matmul_flops"] = c.matmulFlops;
    if (c.attentionFlops)
      cost["attention_flops"] = c.attentionFlops;
    if (c.otherFlops)
      cost["other_flops"] = c.otherFlops;
    if (c.bytes)
      cost["bytes"] = c.bytes;
    if (c.sourceBytes)
      cost["source_bytes"] = c.sourceBytes;
    if (!cost.empty())
      o["cost"] = std::move(cost);
    instructions.push_back(std::move(o));
  }
  Array kernels;
  for (const KernelModule &k : plan.kernelModules)
    kernels.push_back(Object{
        {"name", k.name}, {"source", k.source}, {"manifest", k.manifest}});
  Object root{{"format", kPlanFormatName},
              {"version", plan.version},
              {"runtime_version", plan.runtimeVersion},
              {"model", plan.model},
              {"model_config", plan.modelConfig},
              {"grid", plan.grid},
              {"batch", plan.batch},
              {"arena_bytes", plan.arenaBytes},
              {"alignment", plan.alignment},
              {"planned_live_bytes", plan.plannedLiveBytes},
              {"gradient_buffers", plan.gradientBuffers},
              {"grad_accum", plan.gradAccum},
              {"ema_dtype", plan.emaDtype},
              {"num_events", plan.numEvents},
              {"params", std::move(params)},
              {"values", std::move(values)},
              {"inputs", plan.inputs},
              {"outputs", plan.outputs},
              {"instructions", std::move(instructions)},
              {"kernel_modules", std::move(kernels)}};
  if (plan.arenaBudgetBytes)
    root["arena_budget_bytes"] = *plan.arenaBudgetBytes;
  std::string text;
  llvm::raw_string_ostream os(text);
  os << llvm::json::Value(std::move(root));
  return text;
}

llvm::Expected<ExecPlan> exec::parseExecPlan(llvm::StringRef text,
                                             llvm::StringRef source) {
  // parseJson refuses hostile nesting before llvm::json recurses on it.
  llvm::Expected<llvm::json::Value> json = parseJson(text);
  if (!json)
    return llvm::createStringError(llvm::Twine(source) +
                                   ": not an execution plan (invalid JSON: " +
                                   llvm::toString(json.takeError()) + ")");
  const llvm::json::Object *root = json->getAsObject();
  std::optional<llvm::StringRef> format =
      root ? root->getString("format") : std::nullopt;
  if (!format || *format != kPlanFormatName)
    return llvm::createStringError(
        llvm::Twine(source) + ": not an execution plan (no \"format\": \"" +
        kPlanFormatName + "\")");
  ExecPlan plan;
  llvm::json::Path::Root rootPath("plan");
  llvm::json::ObjectMapper o(*json, rootPath);
  if (!o.map("version", plan.version))
    return llvm::createStringError(llvm::Twine(source) + ": " +
                                   llvm::toString(rootPath.getError()));
  if (plan.version < kOldestPlanFormatVersion ||
      plan.version > kPlanFormatVersion)
    return llvm::createStringError(
        llvm::Twine(source) + ": execution plan format version " +
        llvm::Twine(plan.version) + " is not supported (this runtime reads " +
        llvm::Twine(kOldestPlanFormatVersion) + " to " +
        llvm::Twine(kPlanFormatVersion) + "; recompile the plan)");
  if (!o.map("runtime_version", plan.runtimeVersion))
    return llvm::createStringError(llvm::Twine(source) + ": " +
                                   llvm::toString(rootPath.getError()));
  if (plan.runtimeVersion != MEGASLIDE_VERSION)
    return llvm::createStringError(
        llvm::Twine(source) + ": the plan was compiled for MegaSlide runtime " +
        plan.runtimeVersion +
        ", this is runtime " MEGASLIDE_VERSION
        " (a plan runs only on the release that compiled it; recompile it "
        "with this release's megaslide-run --save-plan)");
  // llvm::json::Path reports only fixed messages; an unknown op is named.
  if (const llvm::json::Array *insts = root->getArray("instructions"))
    for (auto [i, inst] : llvm::enumerate(*insts))
      if (const llvm::json::Object *fields = inst.getAsObject())
        if (std::optional<llvm::StringRef> op = fields->getString("op"))
          if (!parseOpCode(*op))
            return llvm::createStringError(
                llvm::Twine(source) + ": unknown op '" + *op +
                "' at plan.instructions[" + llvm::Twine(i) + "].op");
  if (!(o.map("model", plan.model) && o.map("model_config", plan.modelConfig) &&
        o.map("grid", plan.grid) && o.map("batch", plan.batch) &&
        o.map("arena_bytes", plan.arenaBytes) &&
        o.mapOptional("arena_budget_bytes", plan.arenaBudgetBytes) &&
        o.map("alignment", plan.alignment) &&
        o.map("planned_live_bytes", plan.plannedLiveBytes) &&
        o.mapOptional("gradient_buffers", plan.gradientBuffers) &&
        o.mapOptional("grad_accum", plan.gradAccum) &&
        o.mapOptional("ema_dtype", plan.emaDtype) &&
        o.map("num_events", plan.numEvents) && o.map("params", plan.params) &&
        o.map("values", plan.values) && o.map("inputs", plan.inputs) &&
        o.map("outputs", plan.outputs) &&
        o.map("instructions", plan.instructions) &&
        o.map("kernel_modules", plan.kernelModules)))
    return llvm::createStringError(llvm::Twine(source) + ": " +
                                   llvm::toString(rootPath.getError()));
  if (llvm::Error err = validate(plan))
    return llvm::createStringError(llvm::Twine(source) + ": " +
                                   llvm::toString(std::move(err)));
  return plan;
}

llvm::Expected<ExecPlan> exec::loadExecPlan(llvm::StringRef path) {
  llvm::Expected<std::string> text =
      readBoundedFile(path, kMaxExecPlanBytes, "execution plan");
  if (!text)
    return text.takeError();
  return parseExecPlan(*text, path);
}

llvm::Error exec::saveExecPlan(const ExecPlan &plan, llvm::StringRef path) {
  return writeFileAtomically(path, serialize(plan));
}
