//===- CostModel.cpp - Hardware description and op costs ------------------===//

#include "megaslide/Analysis/CostModel.h"

#include "Graph/GraphOps.h"
#include "megaslide/Support/Json.h"
#include "Schedule/ScheduleOps.h"

#include "mlir/IR/BuiltinTypes.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"

#include <algorithm>

using namespace mlir;
using namespace megaslide;

namespace {

/// The JSON fields, each bound to its member.
struct Field {
  const char *key;
  double HardwareModel::*member;
  const char *unit;
};

const Field kFields[] = {
    {"bf16_dense_flops", &HardwareModel::bf16DenseFlops, "FLOP/s"},
    {"matmul_efficiency", &HardwareModel::matmulEfficiency, "0..1"},
    {"attention_efficiency", &HardwareModel::attentionEfficiency, "0..1"},
    {"vector_flops", &HardwareModel::vectorFlops, "FLOP/s"},
    {"hbm_bandwidth", &HardwareModel::hbmBandwidth, "B/s"},
    {"hbm_efficiency", &HardwareModel::hbmEfficiency, "0..1"},
    {"h2d_bandwidth", &HardwareModel::h2dBandwidth, "B/s"},
    {"d2h_bandwidth", &HardwareModel::d2hBandwidth, "B/s"},
    {"transfer_latency", &HardwareModel::transferLatency, "s"},
    {"launch_latency", &HardwareModel::launchLatency, "s"},
    {"host_memory_bandwidth", &HardwareModel::hostMemoryBandwidth, "B/s"},
    {"host_adamw_params_per_second", &HardwareModel::hostAdamWParamsPerSecond,
     "params/s"},
};

llvm::Error fieldError(llvm::StringRef source, llvm::StringRef key,
                       const llvm::Twine &problem) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 llvm::formatv("{0}: hardware field '{1}': {2}",
                                               source, key, problem.str())
                                     .str());
}

} // namespace

llvm::Expected<HardwareModel>
megaslide::parseHardwareModel(llvm::StringRef json, llvm::StringRef source) {
  llvm::Expected<llvm::json::Object> obj =
      parseJsonObject(json, source, "a hardware description");
  if (!obj)
    return obj.takeError();
  HardwareModel hw;
  hw.name = source.str();
  for (const auto &[key, value] : *obj) {
    if (key == "name") {
      if (std::optional<llvm::StringRef> s = value.getAsString()) {
        hw.name = s->str();
        continue;
      }
      return fieldError(source, key, "expected a string");
    }
    const Field *field =
        llvm::find_if(kFields, [&](const Field &f) { return key == f.key; });
    if (field == std::end(kFields))
      return fieldError(source, key,
                        "unknown field; see docs/CostModel.md for the list");
    std::optional<double> number = value.getAsNumber();
    if (!number || *number <= 0)
      return fieldError(
          source, key,
          llvm::formatv("expected a positive number in {0}", field->unit));
    if (llvm::StringRef(field->unit) == "0..1" && *number > 1)
      return fieldError(source, key, "an efficiency is a fraction in (0, 1]");
    hw.*(field->member) = *number;
  }
  return hw;
}

llvm::Expected<HardwareModel>
megaslide::loadHardwareModel(llvm::StringRef path) {
  auto buffer = llvm::MemoryBuffer::getFile(path);
  if (!buffer)
    return llvm::createStringError(
        buffer.getError(), "cannot read hardware description '%s': %s",
        path.str().c_str(), buffer.getError().message().c_str());
  return parseHardwareModel((*buffer)->getBuffer(), path);
}

llvm::json::Value megaslide::toJson(const HardwareModel &hw) {
  llvm::json::Object obj{{"name", hw.name}};
  for (const Field &f : kFields)
    obj[f.key] = hw.*(f.member);
  return obj;
}

uint64_t megaslide::tensorBytes(Type type) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  if (!tensor || !tensor.hasStaticShape())
    return 0;
  unsigned bits = tensor.getElementType().getIntOrFloatBitWidth();
  return tensor.getNumElements() * ((bits + 7) / 8);
}

OpCost megaslide::costOf(Operation *op, const HardwareModel &hw,
                         SymbolTableCollection &symbols) {
  OpCost cost;
  auto sumBytes = [](ValueRange values) {
    uint64_t total = 0;
    for (Value v : values)
      total += tensorBytes(v.getType());
    return total;
  };
  if (auto fetch = dyn_cast<sched::FetchOp>(op)) {
    // The host reads the persistent tensor and writes the working copy
    // into pinned staging, pipelined with the copy: the slower of the two.
    cost.bytes = tensorBytes(fetch.getType());
    auto source = symbols.lookupNearestSymbolFrom<graph::ParamOp>(
        fetch, fetch.getParamAttr());
    double read = source ? tensorBytes(source.getType()) : cost.bytes;
    double staging = (read + cost.bytes) / hw.hostMemoryBandwidth;
    cost.seconds =
        hw.transferLatency + std::max(cost.bytes / hw.h2dBandwidth, staging);
  } else if (isa<sched::HostToDeviceOp>(op)) {
    cost.bytes = sumBytes(op->getResults());
    cost.seconds = hw.transferLatency + cost.bytes / hw.h2dBandwidth;
  } else if (isa<sched::DeviceToHostOp>(op)) {
    cost.bytes = sumBytes(op->getResults());
    cost.seconds = hw.transferLatency + cost.bytes / hw.d2hBandwidth;
  } else if (auto adamw = dyn_cast<sched::HostAdamWOp>(op)) {
    auto type = cast<RankedTensorType>(adamw.getGrad().getType());
    cost.flops = 14 * type.getNumElements();
    cost.seconds = type.getNumElements() / hw.hostAdamWParamsPerSecond;
  } else if (auto counted = dyn_cast<graph::FlopCountOpInterface>(op)) {
    graph::FlopCount f = counted.getFlopCount();
    cost.flops = f.total();
    cost.bytes = sumBytes(op->getOperands()) + sumBytes(op->getResults());
    double compute =
        f.matmul / (hw.bf16DenseFlops * hw.matmulEfficiency) +
        f.attention / (hw.bf16DenseFlops * hw.attentionEfficiency) +
        f.other / hw.vectorFlops;
    double memory = cost.bytes / (hw.hbmBandwidth * hw.hbmEfficiency);
    cost.seconds = hw.launchLatency + std::max(compute, memory);
  } else if (isa<graph::GraphDialect>(op->getDialect()) &&
             !isa<graph::ReshapeOp>(op)) {
    // Data movement without arithmetic (split, concat, cast, zeros, ...).
    cost.bytes = sumBytes(op->getOperands()) + sumBytes(op->getResults());
    cost.seconds =
        hw.launchLatency + cost.bytes / (hw.hbmBandwidth * hw.hbmEfficiency);
  }
  return cost;
}
