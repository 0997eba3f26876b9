//===- PlanReport.cpp - What a planned training step costs ----------------===//

#include "megaslide/Analysis/PlanReport.h"

#include "megaslide/Analysis/DeviceBuffers.h"
#include "megaslide/Support/Units.h"

#include "dialects/Graph/GraphOps.h"
#include "dialects/Schedule/ScheduleOps.h"
#include "megaslide/Transforms/Planning.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"
#include "megaslide/runtime/sim/SimBackend.h"
#include "megaslide/runtime/sim/Timeline.h"

#include "llvm/Support/FormatVariadic.h"

#include <array>
#include <map>

using namespace mlir;
using namespace megaslide;

namespace {

const char *roleCategory(graph::ParamRole role) {
  switch (role) {
  case graph::ParamRole::master:
    return "fp32 master weights";
  case graph::ParamRole::moment:
    return "AdamW moments";
  case graph::ParamRole::weight:
    return "persistent bf16 weights";
  case graph::ParamRole::gradient:
    return "persistent gradients";
  case graph::ParamRole::frozen:
    return "frozen buffers";
  }
  return "?";
}

template <typename Map>
std::vector<std::pair<std::string, uint64_t>> sorted(const Map &m) {
  std::vector<std::pair<std::string, uint64_t>> v(m.begin(), m.end());
  llvm::stable_sort(v, [](auto &a, auto &b) { return a.second > b.second; });
  return v;
}

/// The recipe's host buffers, which a job shards over its ranks as it
/// does the parameters' state.
bool isShardedResource(schedule::ResourceOp resource) {
  return llvm::is_contained(
      {kRetainedGradientsResource, kGradientAccumulatorResource, kEmaResource},
      resource.getSymName());
}

/// The experts of a two-expert run besides the plan's own model.
int64_t otherExperts(ModuleOp module) {
  auto experts = module->getAttrOfType<IntegerAttr>(kExpertsAttr);
  return experts ? experts.getInt() - 1 : 0;
}

/// Host side: totals by category, and each block's persistent state.
void accountHost(ModuleOp module, PlanReport &r) {
  uint64_t params = 0;
  for (auto param : module.getOps<graph::ParamOp>()) {
    if (param.getRole() == graph::ParamRole::master ||
        param.getRole() == graph::ParamRole::frozen)
      params += param.getNumElements();
    if (IntegerAttr l = param.getLayerAttr()) {
      PlanReport::Layer &layer = r.layers[l.getInt()];
      layer.hostBytes += hostParamBytes(param);
      if (param.getRole() == graph::ParamRole::master)
        layer.params += param.getNumElements();
    }
  }
  r.hostByCategory = hostMemoryByCategory(module);
  for (const auto &[name, bytes] : r.hostByCategory)
    r.hostTotal += bytes;
  uint64_t allowance = 0;
  if (auto os = module.lookupSymbol<schedule::ResourceOp>(kOsAllowanceResource))
    allowance = os.getSize();
  if (params)
    r.hostBytesPerParam = double(r.hostTotal - allowance) / double(params);
}

/// The deferred mode's replay figures: what its updates take, when the
/// last ends against the end of the forward, and the block with the most
/// update time against that block's forward compute.
void deferredFigures(const exec::ExecPlan &plan, const sim::SimResult &sim,
                     PlanReport::Recipe &recipe) {
  std::map<int64_t, double> byBlock, forward;
  for (const sim::SimResult::Update &u : sim.updates) {
    recipe.updateSeconds += u.end - u.start;
    recipe.updatesEnd = std::max(recipe.updatesEnd, u.end);
    if (std::optional<int64_t> l = plan.instructions[u.fetch].layer)
      byBlock[*l] += u.end - u.start;
  }
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    if (inst.op == exec::OpCode::FlowMatchingLoss) {
      recipe.forwardEnd = sim.start[i];
      break;
    }
    if (inst.stream == exec::Stream::Compute && inst.layer)
      forward[*inst.layer] += sim.end[i] - sim.start[i];
  }
  for (const auto &[block, seconds] : byBlock)
    if (seconds > recipe.blockUpdateSeconds) {
      recipe.block = block;
      recipe.blockUpdateSeconds = seconds;
      recipe.blockForwardSeconds = forward[block];
    }
}

} // namespace

/// The host-state policy with the fewest bytes per parameter, of every
/// policy the schedule dialect declares that `module`'s job can use.
static schedule::HostStatePolicy smallestHostStatePolicy(ModuleOp module) {
  bool job = jobSizeOf(module).ranks() > 1;
  std::optional<schedule::HostStatePolicy> smallest;
  for (schedule::HostStatePolicy p : schedule::hostStatePolicies())
    if (!(job && schedule::oneRankOnly(p)) &&
        (!smallest ||
         schedule::bytesPerParam(p) < schedule::bytesPerParam(*smallest)))
      smallest = p;
  return *smallest;
}

