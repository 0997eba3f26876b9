//===- ExportExecPlan.cpp - Scheduled IR -> execution plan ----------------===//
//
// A translation in the sense of upstream's Target/ (like EmitC): it reads
// the final IR and writes another representation; it does not transform.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Target/ExecPlan/ExportExecPlan.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Analysis/CostModel.h"
#include "megaslide/Analysis/DeviceBuffers.h"
#include "megaslide/Target/Cuda/DsaKernels.h"
#include "megaslide/Transforms/Planning.h"
#include "megaslide/runtime/plan/Validate.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace megaslide;

namespace {

llvm::Error errorAt(Operation *op, const llvm::Twine &msg) {
  std::string loc;
  llvm::raw_string_ostream os(loc);
  os << "'" << op->getName() << "'";
  return llvm::createStringError("cannot export " + llvm::Twine(loc) + ": " +
                                 msg);
}

std::optional<exec::DType> dtypeOf(Type element) {
  if (element.isBF16())
    return exec::DType::BF16;
  if (element.isF16())
    return exec::DType::F16;
  if (element.isF32())
    return exec::DType::F32;
  if (element.isInteger(32))
    return exec::DType::I32;
  if (element.isInteger(64))
    return exec::DType::I64;
  return std::nullopt;
}

std::optional<exec::TensorType> tensorTypeOf(Type type) {
  auto ranked = dyn_cast<RankedTensorType>(type);
  if (!ranked || !ranked.hasStaticShape())
    return std::nullopt;
  std::optional<exec::DType> dtype = dtypeOf(ranked.getElementType());
  if (!dtype)
    return std::nullopt;
  return exec::TensorType{*dtype, std::vector<int64_t>(ranked.getShape().begin(),
                                                    ranked.getShape().end())};
}

/// An attribute as the runtime sees it, or nullopt when it has no plan
/// encoding.
std::optional<exec::Attr> convertAttr(Attribute attr) {
  if (auto b = dyn_cast<BoolAttr>(attr))
    return exec::Attr(int64_t(b.getValue()));
  if (auto i = dyn_cast<IntegerAttr>(attr))
    return exec::Attr(i.getValue().getSExtValue());
  if (auto f = dyn_cast<FloatAttr>(attr))
    return exec::Attr(f.getValueAsDouble());
  if (isa<UnitAttr>(attr))
    return exec::Attr(int64_t(1));
  if (auto s = dyn_cast<StringAttr>(attr))
    return exec::Attr(s.str());
  if (auto s = dyn_cast<FlatSymbolRefAttr>(attr))
    return exec::Attr(s.getValue().str());
  if (auto a = dyn_cast<DenseI64ArrayAttr>(attr))
    return exec::Attr(std::vector<int64_t>(a.asArrayRef()));
  if (auto a = dyn_cast<DenseI32ArrayAttr>(attr))
    return exec::Attr(std::vector<int64_t>(a.asArrayRef().begin(),
                                           a.asArrayRef().end()));
  if (auto a = dyn_cast<ArrayAttr>(attr)) {
    std::vector<int64_t> ints;
    for (Attribute e : a) {
      auto i = dyn_cast<IntegerAttr>(e);
      if (!i)
        return std::nullopt;
      ints.push_back(i.getValue().getSExtValue());
    }
    return exec::Attr(std::move(ints));
  }
  return std::nullopt;
}

/// The CUDA sources of the module's 3D-DSA configurations.
void addKernelModules(ModuleOp module, exec::ExecPlan &plan) {
  // Configurations the CUDA kernels do not support (e.g. an f32 step) get
  // no module: the cpu and sim backends run them, and the cuda backend
  // refuses the plan naming the configuration.
  for (const cuda::DsaConfig &config : cuda::collectDsaConfigs(module)) {
    cuda::DsaKernelPlan kernels;
    std::string unsupported;
    if (!cuda::planDsaKernels(config, kernels, unsupported))
      continue;
    exec::KernelModule kernel;
    kernel.name = cuda::configName(config);
    kernel.source = cuda::emitDsaKernelSource(config, kernels);
    llvm::raw_string_ostream os(kernel.manifest);
    cuda::writeDsaManifest(config, kernels, os);
    plan.kernelModules.push_back(std::move(kernel));
  }
}

/// Whether `op` carries a mark of megaslide-defer-updates.
bool isDeferredUpdateMark(Operation *op) {
  if (auto update = dyn_cast<schedule::HostAdamWOp>(op))
    return update.getDeferred();
  if (auto fetch = dyn_cast<schedule::FetchOp>(op))
    return fetch.getAppliesUpdate();
  return false;
}

class Exporter {
public:
  /// Without `attributes`, instructions have no `attrs` but the
  /// deferred-update marks.
  Exporter(ModuleOp module, func::FuncOp step, bool attributes,
           std::vector<Operation *> *origins)
      : module(module), step(step), attributes(attributes), origins(origins) {}
  /// The parameters, values and instructions.
  llvm::Expected<exec::ExecPlan> run();

private:
  llvm::Error declareParams();
  llvm::Expected<int64_t> newValue(mlir::Value v, exec::Home home,
                                   int64_t offset = -1);
  llvm::Error exportOp(Operation *op);
  void addInstruction(Operation *op, exec::Instruction inst);

