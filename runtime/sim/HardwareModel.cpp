//===- HardwareModel.cpp - Hardware description and instruction time ------===//

#include "megaslide/runtime/sim/HardwareModel.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/ReadFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

using namespace megaslide;
using namespace megaslide::sim;

namespace {

/// The range a field may take. The lower bounds keep every figure derived
/// from a plan finite: the largest numerators (2^64 FLOPs or bytes of one
/// instruction, 2^48 bytes of one tensor) over the smallest rates give at
/// most ~1e19 s per instruction, and a step's sums stay far below the
/// double range. The upper bounds are far beyond any machine: a larger
/// value is a typo (a unit or an exponent off), not a faster machine.
struct Range {
  double min, max;
  const char *text; ///< as the error and docs/CostModel.md show it
};
constexpr Range kFlopRate{1e6, 1e18, "[1e6, 1e18]"};
constexpr Range kByteRate{1e6, 1e15, "[1e6, 1e15]"};
constexpr Range kParamRate{1e3, 1e15, "[1e3, 1e15]"};
constexpr Range kEfficiency{1e-3, 1, "[0.001, 1]"};
constexpr Range kLatency{0, 1, "(0, 1]"}; ///< 0 itself is refused as <= 0

/// The JSON fields, each bound to its member.
struct Field {
  const char *key;
  double HardwareModel::*member;
  const char *unit;
  Range range;
  /// A link between the GPUs of a job: only a job of several ranks uses
  /// it, and only its report echoes it.
  bool link = false;
  /// A drive of the NVMe tier: only a plan with one uses it.
  bool nvme = false;
};

const Field kFields[] = {
    {"bf16_dense_flops", &HardwareModel::bf16DenseFlops, "FLOP/s", kFlopRate},
    {"f32_dense_flops", &HardwareModel::f32DenseFlops, "FLOP/s", kFlopRate},
    {"gemm_efficiency", &HardwareModel::gemmEfficiency, "0..1", kEfficiency},
    {"attention_fwd_efficiency", &HardwareModel::attentionFwdEfficiency, "0..1",
     kEfficiency},
    {"attention_bwd_efficiency", &HardwareModel::attentionBwdEfficiency, "0..1",
     kEfficiency},
    {"dsa3d_fwd_efficiency", &HardwareModel::dsa3dFwdEfficiency, "0..1",
     kEfficiency},
    {"dsa3d_bwd_efficiency", &HardwareModel::dsa3dBwdEfficiency, "0..1",
     kEfficiency},
    {"vector_flops", &HardwareModel::vectorFlops, "FLOP/s", kFlopRate},
    {"hbm_bandwidth", &HardwareModel::hbmBandwidth, "B/s", kByteRate},
    {"hbm_efficiency", &HardwareModel::hbmEfficiency, "0..1", kEfficiency},
    {"elementwise_hbm_efficiency", &HardwareModel::elementwiseHbmEfficiency,
     "0..1", kEfficiency},
    {"dsa3d_offsets_hbm_efficiency", &HardwareModel::dsa3dOffsetsHbmEfficiency,
     "0..1", kEfficiency},
    {"h2d_bandwidth", &HardwareModel::h2dBandwidth, "B/s", kByteRate},
    {"d2h_bandwidth", &HardwareModel::d2hBandwidth, "B/s", kByteRate},
    {"transfer_latency", &HardwareModel::transferLatency, "s", kLatency},
    {"launch_latency", &HardwareModel::launchLatency, "s", kLatency},
    {"host_memory_bandwidth", &HardwareModel::hostMemoryBandwidth, "B/s",
     kByteRate},
    {"host_adamw_params_per_second", &HardwareModel::hostAdamWParamsPerSecond,
     "params/s", kParamRate},
    {"nvlink_bandwidth", &HardwareModel::nvlinkBandwidth, "B/s", kByteRate,
     true},
    {"nvlink_latency", &HardwareModel::nvlinkLatency, "s", kLatency, true},
    {"network_bandwidth", &HardwareModel::networkBandwidth, "B/s", kByteRate,
     true},
    {"network_latency", &HardwareModel::networkLatency, "s", kLatency, true},
    {"nvme_read_bandwidth", &HardwareModel::nvmeReadBandwidth, "B/s", kByteRate,
     false, true},
    {"nvme_write_bandwidth", &HardwareModel::nvmeWriteBandwidth, "B/s",
     kByteRate, false, true},
};

/// Fields of earlier descriptions and what replaced them: refused with a
/// pointer to the replacement rather than as unknown.
struct Removed {
  const char *key;
  const char *replacement;
};
const Removed kRemoved[] = {
    {"matmul_efficiency", "replaced by 'gemm_efficiency'"},
    {"attention_efficiency",
     "replaced by one efficiency per kernel family: "
     "'attention_fwd_efficiency', 'attention_bwd_efficiency', "
     "'dsa3d_fwd_efficiency', 'dsa3d_bwd_efficiency' (and "
     "'dsa3d_offsets_hbm_efficiency', 'elementwise_hbm_efficiency' for the "
     "memory-bound kernels)"},
};

llvm::Error error(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

llvm::Error fieldError(llvm::StringRef source, llvm::StringRef key,
                       const llvm::Twine &problem) {
  return error(llvm::formatv("{0}: hardware field '{1}': {2}", source, key,
                             problem.str()));
}

} // namespace

llvm::Expected<HardwareModel> sim::parseHardwareModel(llvm::StringRef json,
                                                      llvm::StringRef source) {
  llvm::Expected<llvm::json::Value> parsed = parseJson(json);
  if (!parsed)
    return error(source +
                 ": invalid JSON: " + llvm::toString(parsed.takeError()));
  const llvm::json::Object *obj = parsed->getAsObject();
  if (!obj)
    return error(source + ": a hardware description must be a JSON object");
  HardwareModel hw;
  hw.name = source.str();
  for (const auto &entry : *obj) {
    // Not a structured binding: the find_if lambda below captures `key`.
    const llvm::json::ObjectKey &key = entry.first;
    const llvm::json::Value &value = entry.second;
    if (key == "name") {
      if (std::optional<llvm::StringRef> s = value.getAsString()) {
        hw.name = s->str();
        continue;
      }
      return fieldError(source, key, "expected a string");
    }
    const Field *field =
        llvm::find_if(kFields, [&](const Field &f) { return key == f.key; });
    if (field == std::end(kFields)) {
      const Removed *removed = llvm::find_if(
          kRemoved, [&](const Removed &r) { return key == r.key; });
      if (removed != std::end(kRemoved))
        return fieldError(source, key,
                          llvm::Twine("no longer a field: ") +
                              removed->replacement + "; see docs/CostModel.md");
      return fieldError(source, key,
                        "unknown field; see docs/CostModel.md for the list");
    }
    std::optional<double> number = value.getAsNumber();
    if (!number || *number <= 0)
      return fieldError(
          source, key,
          llvm::formatv("expected a positive number in {0}", field->unit));
    // llvm::json reads 1e999 as infinity: not a rate or a latency.
    if (!std::isfinite(*number))
      return fieldError(
          source, key,
          llvm::formatv("expected a finite number in {0}", field->unit));
    const Range &range = field->range;
    if (*number < range.min || *number > range.max) {
      char shown[32];
      std::snprintf(shown, sizeof(shown), "%g", *number);
      if (llvm::StringRef(field->unit) == "0..1")
        return fieldError(source, key,
                          llvm::formatv("an efficiency is a fraction in {0}, "
                                        "got {1}",
                                        range.text, shown));
      return fieldError(source, key,
                        llvm::formatv("expected a number in {0} {1}, got {2}",
                                      range.text, field->unit, shown));
    }
    hw.*(field->member) = *number;
  }
  return hw;
}

llvm::Expected<HardwareModel> sim::loadHardwareModel(llvm::StringRef path) {
  llvm::Expected<std::string> text =
      readBoundedFile(path, kMaxHardwareModelBytes, "hardware description");
  if (!text)
    return text.takeError();
  return parseHardwareModel(*text, path);
}

llvm::json::Value sim::toJson(const HardwareModel &hw, bool links, bool nvme) {
  llvm::json::Object obj{{"name", hw.name}};
  for (const Field &f : kFields)
    if ((links || !f.link) && (nvme || !f.nvme))
      obj[f.key] = hw.*(f.member);
  return obj;
}

double sim::ringCollectiveSeconds(double bytes, int64_t ranks, int64_t nodes,
                                  const HardwareModel &hw) {
  if (ranks < 2)
    return 0;
  // Within a node every hop is NVLink; across nodes the ring's slowest hop
  // is the network share of a GPU, and each step waits on its latency.
  bool oneNode = nodes <= 1;
  double latency = oneNode ? hw.nvlinkLatency : hw.networkLatency;
  double bandwidth = oneNode
                         ? hw.nvlinkBandwidth
                         : std::min(hw.nvlinkBandwidth, hw.networkBandwidth);
  double n = static_cast<double>(ranks);
  return (n - 1) * (latency + bytes / (n * bandwidth));
}

HardwareModel sim::rankShare(const exec::ExecPlan &plan, HardwareModel hw) {
  for (const exec::Instruction &inst : plan.instructions) {
    if (costKindOf(inst.op) != CostKind::Collective || inst.cost.nodes < 1)
      continue;
    double ranksPerNode =
        static_cast<double>(inst.cost.ranks / inst.cost.nodes);
    hw.hostMemoryBandwidth /= ranksPerNode;
    hw.hostAdamWParamsPerSecond /= ranksPerNode;
    hw.nvmeReadBandwidth /= ranksPerNode;
    hw.nvmeWriteBandwidth /= ranksPerNode;
    break;
  }
  return hw;
}

double sim::allReduceScalarSeconds(int64_t ranks, int64_t nodes,
                                   const HardwareModel &hw) {
  if (ranks < 2)
    return 0;
  double latency = nodes <= 1 ? hw.nvlinkLatency : hw.networkLatency;
  return 2 * static_cast<double>(ranks - 1) * latency;
}

CostKind sim::costKindOf(exec::OpCode op) {
  switch (op) {
#define MEGASLIDE_OP(Name, Spelling, Cost, Family)                             \
  case exec::OpCode::Name:                                                     \
    return CostKind::Cost;
#include "megaslide/runtime/plan/Ops.def"
  }
  return CostKind::Device;
}

KernelFamily sim::kernelFamilyOf(exec::OpCode op) {
  switch (op) {
#define MEGASLIDE_OP(Name, Spelling, Cost, Family)                             \
  case exec::OpCode::Name:                                                     \
    return KernelFamily::Family;
#include "megaslide/runtime/plan/Ops.def"
  }
  return KernelFamily::None;
}

namespace {
/// Per family, in the enum's order: its name and where its efficiency is.
struct FamilyInfo {
  const char *name;
  double HardwareModel::*efficiency;
  bool computeBound;
};
const FamilyInfo kFamilies[] = {
    {"none", nullptr, false},
    {"gemm", &HardwareModel::gemmEfficiency, true},
    {"attention_fwd", &HardwareModel::attentionFwdEfficiency, true},
    {"attention_bwd", &HardwareModel::attentionBwdEfficiency, true},
    {"dsa3d_fwd", &HardwareModel::dsa3dFwdEfficiency, true},
    {"dsa3d_bwd", &HardwareModel::dsa3dBwdEfficiency, true},
    {"dsa3d_offsets", &HardwareModel::dsa3dOffsetsHbmEfficiency, false},
    {"elementwise", &HardwareModel::elementwiseHbmEfficiency, false},
};
static_assert(std::size(kFamilies) == kNumKernelFamilies,
              "a kernel family without its entry");

const FamilyInfo &info(KernelFamily family) {
  return kFamilies[static_cast<int>(family)];
}
} // namespace

const char *sim::kernelFamilyName(KernelFamily family) {
  return info(family).name;
}

std::optional<KernelFamily> sim::parseKernelFamily(llvm::StringRef name) {
  for (int f = 0; f < kNumKernelFamilies; ++f)
    if (name == kFamilies[f].name)
      return static_cast<KernelFamily>(f);
  return std::nullopt;
}

bool sim::isComputeBound(KernelFamily family) {
  return info(family).computeBound;
}

double HardwareModel::*sim::efficiencyMember(KernelFamily family) {
  return info(family).efficiency;
}

double sim::efficiencyOf(const HardwareModel &hw, KernelFamily family) {
  double HardwareModel::*member = info(family).efficiency;
  return member ? hw.*member : hw.hbmEfficiency;
}

double sim::hostMemoryBytes(CostKind kind, const exec::CostInputs &in) {
  if (kind == CostKind::Fetch)
    return static_cast<double>(in.sourceBytes) + static_cast<double>(in.bytes);
  if (kind == CostKind::HostAdamW)
    return in.bytes
               ? static_cast<double>(in.bytes)
               : static_cast<double>(in.otherFlops / kHostAdamWFlopsPerParam) *
                     kHostAdamWBytesPerParam;
  return 0;
}

namespace {
// Measured on the PTX of this commit's kernels (NVRTC 12, sm_90a, bf16):
// ElementwiseCodegenTest.InstructionCountsMatchThePtx prints and checks
// them. PTX counts, not SASS: ptxas may fuse or expand some, and MUFU and
// integer multiply-high issue at less than one per lane per clock, so
// these are estimates of the issue work, within tens of percent.
const KernelInstructions kKernelInstructions[] = {
    {"cast", 12.125},       {"add", 16.375},
    {"bias_add", 17.125},   {"gelu", 38},
    {"gelu_grad", 48.25},   {"silu", 28.875},
    {"silu_grad", 34.25},   {"modulate", 27.875},
    {"gate", 17.625},       {"flow_interpolate", 18.625},
    {"fm_loss_grad", 49},   {"copy2d", 13.375},
    {"patch_gather", 62},   {"unpatchify", 59},
    {"rope3d", 146},        {"embedding", 38},
    {"gelu_exact", 43.375}, {"gelu_exact_grad", 64.625},
    {"fm_loss_grad_w", 53},
};

/// The kernel an elementwise op's elements run through, and how many of
/// that kernel's elements (rope3d's: pairs) one element of the op's
/// largest tensor is.
struct OpKernel {
  exec::OpCode op;
  const char *kernel;
  double perElement;
};
const OpKernel kOpKernels[] = {
    {exec::OpCode::Cast, "cast", 1},
    {exec::OpCode::Add, "add", 1},
    {exec::OpCode::BiasAdd, "bias_add", 1},
    {exec::OpCode::Gelu, "gelu", 1},
    {exec::OpCode::GeluGrad, "gelu_grad", 1},
    {exec::OpCode::Silu, "silu", 1},
    {exec::OpCode::SiluGrad, "silu_grad", 1},
    {exec::OpCode::Modulate, "modulate", 1},
    {exec::OpCode::ModulateGrad, "modulate", 1},
    {exec::OpCode::Gate, "gate", 1},
    {exec::OpCode::GateGrad, "gate", 1},
    {exec::OpCode::FlowInterpolate, "flow_interpolate", 1},
    {exec::OpCode::FlowMatchingLossGrad, "fm_loss_grad", 1},
    {exec::OpCode::Split, "copy2d", 1},
    {exec::OpCode::Concat, "copy2d", 1},
    {exec::OpCode::Patchify, "patch_gather", 1},
    {exec::OpCode::Unpatchify, "unpatchify", 1},
    {exec::OpCode::Rope3d, "rope3d", 0.5},
    {exec::OpCode::Embedding, "embedding", 1},
};
} // namespace

llvm::ArrayRef<KernelInstructions> sim::elementwiseKernelInstructions() {
  return kKernelInstructions;
}

double sim::elementwiseInstructions(const exec::ExecPlan &plan,
                                    const exec::Instruction &inst) {
  const OpKernel *op = llvm::find_if(
      kOpKernels, [&](const OpKernel &k) { return k.op == inst.op; });
  if (op == std::end(kOpKernels))
    return 0;
  // gelu and gelu_grad {exact} run their erf kernels (GraphOpLowering).
  llvm::StringRef kernel = op->kernel;
  if (inst.hasAttr(exec::kExactAttr))
    kernel = inst.op == exec::OpCode::Gelu ? "gelu_exact" : "gelu_exact_grad";
  // A weighted loss's gradient (its per-sample weights) runs its own.
  if (inst.op == exec::OpCode::FlowMatchingLossGrad &&
      inst.operands.size() == 4)
    kernel = "fm_loss_grad_w";
  const KernelInstructions *k =
      llvm::find_if(kKernelInstructions, [&](const KernelInstructions &k) {
        return k.kernel == kernel;
      });
  int64_t elements = 0;
  for (const std::vector<int64_t> *ids : {&inst.operands, &inst.results})
    for (int64_t id : *ids)
      elements = std::max(elements, plan.values[id].type.numElements());
  return k->perElement * op->perElement * static_cast<double>(elements);
}

double sim::secondsFor(CostKind kind, KernelFamily family,
                       const exec::CostInputs &in, const HardwareModel &hw,
                       exec::DType resultType, double instructions) {
  // Integer inputs convert to double once, here; the planner's figures
  // depend on the exact order of these operations.
  double bytes = in.bytes;
  switch (kind) {
  case CostKind::None:
    return 0;
  case CostKind::Fetch: {
    // The host reads the persistent tensor and writes the working copy
    // into pinned staging, pipelined with the copy: the slower of the two.
    double staging = hostMemoryBytes(kind, in) / hw.hostMemoryBandwidth;
    return hw.transferLatency + std::max(bytes / hw.h2dBandwidth, staging);
  }
  case CostKind::HostToDevice:
    return hw.transferLatency + bytes / hw.h2dBandwidth;
  case CostKind::DeviceToHost:
    return hw.transferLatency + bytes / hw.d2hBandwidth;
  case CostKind::Collective:
    return ringCollectiveSeconds(bytes, in.ranks, in.nodes, hw);
  case CostKind::HostAdamW: {
    // Memory-bound on the host: never faster than its bytes allow.
    double params =
        static_cast<double>(in.otherFlops / kHostAdamWFlopsPerParam);
    return std::max(params / hw.hostAdamWParamsPerSecond,
                    hostMemoryBytes(kind, in) / hw.hostMemoryBandwidth);
  }
  case CostKind::Device: {
    // Roofline; an op without arithmetic (copy, cast, split, ...) is
    // memory-bound by construction. fp32 results cannot use the bf16
    // tensor-core path: their matmul and attention FLOPs run on CUDA
    // cores at f32_dense_flops, at the family's efficiency.
    double dense =
        resultType == exec::DType::F32 ? hw.f32DenseFlops : hw.bf16DenseFlops;
    bool tensor = isComputeBound(family);
    double attention =
        tensor ? in.attentionFlops / (dense * efficiencyOf(hw, family))
               : in.attentionFlops / hw.vectorFlops;
    double vector = instructions > 0 ? instructions / (hw.vectorFlops / 2)
                                     : in.otherFlops / hw.vectorFlops;
    double compute =
        in.matmulFlops / (dense * hw.gemmEfficiency) + attention + vector;
    double hbm = tensor || family == KernelFamily::None
                     ? hw.hbmEfficiency
                     : efficiencyOf(hw, family);
    double memory = bytes / (hw.hbmBandwidth * hbm);
    return hw.launchLatency + std::max(compute, memory);
  }
  }
  return 0;
}

static bool retains(const exec::Instruction &inst) {
  return inst.op == exec::OpCode::HostAdamW &&
         inst.hasAttr(exec::kDeferredAttr);
}

double sim::retainedBytes(const exec::ExecPlan &plan,
                          const exec::Instruction &inst) {
  // The gradient's elements it updates (its rank's shard in a job), in
  // the gradient's type.
  if (inst.operands.empty())
    return 0;
  const exec::TensorType &grad = plan.values[inst.operands.front()].type;
  int64_t params = std::min(
      grad.numElements(),
      static_cast<int64_t>(inst.cost.otherFlops / kHostAdamWFlopsPerParam));
  return 2.0 * static_cast<double>(params * exec::dtypeBytes(grad.dtype));
}

double sim::hostMemoryBytes(const exec::ExecPlan &plan,
                            const exec::Instruction &inst) {
  return retains(inst) ? retainedBytes(plan, inst)
                       : hostMemoryBytes(costKindOf(inst.op), inst.cost);
}

double sim::secondsFor(const exec::ExecPlan &plan,
                       const exec::Instruction &inst, const HardwareModel &hw) {
  if (retains(inst))
    return retainedBytes(plan, inst) / hw.hostMemoryBandwidth;
  exec::DType resultType = exec::DType::BF16;
  if (!inst.results.empty())
    resultType = plan.values[inst.results.front()].type.dtype;
  return secondsFor(costKindOf(inst.op), kernelFamilyOf(inst.op), inst.cost, hw,
                    resultType, elementwiseInstructions(plan, inst));
}