/// The host bytes the smallest host-state policy and a bf16 EMA would free
/// on a node (its share of a job's sharded state).
struct Savings {
  uint64_t byPolicy, byEma;
};
static Savings savings(ModuleOp module, const RecipeBytes &b,
                       schedule::HostStatePolicy policy,
                       schedule::EmaPolicy ema) {
  using schedule::bytesPerParam;
  schedule::HostStatePolicy smallest = smallestHostStatePolicy(module);
  uint64_t byPolicy =
      (bytesPerParam(policy) -
       std::min(bytesPerParam(policy), bytesPerParam(smallest))) *
      b.trainableParams;
  uint64_t byEma =
      ema == schedule::EmaPolicy::f32
          ? (bytesPerParam(ema) - bytesPerParam(schedule::EmaPolicy::bf16)) *
                b.trainableParams
          : 0;
  return {nodeShare(module, byPolicy), nodeShare(module, byEma)};
}

/// What would let the EMA alone (streaming updates) fit when `shortfall`
/// more host bytes are needed.
static std::string emaAdvice(ModuleOp module, uint64_t shortfall,
                             const RecipeBytes &b,
                             schedule::HostStatePolicy policy,
                             schedule::EmaPolicy ema) {
  schedule::HostStatePolicy smallest = smallestHostStatePolicy(module);
  auto [byPolicy, byEma] = savings(module, b, policy, ema);
  std::string advice = "to keep the EMA even with streaming updates, " +
                       formatBytes(shortfall) + " more: ";
  if (byPolicy >= shortfall)
    return advice + "--host-state-policy " +
           schedule::stringifyEnum(smallest).str() + " (frees " +
           formatBytes(byPolicy) + ")";
  if (byEma >= shortfall)
    return advice + "--ema-dtype bf16 (frees " + formatBytes(byEma) + ")";
  if (byPolicy + byEma >= shortfall)
    return advice + "--host-state-policy " +
           schedule::stringifyEnum(smallest).str() +
           " with --ema-dtype bf16 (free " + formatBytes(byPolicy + byEma) +
           ")";
  return advice + "a host with more memory (--host-mem)";
}

