//===- CudaPlan.cpp - GPU-free preparation of a plan for the GPU ----------===//

#include "megaslide/runtime/cuda/CudaPlan.h"

#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/plan/Liveness.h"
#include "megaslide/runtime/plan/StepRunner.h"
#include "megaslide/runtime/support/Json.h"
#include "megaslide/runtime/support/Packing.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace megaslide::cuda {

using exec::Home;
using exec::OpCode;
using exec::Stream;

namespace {

/// The ops that run the plan's generated 3D-DSA modules, with the kernel
/// each needs; every other graph op has a lowering (GraphOpLowering.h).
const char *dsaKernelOf(OpCode op) {
  switch (op) {
  case OpCode::Dsa3d:
    return "forward";
  case OpCode::Dsa3dGrad:
    return "backward";
  case OpCode::Dsa3dOffsets:
    return "offsets";
  default:
    return nullptr;
  }
}

//===----------------------------------------------------------------------===//
// Hazards: the last instruction of each stream touching each byte range
//===----------------------------------------------------------------------===//

/// Partitions [0, size) into segments, each remembering per stream the last
/// instruction (program order) that read or wrote it.
llvm::Expected<std::array<int64_t, 3>> tripleAttr(const exec::Instruction &inst,
                                                  llvm::StringRef name) {
  auto v = inst.intsAttr(name);
  if (!v || v->size() != 3)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "needs a 3-element '" + name +
                                       "' attribute");
  return std::array<int64_t, 3>{(*v)[0], (*v)[1], (*v)[2]};
}

} // namespace

//===----------------------------------------------------------------------===//
// 3D-DSA modules
//===----------------------------------------------------------------------===//

llvm::Expected<DsaModuleSpec> parseDsaManifest(const exec::KernelModule &m) {
  auto fail = [&](const llvm::Twine &what) {
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "kernel module '" + m.name + "': manifest " +
                                       what);
  };
  llvm::Expected<llvm::json::Value> json = parseJson(m.manifest);
  if (!json)
    return fail("is not JSON: " + llvm::toString(json.takeError()));
  const llvm::json::Object *root = json->getAsObject();
  if (!root)
    return fail("is not an object");
  // writeDsaManifest's form: {"configs": [...]}; a bare configuration too.
  const llvm::json::Object *cfg = root;
  if (const llvm::json::Array *configs = root->getArray("configs")) {
    cfg = nullptr;
    for (const llvm::json::Value &c : *configs) {
      const llvm::json::Object *o = c.getAsObject();
      if (!o)
        continue;
      std::optional<llvm::StringRef> name = o->getString("name");
      if (!cfg || (name && *name == m.name))
        cfg = o;
    }
    if (!cfg)
      return fail("has no configuration");
  }
  DsaModuleSpec spec;
  spec.name = m.name;
  auto triple = [&](llvm::StringRef key, std::array<int64_t, 3> &out) -> bool {
    const llvm::json::Array *a = cfg->getArray(key);
    if (!a || a->size() != 3)
      return false;
    for (size_t i = 0; i < 3; ++i) {
      std::optional<int64_t> v = (*a)[i].getAsInteger();
      if (!v)
        return false;
      out[i] = *v;
    }
    return true;
  };
  std::optional<int64_t> heads = cfg->getInteger("heads"),
                         headDim = cfg->getInteger("head_dim"),
                         radius = cfg->getInteger("radius");
  std::optional<llvm::StringRef> elem = cfg->getString("element_type");
  if (!triple("grid", spec.grid) || !triple("window", spec.window) ||
      !triple("tile", spec.tile) || !heads || !headDim || !radius || !elem)
    return fail("lacks the configuration (grid, window, tile, heads, "
                "head_dim, radius, element_type)");
  spec.heads = *heads;
  spec.headDim = *headDim;
  spec.radius = *radius;
  spec.elementType = elem->str();
  const llvm::json::Array *kernels = cfg->getArray("kernels");
  if (!kernels)
    return fail("lists no kernels");
  for (const llvm::json::Value &k : *kernels) {
    const llvm::json::Object *o = k.getAsObject();
    if (!o)
      return fail("has a kernel that is not an object");
    std::optional<llvm::StringRef> kind = o->getString("kind"),
                                   name = o->getString("name");
    const llvm::json::Array *grid = o->getArray("grid_for_batch_1");
    const llvm::json::Array *block = o->getArray("block");
    std::optional<int64_t> smem = o->getInteger("dynamic_shared_bytes");
    if (!kind || !name || !grid || grid->size() != 3 || !block ||
        block->empty() || !smem)
      return fail("has an incomplete kernel entry");
    DsaKernelSpec spec1;
    spec1.name = name->str();
    for (size_t i = 0; i < 3; ++i)
      spec1.grid[i] = (*grid)[i].getAsInteger().value_or(0);
    spec1.threads = static_cast<int>((*block)[0].getAsInteger().value_or(0));
    spec1.dynamicSharedBytes = *smem;
    if (spec1.threads <= 0 ||
        llvm::any_of(spec1.grid, [](int64_t g) { return g <= 0; }))
      return fail("has an empty launch for '" + spec1.name + "'");
    spec.kernels[kind->str()] = spec1;
  }
  return spec;
}