  ModuleOp module;
  func::FuncOp step;
  exec::ExecPlan plan;
  llvm::DenseMap<mlir::Value, int64_t> ids;
  /// Events a timepoint stands for (a join stands for several).
  llvm::DenseMap<mlir::Value, llvm::SmallVector<int64_t, 2>> events;
  SymbolTableCollection symbols;
  bool attributes;
  std::vector<Operation *> *origins;
};

} // namespace

llvm::Error Exporter::declareParams() {
  for (auto param : module.getOps<graph::ParamOp>()) {
    std::optional<exec::TensorType> type = tensorTypeOf(param.getType());
    if (!type)
      return errorAt(param, "parameter '" + param.getSymName() +
                                "' has a type the runtime cannot hold");
    exec::Param p;
    p.name = param.getSymName().str();
    p.role = graph::stringifyParamRole(param.getRole()).str();
    p.group = graph::stringifyParamGroup(param.getGroup()).str();
    p.layer = param.getLayer();
    if (param.getOf())
      p.of = param.getOf()->str();
    p.type = *type;
    plan.params.push_back(std::move(p));
  }
  return llvm::Error::success();
}

llvm::Expected<int64_t> Exporter::newValue(mlir::Value v, exec::Home home,
                                           int64_t offset) {
  std::optional<exec::TensorType> type = tensorTypeOf(v.getType());
  if (!type) {
    std::string s;
    llvm::raw_string_ostream os(s);
    os << v.getType();
    return llvm::createStringError("cannot export a value of type " + s);
  }
  exec::Value value;
  value.type = *type;
  value.home = home;
  value.offset = offset;
  int64_t id = plan.values.size();
  plan.values.push_back(std::move(value));
  ids[v] = id;
  return id;
}