/// The "Training recipe" of the report: the update mode and why, each
/// feature's host bytes and time, both update modes (the other one by
/// replaying the program with its marks toggled).
llvm::Error megaslide::planRecipe(ModuleOp module,
                                  const exec::ExecPlan &program,
                                  const HardwareModel &hw, PlanReport &r) {
  PlanReport::Recipe &recipe = r.recipe;
  auto update = module->getAttrOfType<StringAttr>(kUpdateAttr);
  if (!update)
    return llvm::Error::success();
  recipe.update = update.str();
  recipe.chosenByAuto = module->hasAttr(kUpdateAutoAttr);
  if (auto k = module->getAttrOfType<IntegerAttr>(kGradAccumAttr))
    recipe.gradAccum = k.getInt();
  schedule::EmaPolicy ema = schedule::EmaPolicy::none;
  if (auto e = module->getAttrOfType<StringAttr>(kEmaAttr))
    ema = schedule::symbolizeEmaPolicy(e.getValue())
              .value_or(schedule::EmaPolicy::none);
  recipe.ema = schedule::stringifyEnum(ema).str();
  const RecipeBytes &b = recipe.bytes =
      recipeBytes(module, recipe.gradAccum, ema);
  uint64_t declared = 0;
  for (StringRef name :
       {kRetainedGradientsResource, kGradientAccumulatorResource, kEmaResource})
    if (auto resource = module.lookupSymbol<schedule::ResourceOp>(name))
      declared += nodeShare(module, resource.getSize());
  uint64_t others = r.hostTotal - declared;
  recipe.hostFreeBytes = r.hostBudget > others ? r.hostBudget - others : 0;
  uint64_t params = b.trainableParams;

  // Both modes: this plan's replay and the other's.
  bool deferred = recipe.update == "deferred";
  exec::ExecPlan other = program;
  exec::setDeferredUpdates(other, !deferred);
  llvm::Expected<sim::SimResult> mine = sim::simulateStep(program, hw);
  if (!mine)
    return mine.takeError();
  llvm::Expected<sim::SimResult> theirs = sim::simulateStep(other, hw);
  if (!theirs)
    return theirs.takeError();
  const sim::SimResult &deferredSim = deferred ? *mine : *theirs;
  const sim::SimResult &streamingSim = deferred ? *theirs : *mine;
  auto fill = [&](PlanReport::Recipe::Mode &m, StringRef name, uint64_t bytes,
                  const sim::SimResult &sim, bool planned) {
    m.name = name.str();
    m.hostBytes = bytes;
    m.hostFits = bytes <= recipe.hostFreeBytes;
    m.stepSeconds = sim.makespan;
    m.hostOptimizerSeconds = sim.busy[static_cast<int>(exec::Stream::Host)];
    m.note = planned ? "this plan" : "replayed with the other mode's marks";
  };
  fill(recipe.deferred, "deferred",
       nodeShare(module, b.deferredBytes() + b.emaBytes), deferredSim,
       deferred);
  fill(recipe.streaming, "streaming", nodeShare(module, b.emaBytes),
       streamingSim, !deferred);
  recipe.streaming.note +=
      "; clips with the previous step's global norm (an approximation) and "
      "stops at a non-finite gradient";
  if (recipe.gradAccum > 1) {
    recipe.streaming.available = false;
    recipe.streaming.note = "cannot accumulate gradients (grad-accum > 1)";
  }
  deferredFigures(program, deferredSim, recipe);

  // Host passes the replay does not hold, per optimizer step: a rank's
  // over its shard, at its share of the host (`hw` is the rank's).
  double gradPerParam = params ? double(b.gradientBytes) / double(params) : 0;
  double accumulatorPerParam = schedule::kGradAccumBytesPerParam;
  double shard = double(params) / double(jobSizeOf(module).ranks());
  recipe.accumulateSeconds = double(recipe.gradAccum - 1) * shard *
                             (gradPerParam + 2 * accumulatorPerParam) /
                             hw.hostMemoryBandwidth;
  double emaPerParam = schedule::bytesPerParam(ema);
  if (emaPerParam > 0)
    recipe.emaSeconds = shard * (4 + 2 * emaPerParam) / hw.hostMemoryBandwidth;
  // A tiered EMA of streaming updates is read and written in that pass,
  // through the window, which the drives bound (the deferred update moves
  // it with each AdamW, in the replay).
  if (std::optional<HostTier> tier = hostTierOf(module);
      tier && !deferred && llvm::is_contained(tier->roles, "ema")) {
    double bytes = double(tierRoleBytesPerRank(module, "ema"));
    double drives = double(std::max<int64_t>(1, tier->drives));
    double io = bytes / (drives * hw.nvmeReadBandwidth) +
                bytes / (drives * hw.nvmeWriteBandwidth);
    r.tier.bytesPerStep += uint64_t(bytes);
    r.tier.ioSeconds += io;
    r.tier.stepGrowthSeconds += std::max(0.0, io - recipe.emaSeconds);
    recipe.emaSeconds = std::max(recipe.emaSeconds, io);
  }
  recipe.optimizerStepSeconds = double(recipe.gradAccum) * r.predictedSeconds +
                                recipe.accumulateSeconds + recipe.emaSeconds;

  recipe.deviceAccumulationBytes = params * schedule::kGradAccumBytesPerParam;
  recipe.deviceAccumulationFits =
      uint64_t(r.devicePeak) + recipe.deviceAccumulationBytes <= r.arenaBudget;

  auto policy = schedule::symbolizeHostStatePolicy(r.hostStatePolicy)
                    .value_or(schedule::HostStatePolicy::master_moments);
  uint64_t needs = nodeShare(module, b.deferredBytes() + b.emaBytes);
  if (!recipe.chosenByAuto)
    recipe.reason = "--update " + recipe.update + " given";
  else if (deferred && recipe.gradAccum > 1)
    recipe.reason = "update=auto: grad-accum " +
                    std::to_string(recipe.gradAccum) +
                    " needs the deferred update";
  else if (int64_t ranks = jobSizeOf(module).ranks(); deferred && ranks > 1)
    recipe.reason = "update=auto: a job of " + std::to_string(ranks) +
                    " ranks needs the deferred update";
  else
    recipe.reason = "update=auto: deferring needs " + formatBytes(needs) +
                    (deferred ? ", within the " : ", more than the ") +
                    formatBytes(recipe.hostFreeBytes) + " host-mem leaves";
  if (deferred && !recipe.deferred.hostFits)
    recipe.advice.push_back(
        deferAdvice(module, needs - recipe.hostFreeBytes, b, policy, ema));
  if (!deferred && !recipe.deferred.hostFits && recipe.chosenByAuto)
    recipe.advice.push_back(
        deferAdvice(module, needs - recipe.hostFreeBytes, b, policy, ema));
  if (!recipe.streaming.hostFits && b.emaBytes)
    recipe.advice.push_back(
        emaAdvice(module, nodeShare(module, b.emaBytes) - recipe.hostFreeBytes,
                  b, policy, ema));
  return llvm::Error::success();
}