/// The module of a 3D-DSA instruction: same geometry, heads, head dim and
/// element type; for offset estimation also the same radius.
static llvm::Expected<int64_t>
matchDsaModule(const exec::ExecPlan &plan, const exec::Instruction &inst,
               llvm::ArrayRef<DsaModuleSpec> modules) {
  auto grid = tripleAttr(inst, "grid");
  if (!grid)
    return grid.takeError();
  auto window = tripleAttr(inst, "window");
  if (!window)
    return window.takeError();
  auto tile = tripleAttr(inst, "tile");
  if (!tile)
    return tile.takeError();
  const exec::TensorType &q = plan.values[inst.operands.at(0)].type;
  if (q.shape.size() != 4)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "query must be [B, N, H, Dh]");
  std::optional<int64_t> radius;
  if (inst.op == OpCode::Dsa3dOffsets)
    radius = inst.intAttr("radius").value_or(0);
  for (auto [i, m] : llvm::enumerate(modules))
    if (m.grid == *grid && m.window == *window && m.tile == *tile &&
        m.heads == q.shape[2] && m.headDim == q.shape[3] &&
        m.elementType == exec::dtypeName(q.dtype) &&
        (!radius || *radius == m.radius))
      return static_cast<int64_t>(i);
  return llvm::createStringError(
      llvm::inconvertibleErrorCode(),
      llvm::formatv(
          "no generated 3D-DSA kernel module for grid ({0},{1},{2}) "
          "window ({3},{4},{5}) tile ({6},{7},{8}) heads {9} head "
          "dim {10} {11}{12} (the plan has {13} module(s))",
          (*grid)[0], (*grid)[1], (*grid)[2], (*window)[0], (*window)[1],
          (*window)[2], (*tile)[0], (*tile)[1], (*tile)[2], q.shape[2],
          q.shape[3], exec::dtypeName(q.dtype),
          radius ? " radius " + std::to_string(*radius) : "", modules.size())
          .str());
}

//===----------------------------------------------------------------------===//
// Preparation
//===----------------------------------------------------------------------===//

int64_t weightStagingBytes(const exec::ExecPlan &plan, int64_t override) {
  auto aligned = [](int64_t b) { return alignTo(std::max<int64_t>(b, 1), 4096); };
  std::pair<int64_t, int64_t> lossAt = exec::lossSource(plan);
  std::map<std::pair<int64_t, bool>, int64_t> blocks;
  int64_t largest = 0, largestBlock = 0;
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    if (inst.op != OpCode::Fetch)
      continue;
    int64_t bytes = aligned(exec::copiedBytes(plan, inst));
    largest = std::max(largest, bytes);
    int64_t block = bytes;
    if (inst.layer)
      block = blocks[{*inst.layer,
                      lossAt.second >= 0 && static_cast<int64_t>(i) > lossAt.second}] +=
          bytes;
    largestBlock = std::max(largestBlock, block);
  }
  if (override > 0)
    return std::max(aligned(override), largest);
  return std::max(2 * largest, 2 * largestBlock);
}

