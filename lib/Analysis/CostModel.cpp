//===- CostModel.cpp - What each op of a scheduled step costs -------------===//

#include "megaslide/Analysis/CostModel.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "dialects/Schedule/SchedulePolicies.h"
#include "megaslide/Transforms/Planning.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/BuiltinTypes.h"

using namespace mlir;
using namespace megaslide;

uint64_t megaslide::tensorBytes(Type type) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  if (!tensor || !tensor.hasStaticShape())
    return 0;
  unsigned bits = tensor.getElementType().getIntOrFloatBitWidth();
  return tensor.getNumElements() * ((bits + 7) / 8);
}

JobSize megaslide::jobSizeOf(ModuleOp module) {
  JobSize job;
  if (auto gpus = module->getAttrOfType<IntegerAttr>(kGpusPerNodeAttr))
    job.gpusPerNode = gpus.getInt();
  if (auto nodes = module->getAttrOfType<IntegerAttr>(kNodesAttr))
    job.nodes = nodes.getInt();
  return job;
}

/// The module's host-state policy (megaslide-plan-residency), if planned.
static std::optional<schedule::HostStatePolicy>
hostStatePolicyOf(Operation *op) {
  auto module = op->getParentOfType<ModuleOp>();
  auto name = module ? module->getAttrOfType<StringAttr>(kHostStatePolicyAttr)
                     : nullptr;
  if (!name)
    return std::nullopt;
  return schedule::symbolizeHostStatePolicy(name.getValue());
}

/// Whether `policy` stores moments other than as their declared type.
static bool storesMomentsOwnWay(schedule::HostStatePolicy policy) {
  return policy == schedule::HostStatePolicy::int8_moments ||
         policy == schedule::HostStatePolicy::factored_moments;
}

uint64_t megaslide::hostParamBytes(Operation *op, int64_t ranks) {
  auto param = cast<graph::ParamOp>(op);
  std::optional<schedule::HostStatePolicy> policy = hostStatePolicyOf(op);
  if (param.getRole() == graph::ParamRole::moment && policy &&
      storesMomentsOwnWay(*policy))
    return schedule::momentBytes(
        *policy, param.getTensorType().getShape(),
        StringRef(param.getSymName()).ends_with(".exp_avg_sq"));
  return shardBytes(param.getType(), ranks);
}

uint64_t megaslide::shardBytes(Type type, int64_t ranks) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  uint64_t bytes = tensorBytes(type);
  if (!tensor || ranks < 2 || !tensor.getNumElements())
    return bytes;
  int64_t elements = tensor.getNumElements();
  return bytes / elements *
         dist::shardRange(elements, 0, static_cast<int>(ranks)).size();
}

uint64_t megaslide::transferBytes(Operation *op) {
  Type type = op->getResult(0).getType();
  if (auto ranks = op->getAttrOfType<IntegerAttr>("ranks");
      ranks && isa<schedule::FetchOp, schedule::DeviceToHostOp>(op))
    return shardBytes(type, ranks.getInt());
  return tensorBytes(type);
}

std::optional<exec::OpCode> megaslide::planOpOf(Operation *op) {
  bool graphOp = isa<graph::GraphDialect>(op->getDialect());
  if (!graphOp && !isa<schedule::ScheduleDialect>(op->getDialect()))
    return std::nullopt;
  std::optional<exec::OpCode> code =
      exec::parseOpCode(op->getName().stripDialect());
  if (!code || exec::isScheduleOp(*code) == graphOp)
    return std::nullopt;
  return code;
}

sim::CostKind megaslide::costKindOf(Operation *op) {
  if (std::optional<exec::OpCode> code = planOpOf(op))
    return sim::costKindOf(*code);
  return isa<graph::GraphDialect>(op->getDialect()) ? sim::CostKind::Device
                                                    : sim::CostKind::None;
}

exec::CostInputs megaslide::costInputsOf(Operation *op,
                                         SymbolTableCollection &symbols) {
  exec::CostInputs in;
  auto sumBytes = [](ValueRange values) {
    uint64_t total = 0;
    for (Value v : values)
      total += tensorBytes(v.getType());
    return total;
  };
  switch (costKindOf(op)) {
  case sim::CostKind::None:
    break;
  case sim::CostKind::Fetch: {
    auto fetch = cast<schedule::FetchOp>(op);
    in.bytes = transferBytes(fetch);
    auto source = symbols.lookupNearestSymbolFrom<graph::ParamOp>(
        fetch, fetch.getParamAttr());
    in.sourceBytes =
        source ? shardBytes(source.getType(), fetch.getRanks().value_or(1))
               : in.bytes;
    break;
  }
  case sim::CostKind::HostToDevice:
  case sim::CostKind::DeviceToHost:
    in.bytes = transferBytes(op);
    break;
  case sim::CostKind::Collective: {
    in.bytes = tensorBytes(op->getResult(0).getType());
    in.ranks = op->getAttrOfType<IntegerAttr>("ranks").getInt();
    in.nodes = op->getAttrOfType<IntegerAttr>("nodes").getInt();
    break;
  }
  case sim::CostKind::HostAdamW: {
    // In a job each rank updates its shard of the parameter.
    Value grad = cast<schedule::HostAdamWOp>(op).getGrad();
    int64_t params = cast<RankedTensorType>(grad.getType()).getNumElements();
    if (auto out = grad.getDefiningOp<schedule::DeviceToHostOp>();
        out && out.getRanks())
      params =
          dist::shardRange(params, 0, static_cast<int>(*out.getRanks())).size();
    in.otherFlops = sim::kHostAdamWFlopsPerParam * params;
    // A policy that stores its moments its own way moves their bytes: the
    // master and moments read and written, the gradient read (the others
    // are priced at sim::kHostAdamWBytesPerParam).
    if (std::optional<schedule::HostStatePolicy> policy = hostStatePolicyOf(op);
        policy && storesMomentsOwnWay(*policy))
      in.bytes =
          2 * schedule::trainableStateBytes(
                  *policy, cast<RankedTensorType>(grad.getType()).getShape()) +
          tensorBytes(grad.getType());
    break;
  }
  case sim::CostKind::Device:
    if (auto counted = dyn_cast<graph::FlopCountOpInterface>(op)) {
      graph::FlopCount f = counted.getFlopCount();
      in.matmulFlops = f.matmul;
      in.attentionFlops = f.attention;
      in.otherFlops = f.other;
    }
    in.bytes = sumBytes(op->getOperands()) + sumBytes(op->getResults());
    break;
  }
  return in;
}