llvm::Error Exporter::exportOp(Operation *op) {
  if (isa<schedule::PackOp, schedule::BudgetCheckOp>(op))
    return llvm::Error::success();
  if (auto ret = dyn_cast<func::ReturnOp>(op)) {
    for (mlir::Value v : ret.getOperands())
      plan.outputs.push_back(ids.lookup(v));
    return llvm::Error::success();
  }
  if (auto join = dyn_cast<schedule::JoinOp>(op)) {
    auto &joined = events[join.getResult()];
    for (mlir::Value t : join.getTimepoints())
      joined.append(events[t]);
    return llvm::Error::success();
  }

  std::optional<exec::OpCode> code = planOpOf(op);
  if (!code)
    return errorAt(op, "not an op execution plans carry (runtime/plan/"
                       "Ops.def; docs/AddingAnOp.md)");
  exec::Instruction inst;
  inst.op = *code;
  if (std::optional<exec::Stream> stream = schedule::getStream(op))
    inst.stream = *stream;
  if (std::optional<int64_t> layer = graph::getLayer(op))
    inst.layer = *layer;

  if (auto record = dyn_cast<schedule::RecordOp>(op)) {
    inst.stream = record.getStream();
    inst.event = plan.numEvents++;
    events[record.getTimepoint()] = {*inst.event};
    addInstruction(op, std::move(inst));
    return llvm::Error::success();
  }
  if (auto wait = dyn_cast<schedule::WaitOp>(op)) {
    inst.stream = wait.getStream();
    for (int64_t event : events[wait.getTimepoint()]) {
      exec::Instruction one = inst;
      one.event = event;
      addInstruction(op, std::move(one));
    }
    return llvm::Error::success();
  }

  inst.operands.reserve(op->getNumOperands());
  inst.results.reserve(op->getNumResults());
  for (mlir::Value operand : op->getOperands()) {
    auto it = ids.find(operand);
    if (it == ids.end())
      return errorAt(op, "an operand is defined outside the training step");
    inst.operands.push_back(it->second);
  }

  auto offsets = op->getAttrOfType<DenseI64ArrayAttr>(schedule::kOffsetsAttrName);
  for (auto [i, result] : llvm::enumerate(op->getResults())) {
    exec::Home home = exec::Home::Host;
    int64_t offset = -1;
    if (offsets) {
      if (offsets.size() != static_cast<int64_t>(op->getNumResults()))
        return errorAt(op, "msched.offsets does not give one offset per result");
      home = exec::Home::Device;
      offset = offsets[i];
    } else if (inst.stream == exec::Stream::Compute ||
               inst.stream == exec::Stream::HostToDevice ||
               inst.stream == exec::Stream::Comm) {
      return errorAt(op, "a device result has no arena offset (run "
                         "megaslide-plan-memory first)");
    }
    llvm::Expected<int64_t> id = newValue(result, home, offset);
    if (!id)
      return errorAt(op, llvm::toString(id.takeError()));
    inst.results.push_back(*id);
  }
  // Views (reshapes, the in-place collectives) reuse their operand's bytes
  // (plan-memory gives them its offset).
  if (viewedValue(op))
    plan.values[inst.results[0]].viewOf = inst.operands[0];

  if (auto ws = op->getAttrOfType<DenseI64ArrayAttr>(schedule::kWorkspaceAttrName))
    for (size_t i = 0; i + 1 < ws.asArrayRef().size(); i += 2)
      inst.workspace.push_back({ws[i], ws[i + 1]});

  if (auto fetch = dyn_cast<schedule::FetchOp>(op))
    inst.param = fetch.getParam().str();
  else if (auto update = dyn_cast<schedule::HostAdamWOp>(op))
    inst.param = update.getParam().str();
  if (attributes) {
    NamedAttrList attrs(op->getAttrDictionary());
    op->getName().populateDefaultAttrs(attrs);
    for (NamedAttribute named : attrs) {
      StringRef key = named.getName().getValue();
      if (key.starts_with("msched.") || key == graph::kLayerAttrName)
        continue;
      if (key == "param" && isa<schedule::FetchOp, schedule::HostAdamWOp>(op))
        continue;
      std::optional<exec::Attr> value = convertAttr(named.getValue());
      if (!value)
        return errorAt(op, "attribute '" + key + "' has no plan encoding");
      inst.attrs.emplace(key.str(), std::move(*value));
    }
  } else if (isDeferredUpdateMark(op)) {
    // The replay times deferred updates by these (sim::buildTasks).
    inst.attrs.emplace(isa<schedule::FetchOp>(op) ? exec::kAppliesUpdateAttr
                                                  : exec::kDeferredAttr,
                       int64_t(1));
  }
  inst.cost = costInputsOf(op, symbols);
  addInstruction(op, std::move(inst));
  return llvm::Error::success();
}

void Exporter::addInstruction(Operation *op, exec::Instruction inst) {
  plan.instructions.push_back(std::move(inst));
  if (origins)
    origins->push_back(op);
}