llvm::Expected<PreparedPlan> prepareCudaPlan(const exec::ExecPlan &plan,
                                             const CudaOptions &options) {
  // cuBLASLt's fastest algorithms and the kernels' vector loads need
  // 256-byte aligned buffers (the plan's alignment is every device
  // offset's), and the fake device checks ordering in blocks of it.
  if (plan.alignment < 256)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "the plan's alignment is %lld bytes; the cuda backend needs at least "
        "256 (recompile the plan for this backend)",
        static_cast<long long>(plan.alignment));
  PreparedPlan p;
  size_t n = plan.instructions.size();
  p.instructions.resize(n);
  exec::Liveness live = exec::computeLiveness(plan);
  p.peakLiveBytes = live.peakLiveBytes;

  for (const exec::KernelModule &m : plan.kernelModules) {
    llvm::Expected<DsaModuleSpec> spec = parseDsaManifest(m);
    if (!spec)
      return spec.takeError();
    p.dsaModules.push_back(std::move(*spec));
  }

  std::set<KernelInstance> kernels;
  std::vector<int64_t> eventRecorder(plan.numEvents, -1);
  std::map<std::string, int64_t> lastUpdate; // param -> its host_adamw so far
  for (size_t i = 0; i < n; ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    PreparedInstruction &pi = p.instructions[i];
    for (int64_t r : inst.results)
      if (plan.values[r].home == Home::Device && !plan.values[r].viewOf)
        p.arenaHighWater =
            std::max(p.arenaHighWater,
                     plan.values[r].offset + plan.values[r].type.bytes());
    for (const exec::Range &w : inst.workspace)
      p.arenaHighWater = std::max(p.arenaHighWater, w.offset + w.size);

    if (exec::isScheduleOp(inst.op)) {
      if (inst.op == OpCode::Record && inst.event) {
        pi.recordedOn = inst.stream;
        eventRecorder[*inst.event] = i;
      }
      if (inst.op == OpCode::Fetch) {
        p.fetches.push_back(i);
        auto u = lastUpdate.find(inst.param);
        p.fetchUpdate.push_back(u == lastUpdate.end() ? -1 : u->second);
      }
      if (inst.op == OpCode::HostAdamW)
        lastUpdate[inst.param] = i;
      if ((inst.op == OpCode::Fetch || inst.op == OpCode::HostToDevice) &&
          inst.stream != Stream::HostToDevice && inst.stream != Stream::Compute)
        return instError(i, inst,
                         "host-to-device copies must be on the h2d "
                         "or compute stream");
      if (inst.op == OpCode::DeviceToHost && inst.stream == Stream::Host)
        return instError(i, inst, "a device-to-host copy on the host stream");
      if (inst.op == OpCode::HostAdamW && inst.stream != Stream::Host)
        return instError(i, inst, "host_adamw must be on the host stream");
      if ((inst.op == OpCode::AllGather || inst.op == OpCode::ReduceScatter) &&
          !isGpuStream(inst.stream))
        return instError(i, inst, "a collective on the host stream");
      continue;
    }
    if (!isGpuStream(inst.stream))
      return instError(i, inst, "a graph op on the host stream");
    // One kernel scratch buffer and one cuBLASLt workspace serve every
    // graph op: two streams running graph ops could overlap in them.
    if (inst.stream != Stream::Compute)
      return instError(i, inst,
                       "a graph op on the " +
                           llvm::Twine(exec::streamName(inst.stream)) +
                           " stream; the cuda backend runs graph ops on the "
                           "compute stream only (they share its kernel "
                           "scratch and cuBLASLt workspace)");
    for (int64_t id : llvm::concat<const int64_t>(inst.operands, inst.results))
      if (plan.values[id].home != Home::Device || deviceOffset(plan, id) < 0)
        return instError(i, inst,
                         "value %" + llvm::Twine(id) +
                             " is not in the device arena (graph ops run on "
                             "the device)");
    if (const char *kind = dsaKernelOf(inst.op)) {
      llvm::Expected<int64_t> m = matchDsaModule(plan, inst, p.dsaModules);
      if (!m)
        return instError(i, inst, llvm::toString(m.takeError()));
      pi.dsaModule = *m;
      const DsaModuleSpec &spec = p.dsaModules[*m];
      if (!spec.kernels.count(kind))
        return instError(
            i, inst, "module '" + spec.name + "' has no " + kind + " kernel");
      if (inst.op == OpCode::Dsa3dGrad) {
        if (!spec.kernels.count("backward_keys"))
          return instError(i, inst,
                           "module '" + spec.name +
                               "' has no backward_keys kernel");
        // Delta, fp32 [B, H, N] (q is [B, N, H, D]): the plan's workspace,
        // or the backend's own scratch.
        const exec::TensorType &q = plan.values[inst.operands[0]].type;
        int64_t bytes = q.shape[0] * q.shape[1] * q.shape[2] * 4;
        const std::vector<exec::Range> &ws = inst.workspace;
        if (!ws.empty() && ws[0].size >= bytes)
          pi.deltaOffset = ws[0].offset;
        else
          p.dsaFallbackBytes = std::max(p.dsaFallbackBytes, bytes);
      }
      continue;
    }
    std::vector<exec::TensorType> ops, res;
    for (int64_t id : inst.operands)
      ops.push_back(plan.values[id].type);
    for (int64_t id : inst.results)
      res.push_back(plan.values[id].type);
    llvm::Expected<LoweredOp> lowered = lowerGraphOp(inst, ops, res);
    if (!lowered)
      return instError(i, inst, llvm::toString(lowered.takeError()));
    for (const KernelInstance &k : kernelsOf(*lowered))
      kernels.insert(k);
    p.scratchBytes = std::max(p.scratchBytes, lowered->scratchBytes);
    pi.lowered = std::move(*lowered);
  }
  p.eventRecorder = eventRecorder;
  p.kernels.assign(kernels.begin(), kernels.end());
  p.elementwiseSource = emitElementwiseSource(p.kernels);

  layoutHostPools(plan, live, options, p);
  p.stagingBytes = weightStagingBytes(plan, options.stagingBytes);

  // Cross-stream write-after-read/write waits, in program order.
  std::vector<std::vector<Dependency>> waits =
      exec::crossStreamWaits(plan, p.hostOffset, p.hostPoolBytes);
  p.needsDoneEvent.assign(n, false);
  for (size_t i = 0; i < n; ++i) {
    PreparedInstruction &pi = p.instructions[i];
    pi.waits = std::move(waits[i]);
    for (const Dependency &d : pi.waits)
      if (isGpuStream(d.stream))
        p.needsDoneEvent[d.instruction] = true;
  }
  exec::LossGuard guard = exec::lossGuard(plan);
  p.lossValue = guard.value;
  p.lossDef = guard.def;
  p.firstUpdate = guard.firstUpdate;
  return p;
}

} // namespace megaslide::cuda
