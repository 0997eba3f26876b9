//===- SessionHostMemory.cpp - What a run holds in host memory ------------===//
//
// docs/Runtime.md, "Host memory": upper bounds from the plan's own sizes,
// checked before the backend or the state touches a byte.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/train/SessionParts.h"

#include "megaslide/runtime/plan/HostPool.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "llvm/Support/FormatVariadic.h"

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/cuda/CudaPlan.h"

using namespace megaslide;
using namespace megaslide::train;

uint64_t HostMemoryNeed::total() const {
  uint64_t sum = 0;
  for (const auto &part : parts)
    sum += part.second;
  return sum;
}

/// What a computing backend holds in host memory for `plan`.
static HostMemoryNeed planNeed(const exec::ExecPlan &plan,
                               const SessionOptions &options,
                               const DataSource &data, bool deferred) {
  HostMemoryNeed need;
  int ranks = options.collectives ? options.collectives->size() : 1;
  need.parts.push_back({ranks > 1 ? "host state (this rank's shard of the "
                                    "fp32 masters and AdamW moments)"
                                  : "host state (fp32 masters, AdamW moments)",
                        host::stateBytes(plan, ranks)});
  if (!plan.tierRoles.empty())
    need.parts.push_back({"NVMe tier window (the tier's state streams "
                          "through it)",
                          static_cast<uint64_t>(plan.tierWindowBytes)});
  // A job's gradient shards take a shard's bytes (exec::hostValueBytes).
  uint64_t hostValues = 0;
  std::vector<int64_t> valueBytes = exec::hostValueBytes(plan);
  for (auto [id, v] : llvm::enumerate(plan.values))
    if (v.home == exec::Home::Input)
      hostValues += v.type.bytes();
    else
      hostValues += valueBytes[id];
  need.parts.push_back(
      {"host buffers of the plan (step inputs, gradients, offloaded "
       "activations)",
       hostValues});
  if (options.backend == "cpu") {
    need.parts.push_back(
        {"device arena (the cpu backend holds it in host memory)",
         static_cast<uint64_t>(plan.arenaBytes)});
    // Each kernel runs on fp32 copies of its floating-point operands.
    uint64_t widest = 0;
    for (const exec::Instruction &inst : plan.instructions) {
      uint64_t bytes = 0;
      for (const auto *ids : {&inst.operands, &inst.results})
        for (int64_t id : *ids)
          bytes += plan.values[id].type.numElements() * sizeof(float);
      widest = std::max(widest, bytes);
    }
    need.parts.push_back({"fp32 operands of the largest kernel", widest});
  } else {
    need.parts.push_back(
        {"pinned weight staging",
         static_cast<uint64_t>(cuda::weightStagingBytes(plan))});
  }
  need.parts.push_back(
      {"data (samples in memory, batches read ahead)", data.bytesHeld()});
  host::HostOptimizer::Footprint optimizer = host::HostOptimizer::footprint(
      plan,
      optimizerOptions(options.recipe, plan, deferred, options.collectives));
  need.parts.push_back(
      {"gradients kept for the deferred update", optimizer.retainedBytes});
  need.parts.push_back({"gradient accumulation (fp32)", optimizer.accumBytes});
  need.parts.push_back({"EMA of the weights", optimizer.emaBytes});
  return need;
}

HostMemoryNeed
train::hostMemoryNeed(llvm::ArrayRef<std::unique_ptr<exec::ExecPlan>> plans,
                      const SessionOptions &options, const DataSource &data,
                      bool deferred) {
  HostMemoryNeed need;
  for (const std::unique_ptr<exec::ExecPlan> &plan : plans) {
    HostMemoryNeed one = planNeed(*plan, options, data, deferred);
    if (need.parts.empty())
      need = std::move(one);
    else
      for (size_t i = 0; i < need.parts.size(); ++i)
        need.parts[i].second =
            std::max(need.parts[i].second, one.parts[i].second);
  }
  if (options.recipe.twoExperts()) {
    // Wan 2.2's other expert: a state and an EMA of its own; the step's
    // buffers are the one backend's, shared.
    const exec::ExecPlan &plan = *plans.front();
    int ranks = options.collectives ? options.collectives->size() : 1;
    need.parts.push_back({"the second expert's host state (fp32 masters, "
                          "AdamW moments)",
                          host::stateBytes(plan, ranks)});
    if (!plan.tierRoles.empty())
      need.parts.push_back({"the second expert's NVMe tier window",
                            static_cast<uint64_t>(plan.tierWindowBytes)});
    need.parts.push_back(
        {"the second expert's EMA",
         host::HostOptimizer::footprint(
             plan, optimizerOptions(options.recipe, plan, deferred,
                                    options.collectives))
             .emaBytes});
  }
  return need;
}

llvm::Error train::checkHostMemory(const HostMemoryNeed &need,
                                   const exec::ExecPlan &plan,
                                   llvm::StringRef backend,
                                   dist::Collectives *job) {
  // The ranks of a job on this node each hold their shard of the state
  // (docs/Distributed.md, "Memory"): the node must hold all of theirs.
  uint64_t total = need.total(), ranksHere = 1;
  if (job && job->size() > 1) {
    llvm::Expected<std::vector<std::string>> needs =
        job->allGather(std::to_string(need.total()));
    if (!needs)
      return needs.takeError();
    llvm::Expected<const std::vector<std::string> &> hosts = job->hosts();
    if (!hosts)
      return hosts.takeError();
    total = ranksHere = 0;
    for (size_t r = 0; r < needs->size(); ++r) {
      uint64_t n = 0;
      if ((*hosts)[r] == job->host() &&
          !llvm::StringRef((*needs)[r]).getAsInteger(10, n)) {
        total += n;
        ++ranksHere;
      }
    }
  }
  host::HostMemoryReadings readings = host::readHostMemory();
  llvm::Expected<uint64_t> usable = host::usableHostMemoryBytes(readings);
  if (!usable)
    return usable.takeError();
  uint64_t have = *usable;
  if (total <= have)
    return llvm::Error::success();
  // Sizes in the unit of their magnitude (1MB is not "0.00 GiB"),
  // right-aligned.
  size_t width = 0;
  for (const auto &part : need.parts)
    width = std::max(width, formatBytes(part.second).size());
  std::string parts;
  for (const auto &[what, bytes] : need.parts)
    if (bytes)
      parts += "\n  " + std::string(width - formatBytes(bytes).size(), ' ') +
               formatBytes(bytes) + "  " + what;
  std::string perRank =
      ranksHere > 1 ? llvm::formatv(" ({0} ranks on this node, this one {1}: "
                                    "the state is sharded, the buffers of "
                                    "the step are every rank's)",
                                    ranksHere, formatBytes(need.total()))
                          .str()
                    : std::string();
  return llvm::createStringError(
      "'" + plan.model + "' on the " + backend.str() + " backend needs " +
      formatBytes(total) + " of host memory" + perRank +
      ", but this machine has " + formatBytes(have) +
      (readings.override
           ? std::string(" (as MEGASLIDE_HOST_MEMORY says):")
           : std::string(" (MemTotal or its memory blocks, capped by "
                         "the cgroup's limit):")) +
      parts +
      "\nuse --backend sim to predict it, a smaller model or video, or "
      "--activation-policy recompute; where memory grows as it is used "
      "(some VMs), set MEGASLIDE_HOST_MEMORY to what the machine has");
}