llvm::Expected<exec::ExecPlan> Exporter::run() {
  if (llvm::Error err = declareParams())
    return std::move(err);
  Block &body = step.getBody().front();
  auto packs = body.getOps<schedule::PackOp>();
  if (packs.empty())
    return llvm::createStringError(
        "cannot export: the training step has no msched.pack (run "
        "megaslide-pipeline first)");
  schedule::PackOp pack = *packs.begin();
  plan.arenaBytes = pack.getArenaSize().value_or(0);
  plan.alignment = pack.getAlignment();
  // check-budget's guard goes into the header, for the device guard of the
  // cuda backend; the arena is the only device resource a plan has.
  for (auto check : body.getOps<schedule::BudgetCheckOp>()) {
    if (check.getResource() != "device_arena")
      return llvm::createStringError(
          "cannot export msched.budget_check of @" + check.getResource() +
          ": an execution plan carries the budget of @device_arena only");
    plan.arenaBudgetBytes = static_cast<int64_t>(check.getBudget());
  }
  if (auto buffers = module->getAttrOfType<IntegerAttr>(
          schedule::kGradientBuffersAttrName))
    plan.gradientBuffers = buffers.getInt();
  if (auto accum = module->getAttrOfType<IntegerAttr>(kGradAccumAttr))
    plan.gradAccum = accum.getInt();
  if (auto ema = module->getAttrOfType<StringAttr>(kEmaAttr))
    plan.emaDtype = ema.getValue().str();
  if (auto tier = module->getAttrOfType<DictionaryAttr>(kHostTierAttr)) {
    auto roles = tier.getAs<ArrayAttr>("roles");
    auto window = tier.getAs<IntegerAttr>("window_bytes");
    auto drives = tier.getAs<IntegerAttr>("drives");
    if (!roles || !window || !drives)
      return llvm::createStringError("cannot export " + kHostTierAttr.str() +
                                     " without roles, window_bytes and "
                                     "drives");
    for (Attribute role : roles)
      plan.tierRoles.push_back(cast<StringAttr>(role).str());
    plan.tierWindowBytes = window.getInt();
    plan.tierDrives = drives.getInt();
  }
  if (auto policy = module->getAttrOfType<StringAttr>(kHostStatePolicyAttr);
      policy && (policy.getValue() == exec::kInt8Moments ||
                 policy.getValue() == exec::kFactoredMoments))
    plan.hostState = policy.getValue().str();

  // About one instruction and one value per op (a wait of a join makes
  // more, bookkeeping ops none).
  size_t numOps = body.getOperations().size();
  plan.instructions.reserve(numOps);
  plan.values.reserve(body.getNumArguments() + numOps);
  if (origins)
    origins->reserve(numOps);
  for (BlockArgument arg : body.getArguments()) {
    llvm::Expected<int64_t> id = newValue(arg, exec::Home::Input);
    if (!id)
      return id.takeError();
    if (auto name = step.getArgAttrOfType<StringAttr>(arg.getArgNumber(),
                                                      "megaslide.name"))
      plan.values[*id].name = name.str();
    plan.inputs.push_back(*id);
  }
  for (Operation &op : body)
    if (llvm::Error err = exportOp(&op))
      return std::move(err);
  // Readers of version 2 run every plan without deferred updates or the
  // exact GELU.
  plan.version = plan.oldestVersion();
  return std::move(plan);
}

namespace {

llvm::Expected<exec::ExecPlan> exportStep(ModuleOp module, bool attributes,
                                          std::vector<Operation *> *origins) {
  FailureOr<func::FuncOp> step = getTrainStep(module);
  if (failed(step))
    return llvm::createStringError("cannot export: no @train_step function");
  return Exporter(module, *step, attributes, origins).run();
}

} // namespace

llvm::Expected<exec::ExecPlan>
megaslide::exportProgram(ModuleOp module, std::vector<Operation *> *origins) {
  return exportStep(module, /*attributes=*/false, origins);
}

llvm::Expected<exec::ExecPlan> megaslide::exportExecPlan(ModuleOp module) {
  llvm::Expected<exec::ExecPlan> plan =
      exportStep(module, /*attributes=*/true, nullptr);
  if (!plan)
    return plan.takeError();
  plan->plannedLiveBytes =
      findDevicePeak(collectDeviceBuffers(*getTrainStep(module))).bytes;
  addKernelModules(module, *plan);
  if (llvm::Error err = exec::validate(*plan))
    return llvm::createStringError("exported plan is inconsistent (a bug in "
                                   "the exporter or the passes): " +
                                   llvm::toString(std::move(err)));
  return plan;
}