RecipeBytes megaslide::recipeBytes(ModuleOp module, int64_t gradAccum,
                                   schedule::EmaPolicy ema) {
  RecipeBytes r;
  auto step = module.lookupSymbol<func::FuncOp>("train_step");
  if (!step)
    return r;
  step.walk([&](schedule::HostAdamWOp update) {
    auto grad = cast<RankedTensorType>(update.getGrad().getType());
    r.trainableParams += grad.getNumElements();
    r.gradientBytes += tensorBytes(grad);
  });
  if (gradAccum > 1)
    r.accumulatorBytes = r.trainableParams * schedule::kGradAccumBytesPerParam;
  r.emaBytes = r.trainableParams * schedule::bytesPerParam(ema);
  return r;
}

/// "X (N B/param)"
static std::string perParam(uint64_t bytes, uint64_t params) {
  return llvm::formatv("{0} ({1} B/param)", formatBytes(bytes),
                       params ? bytes / params : 0)
      .str();
}

std::string megaslide::explainDeferredBytes(const RecipeBytes &b) {
  std::string text = b.accumulatorBytes
                         ? "fp32 gradient accumulator " +
                               perParam(b.accumulatorBytes, b.trainableParams)
                         : "retained gradients " +
                               perParam(b.gradientBytes, b.trainableParams);
  if (b.emaBytes)
    text += ", EMA weights " + perParam(b.emaBytes, b.trainableParams);
  return text;
}

std::string megaslide::deferAdvice(ModuleOp module, uint64_t shortfall,
                                   const RecipeBytes &b,
                                   schedule::HostStatePolicy policy,
                                   schedule::EmaPolicy ema) {
  schedule::HostStatePolicy smallest = smallestHostStatePolicy(module);
  auto [byPolicy, byEma] = savings(module, b, policy, ema);
  std::string policyFlag =
      ("--host-state-policy " + schedule::stringifyEnum(smallest)).str();
  std::vector<std::string> enough;
  if (byPolicy >= shortfall)
    enough.push_back(policyFlag + " (frees " + formatBytes(byPolicy) + ")");
  if (byEma && byEma >= shortfall)
    enough.push_back("--ema-dtype bf16 (frees " + formatBytes(byEma) + ")");
  if (enough.empty() && byPolicy && byEma && byPolicy + byEma >= shortfall)
    enough.push_back(policyFlag + " with --ema-dtype bf16 (free " +
                     formatBytes(byPolicy + byEma) + ")");
  bool job = jobSizeOf(module).ranks() > 1; // a job has no streaming update
  std::string advice =
      (job ? "the job's deferred update needs " : "to defer, ") +
      formatBytes(shortfall) + " more: ";
  if (enough.empty())
    advice += "a host with more memory (--host-mem)";
  for (auto [i, e] : llvm::enumerate(enough))
    advice += (i ? " or " : "") + e;
  if (job)
    return advice;
  return advice + "; --update streaming instead clips with the previous "
                  "step's global norm (an approximation) and stops at a "
                  "non-finite gradient rather than skipping the step";
}

std::optional<HostTier> megaslide::hostTierOf(ModuleOp module) {
  auto tier = module->getAttrOfType<DictionaryAttr>(kHostTierAttr);
  auto roles = tier ? tier.getAs<ArrayAttr>("roles") : ArrayAttr();
  auto window = tier ? tier.getAs<IntegerAttr>("window_bytes") : IntegerAttr();
  auto drives = tier ? tier.getAs<IntegerAttr>("drives") : IntegerAttr();
  if (!roles || !window || !drives)
    return std::nullopt;
  HostTier t;
  t.drives = drives.getInt();
  for (Attribute role : roles)
    t.roles.push_back(cast<StringAttr>(role).str());
  t.windowBytes = window.getInt();
  return t;
}

/// The tierable role (exec::kTierRoles) of a parameter's state, "" if none.
static StringRef tierRoleOf(graph::ParamOp param) {
  return param.getRole() == graph::ParamRole::moment ? "moment" : "";
}
static bool isTiered(const std::optional<HostTier> &tier, StringRef role) {
  return tier && !role.empty() && llvm::is_contained(tier->roles, role);
}

/// One rank's EMA bytes of the master `param` (0 without an EMA).
static uint64_t emaShardBytes(ModuleOp module, graph::ParamOp param) {
  auto ema = module->getAttrOfType<StringAttr>(kEmaAttr);
  std::optional<schedule::EmaPolicy> policy =
      ema ? schedule::symbolizeEmaPolicy(ema.getValue()) : std::nullopt;
  if (!policy || !module.lookupSymbol<schedule::ResourceOp>(kEmaResource))
    return 0;
  int64_t ranks = jobSizeOf(module).ranks();
  uint64_t bytes = param.getNumElements() * schedule::bytesPerParam(*policy);
  return (bytes + ranks - 1) / ranks;
}

