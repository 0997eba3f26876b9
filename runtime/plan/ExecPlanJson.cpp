//===- ExecPlanJson.cpp - The execution plan's file format ----------------===//

#include "megaslide/runtime/plan/ExecPlanJson.h"
#include "megaslide/runtime/plan/Validate.h"

#include "megaslide/runtime/support/AtomicFile.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

using namespace megaslide;
using namespace megaslide::exec;

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
         o.mapOptional("source_bytes", c.sourceBytes) &&
         o.mapOptional("ranks", c.ranks) && o.mapOptional("nodes", c.nodes);
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
    if (c.ranks)
      cost["ranks"] = c.ranks;
    if (c.nodes)
      cost["nodes"] = c.nodes;
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
  if (!plan.tierRoles.empty())
    root["host_tier"] = Object{{"roles", plan.tierRoles},
                               {"window_bytes", plan.tierWindowBytes},
                               {"drives", plan.tierDrives}};
  if (plan.hasLeanMoments())
    root["host_state"] = plan.hostState;
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
        o.mapOptional("host_state", plan.hostState) &&
        o.map("num_events", plan.numEvents) && o.map("params", plan.params) &&
        o.map("values", plan.values) && o.map("inputs", plan.inputs) &&
        o.map("outputs", plan.outputs) &&
        o.map("instructions", plan.instructions) &&
        o.map("kernel_modules", plan.kernelModules)))
    return llvm::createStringError(llvm::Twine(source) + ": " +
                                   llvm::toString(rootPath.getError()));
  if (const llvm::json::Value *tier = root->get("host_tier")) {
    llvm::json::Path planPath(rootPath);
    llvm::json::ObjectMapper t(*tier, planPath.field("host_tier"));
    if (!(t && t.map("roles", plan.tierRoles) &&
          t.map("window_bytes", plan.tierWindowBytes) &&
          t.map("drives", plan.tierDrives)))
      return llvm::createStringError(llvm::Twine(source) + ": " +
                                     llvm::toString(rootPath.getError()));
  }
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