uint64_t megaslide::tierRoleBytesPerRank(ModuleOp module, StringRef role) {
  int64_t ranks = jobSizeOf(module).ranks();
  uint64_t bytes = 0;
  if (role == "ema") {
    auto ema = module.lookupSymbol<schedule::ResourceOp>(kEmaResource);
    return ema ? (ema.getSize() + ranks - 1) / ranks : 0;
  }
  // The tier holds fp32 and bf16 tensors, not int8 or factored moments.
  if (auto policy = module->getAttrOfType<StringAttr>(kHostStatePolicyAttr);
      role == "moment" && policy &&
      (policy.getValue() == exec::kInt8Moments ||
       policy.getValue() == exec::kFactoredMoments))
    return 0;
  for (auto param : module.getOps<graph::ParamOp>())
    if (tierRoleOf(param) == role)
      bytes += shardBytes(param.getType(), ranks);
  return bytes;
}

uint64_t megaslide::largestTierParamBytes(ModuleOp module,
                                          ArrayRef<std::string> roles) {
  int64_t ranks = jobSizeOf(module).ranks();
  std::map<StringRef, uint64_t> byParam;
  bool moments = llvm::is_contained(roles, "moment");
  bool ema = llvm::is_contained(roles, "ema");
  for (auto param : module.getOps<graph::ParamOp>()) {
    if (moments && param.getRole() == graph::ParamRole::moment &&
        param.getOfAttr())
      byParam[param.getOfAttr().getValue()] +=
          shardBytes(param.getType(), ranks);
    if (ema && param.getRole() == graph::ParamRole::master)
      byParam[param.getSymName()] += emaShardBytes(module, param);
  }
  uint64_t largest = 0;
  for (const auto &entry : byParam)
    largest = std::max(largest, entry.second);
  return largest;
}

std::vector<std::pair<std::string, uint64_t>>
megaslide::nvmeBytesByCategory(ModuleOp module) {
  std::optional<HostTier> tier = hostTierOf(module);
  if (!tier)
    return {};
  std::map<std::string, uint64_t> byCategory;
  int64_t models = 1 + otherExperts(module);
  int64_t gpusPerNode = jobSizeOf(module).gpusPerNode;
  for (const std::string &role : tier->roles) {
    std::string category = role == "ema" ? "EMA weights" : "AdamW moments";
    if (auto ema = module.lookupSymbol<schedule::ResourceOp>(kEmaResource);
        ema && role == "ema")
      category = ema.getCategory().str();
    byCategory[category] +=
        gpusPerNode * models * tierRoleBytesPerRank(module, role);
  }
  return sorted(byCategory);
}

std::vector<std::pair<std::string, uint64_t>>
megaslide::hostMemoryPerRank(ModuleOp module) {
  int64_t ranks = jobSizeOf(module).ranks();
  std::optional<HostTier> tier = hostTierOf(module);
  std::map<std::string, uint64_t> byCategory;
  // What each expert of a two-expert run holds for itself: every
  // parameter's state and the EMA (kExpertsAttr), less what is on NVMe.
  uint64_t perExpert = 0;
  for (auto param : module.getOps<graph::ParamOp>()) {
    if (isTiered(tier, tierRoleOf(param)))
      continue;
    uint64_t bytes = hostParamBytes(param, ranks);
    byCategory[roleCategory(param.getRole())] += bytes;
    perExpert += bytes;
  }
  for (auto resource : module.getOps<schedule::ResourceOp>()) {
    if (resource.getResidency() == schedule::Residency::device ||
        resource.getSymName() == kOsAllowanceResource)
      continue;
    if (resource.getSymName() == kEmaResource && isTiered(tier, "ema"))
      continue;
    uint64_t bytes = resource.getSize();
    if (isShardedResource(resource))
      bytes = (bytes + ranks - 1) / ranks;
    if (resource.getSymName() == kEmaResource)
      perExpert += bytes;

    byCategory[resource.getCategory().str()] += bytes;
  }
  if (int64_t others = otherExperts(module))
    byCategory["second expert's state"] += others * perExpert;
  if (tier)
    byCategory["NVMe tier window"] += tier->windowBytes;
  return sorted(byCategory);
}

uint64_t megaslide::nodeShare(ModuleOp module, uint64_t bytes) {
  JobSize job = jobSizeOf(module);
  return job.gpusPerNode * ((bytes + job.ranks() - 1) / job.ranks());
}

int64_t megaslide::nodesToFitHost(ModuleOp module, uint64_t hostBudget) {
  uint64_t sharded = 0, own = 0, allowance = 0, perExpert = 0;
  for (auto param : module.getOps<graph::ParamOp>())
    perExpert += hostParamBytes(param);
  for (auto resource : module.getOps<schedule::ResourceOp>()) {
    if (resource.getResidency() == schedule::Residency::device)
      continue;
    if (resource.getSymName() == kOsAllowanceResource)
      allowance += resource.getSize();
    else if (resource.getSymName() == kEmaResource)
      perExpert += resource.getSize();
    else if (isShardedResource(resource))
      sharded += resource.getSize();
    else
      own += resource.getSize();
  }
  sharded += (1 + otherExperts(module)) * perExpert;
  uint64_t fixed = jobSizeOf(module).gpusPerNode * own + allowance;
  if (hostBudget <= fixed)
    return 0;
  uint64_t room = hostBudget - fixed;
  return std::max<int64_t>(1, (sharded + room - 1) / room);
}

std::vector<std::pair<std::string, uint64_t>>
megaslide::hostMemoryByCategory(ModuleOp module) {
  int64_t gpusPerNode = jobSizeOf(module).gpusPerNode;
  std::map<std::string, uint64_t> byCategory;
  for (const auto &[name, bytes] : hostMemoryPerRank(module))
    byCategory[name] += gpusPerNode * bytes;
  if (auto os = module.lookupSymbol<schedule::ResourceOp>(kOsAllowanceResource))
    byCategory[os.getCategory().str()] += os.getSize();
  return sorted(byCategory);
}

/// The figures of a job of several ranks (PlanReport::Job); the one-GPU
/// comparison is planModel's.
static void accountJob(ModuleOp module, const exec::ExecPlan &program,
                       const HardwareModel &hw, PlanReport &r) {
  PlanReport::Job &job = r.job;
  JobSize size = jobSizeOf(module);
  job.gpusPerNode = size.gpusPerNode;
  job.nodes = size.nodes;
  if (job.ranks() < 2)
    return;
  job.collectiveSeconds = r.busySeconds[static_cast<int>(exec::Stream::Comm)];
  for (const exec::Instruction &inst : program.instructions)
    if (sim::costKindOf(inst.op) == sim::CostKind::Collective)
      job.collectiveBytes +=
          (inst.cost.ranks - 1) * (inst.cost.bytes / inst.cost.ranks);
  job.normAllReduceSeconds =
      sim::allReduceScalarSeconds(job.ranks(), job.nodes, hw);
  job.stepSeconds = r.recipe.optimizerStepSeconds + job.normAllReduceSeconds;
  if (job.stepSeconds > 0)
    job.samplesPerSecond =
        double(job.ranks() * program.batch * r.recipe.gradAccum) /
        job.stepSeconds;
  for (const auto &[name, bytes] : hostMemoryPerRank(module))
    job.hostPerRankBytes += bytes;
  job.hostPerNodeBytes = r.hostTotal;
  job.nodesToFitHost = nodesToFitHost(module, r.hostBudget);
  if (r.hostTotal > r.hostBudget) {
    if (job.nodesToFitHost > job.nodes)
      job.advice.push_back(llvm::formatv(
          "more nodes: --nodes {0} ({1} GPUs each) holds the sharded host "
          "state in host-mem {2} per node",
          job.nodesToFitHost, job.gpusPerNode, formatBytes(r.hostBudget)));
    else if (!job.nodesToFitHost)
      job.advice.push_back(
          "more nodes cannot help: what every rank holds for itself (staging, "
          "offloaded checkpoints, the batch) and the OS allowance alone "
          "exceed host-mem; fewer --gpus-per-node, a smaller --os-allowance "
          "or --activation-policy recompute");
    if (auto os =
            module.lookupSymbol<schedule::ResourceOp>(kOsAllowanceResource))
      job.advice.push_back(llvm::formatv(
          "--os-allowance {0} is reserved per node; lower it only if the "
          "node's OS and runtime need less",
          formatBytes(os.getSize())));
  }
  if (static_cast<uint64_t>(r.devicePeak) > r.arenaBudget)
    job.advice.push_back("every rank holds one GPU's step: more ranks do not "
                         "shrink the device peak (see the device advice)");
}

llvm::Expected<PlanReport> megaslide::buildPlanReport(
    ModuleOp module, const exec::ExecPlan &program,
    llvm::ArrayRef<Operation *> origins, const HardwareModel &hw,
    uint64_t gpuBudget, uint64_t gpuReserve, uint64_t arenaBudget,
    uint64_t hostBudget, std::vector<std::string> violations) {
  PlanReport r;
  r.hardware = hw;
  r.gpuBudget = gpuBudget;
  r.gpuReserve = gpuReserve;
  r.arenaBudget = arenaBudget;
  r.hostBudget = hostBudget;
  r.violations = std::move(violations);
  if (auto policy =
          module->getAttrOfType<StringAttr>("msched.host_state_policy"))
    r.hostStatePolicy = policy.str();
  if (auto policies =
          module->getAttrOfType<ArrayAttr>("msched.activation_policy"))
    for (Attribute p : policies)
      r.activationPolicy.push_back(cast<StringAttr>(p).str());

  auto step = module.lookupSymbol<func::FuncOp>("train_step");
  int64_t numLayers = 0;
  for (auto param : module.getOps<graph::ParamOp>())
    if (IntegerAttr l = param.getLayerAttr())
      numLayers = std::max<int64_t>(numLayers, l.getInt() + 1);
  r.layers.resize(numLayers);
  for (int64_t i = 0; i < numLayers; ++i) {
    r.layers[i].index = i;
    if (i < static_cast<int64_t>(r.activationPolicy.size()))
      r.layers[i].activationPolicy = r.activationPolicy[i];
  }
  accountHost(module, r);
  if (!step)
    return r;

  // Device: buffers, the peak and who is live there.
  DeviceBuffers buffers = collectDeviceBuffers(step);
  if (auto arena = module.lookupSymbol<schedule::ResourceOp>("device_arena"))
    r.devicePeak = arena.getSize();
  DevicePeak peak = findDevicePeak(buffers);
  const std::vector<int64_t> &live = peak.live;
  r.peakStep = peak.step;
  r.deviceByCategory = sorted(peak.byCategory);
  if (r.devicePeak > peak.bytes)
    r.deviceByCategory.push_back(
        {"alignment and fragmentation", r.devicePeak - peak.bytes});
  for (const DeviceBuffer *b : llvm::ArrayRef(peak.buffers).take_front(10))
    r.topConsumers.push_back({b->slice.size, b->describe()});

  std::vector<Operation *> opAt(buffers.numSteps, nullptr);
  for (auto [op, index] : buffers.index)
    opAt[index] = op;
  for (Operation *op : opAt)
    if (std::optional<int64_t> l = op ? graph::getLayer(op) : std::nullopt;
        l && *l < numLayers)
      r.layers[*l].devicePeak =
          std::max<uint64_t>(r.layers[*l].devicePeak, live[buffers.index[op]]);

  // The step time: the sim backend's replay of the exported program.
  // A rank of a job shares its node's host with the node's other ranks.
  HardwareModel rank = sim::rankShare(program, hw);
  llvm::Expected<sim::StepTasks> tasks = sim::buildTasks(program, rank);
  if (!tasks)
    return tasks.takeError();
  sim::Timeline timeline = sim::perInstruction(
      sim::replay(tasks->tasks, rank.hostMemoryBandwidth), *tasks);
  r.predictedSeconds = timeline.makespan;
  r.lowerBoundSeconds = timeline.lowerBound();
  r.issueWaits =
      sim::issueWaits(*tasks, rank.hostMemoryBandwidth, timeline.makespan);
  r.gradientRingSlots = tasks->ringSlots;
  r.gradientRingSlotBytes = tasks->ringSlotBytes;
  r.gradientCopies = llvm::count_if(program.instructions, [](const auto &i) {
    return i.op == exec::OpCode::HostAdamW;
  });
  for (int s = 0; s < exec::kNumStreams; ++s)
    r.busySeconds[s] = timeline.busy[s];
  if (std::optional<HostTier> tier = hostTierOf(module)) {
    r.tier.roles = tier->roles;
    r.tier.drives = tier->drives;
    r.tier.windowBytes = tier->windowBytes;
    r.tier.onNvme = nvmeBytesByCategory(module);
    r.tier.bytesPerStep = tasks->tierBytes;
    r.tier.ioSeconds = timeline.ioBusy;
    r.tier.stepGrowthSeconds =
        timeline.makespan -
        sim::withoutTierIo(*tasks, rank.hostMemoryBandwidth);
  }

  // Per-instruction figures; events (record, wait) do no work.
  DenseMap<Operation *, int64_t> instructionOf;
  std::vector<int64_t> work;
  Operation *loss = nullptr;
  std::map<std::string, uint64_t> h2dKinds, d2hKinds;
  bool lowPrecision = false; // a GEMM of the step runs in bf16/f16
  for (auto [i, inst] : llvm::enumerate(program.instructions)) {
    Operation *op = origins[i];
    if (isa<schedule::RecordOp, schedule::WaitOp>(op))
      continue;
    instructionOf[op] = i;
    work.push_back(i);
    const exec::CostInputs &cost = inst.cost;
    uint64_t flops = cost.matmulFlops + cost.attentionFlops + cost.otherFlops;
    if (inst.stream == exec::Stream::Compute) {
      if (cost.matmulFlops && !inst.results.empty() &&
          program.values[inst.results[0]].type.dtype != exec::DType::F32)
        lowPrecision = true;
      r.deviceFlops += flops;
      if (op->hasAttr(schedule::kRecomputeAttrName))
        r.recomputeFlops += flops;
      sim::KernelFamily family = sim::kernelFamilyOf(inst.op);
      PlanReport::Family &f = r.byFamily[static_cast<int>(family)];
      f.seconds += timeline.end[i] - timeline.start[i];
      if (family == sim::KernelFamily::Elementwise)
        r.elementwiseByOp[exec::opName(inst.op)] +=
            timeline.end[i] - timeline.start[i];
      f.instructions += 1;
      f.flops += flops;
      f.bytes += cost.bytes;
    }
    if (isa<graph::FlowMatchingLossOp>(op))
      loss = op;
    if (isa<schedule::FetchOp>(op)) {
      r.h2dBytes += cost.bytes;
      h2dKinds["weights"] += cost.bytes;
    } else if (auto in = dyn_cast<schedule::HostToDeviceOp>(op)) {
      r.h2dBytes += cost.bytes;
      h2dKinds[isa<BlockArgument>(in.getInput()) ? "data batch"
                                                 : "checkpoints"] += cost.bytes;
    } else if (auto out = dyn_cast<schedule::DeviceToHostOp>(op)) {
      r.d2hBytes += cost.bytes;
      bool grad = llvm::any_of(out->getUsers(), [](Operation *u) {
        return isa<schedule::HostAdamWOp>(u);
      });
      bool checkpoint = llvm::any_of(out->getUsers(), [](Operation *u) {
        return isa<schedule::HostToDeviceOp>(u);
      });
      d2hKinds[grad         ? "gradients"
               : checkpoint ? "checkpoints"
                            : "loss"] += cost.bytes;
    }
  }
  r.peakFlops = lowPrecision ? hw.bf16DenseFlops : hw.f32DenseFlops;

  // Weight shard per block: bytes fetched in its forward pass.
  for (int64_t i : work)
    if (auto fetch = dyn_cast<schedule::FetchOp>(origins[i]))
      if (std::optional<int64_t> l = graph::getLayer(fetch);
          l && *l < numLayers && loss && fetch->isBeforeInBlock(loss))
        r.layers[*l].shardBytes += tensorBytes(fetch.getType());
  for (const DeviceBuffer &b : buffers.buffers)
    if (b.category == "checkpoints" && b.value &&
        !isa<schedule::HostToDeviceOp>(b.owner))
      if (auto l = b.owner->getAttrOfType<IntegerAttr>(
              schedule::kCheckpointAttrName);
          l && l.getInt() < numLayers)
        r.layers[l.getInt()].checkpointBytes += b.slice.size;
  r.h2dByKind = sorted(h2dKinds);
  r.d2hByKind = sorted(d2hKinds);
  if (llvm::Error err = planRecipe(module, program, rank, r))
    return std::move(err);
  accountJob(module, program, hw, r);

  // Plots: live bytes over predicted time, and per-block busy intervals.
  size_t stride = std::max<size_t>(1, opAt.size() / 1500);
  for (size_t i = 0; i < opAt.size(); i += stride) {
    int64_t peak = 0;
    double at = 0;
    for (size_t j = i; j < std::min(opAt.size(), i + stride); ++j) {
      peak = std::max(peak, live[j]);
      if (auto t = instructionOf.find(opAt[j]); t != instructionOf.end())
        at = timeline.start[t->second];
    }
    r.memoryTimeline.push_back({at, static_cast<uint64_t>(peak)});
  }
  // The last interval of each stream, by index (no search back through
  // the other streams' intervals).
  std::array<std::optional<size_t>, exec::kNumStreams> lastOfStream;
  for (int64_t i : work) {
    const exec::Instruction &inst = program.instructions[i];
    int stream = static_cast<int>(inst.stream);
    std::string label =
        inst.layer ? "block " + std::to_string(*inst.layer) : "other";
    // Merge with the last interval of the same stream and label.
    if (std::optional<size_t> last = lastOfStream[stream]) {
      PlanReport::Interval &iv = r.streamTimeline[*last];
      if (iv.label == label && timeline.start[i] - iv.end <
                                   1e-3 * std::max(1.0, timeline.makespan)) {
        iv.end = std::max(iv.end, timeline.end[i]);
        continue;
      }
    }
    lastOfStream[stream] = r.streamTimeline.size();
    r.streamTimeline.push_back(
        {stream, timeline.start[i], timeline.end[i], label});
  }
  return r;
}
