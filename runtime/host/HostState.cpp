//===- HostState.cpp - The model state in host memory ---------------------===//

#include "host/HostState.h"

#include "train/Random.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::host;

HostTensor *HostState::find(llvm::StringRef name) {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

const HostTensor *HostState::find(llvm::StringRef name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

HostTensor *HostState::expAvg(llvm::StringRef name) {
  return find((name + ".exp_avg").str());
}

HostTensor *HostState::expAvgSq(llvm::StringRef name) {
  return find((name + ".exp_avg_sq").str());
}

/// The memory limit of this process's cgroup (v2, else v1), if any: in a
/// container or a batch job that is the memory a run really has.
static std::optional<uint64_t> cgroupMemoryLimit() {
  for (const char *path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::FILE *f = std::fopen(path, "re");
    if (!f)
      continue;
    char buf[64] = {};
    size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    uint64_t limit;
    // "max" (v2) or a huge number (v1) mean no limit.
    if (!llvm::StringRef(buf, n).trim().getAsInteger(10, limit))
      return limit;
  }
  return std::nullopt;
}

uint64_t host::physicalMemoryBytes() {
  uint64_t physical = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                      static_cast<uint64_t>(sysconf(_SC_PAGE_SIZE));
  std::optional<uint64_t> limit = cgroupMemoryLimit();
  return limit ? std::min(physical, *limit) : physical;
}

uint64_t HostState::bytes() const {
  uint64_t total = 0;
  for (const HostTensor &t : tensors)
    total += t.data.size() * sizeof(float);
  return total;
}

/// How a tensor starts out (docs/Runtime.md, "Initialisation").
static void initTensor(const exec::Param &p, uint64_t seed,
                       std::vector<float> &data) {
  llvm::StringRef name = p.name;
  if (p.role == "moment" || name.ends_with(".bias"))
    return; // zeros
  if (name.contains("norm") && name.ends_with(".weight")) {
    std::fill(data.begin(), data.end(), 1.0f);
    return;
  }
  // Per-tensor streams keyed by name: the values do not depend on the
  // order or number of other tensors.
  train::Random rng(seed ^ train::hashName(name));
  float stddev = 0.02f;
  if (name.contains("scale_shift_table") && !p.type.shape.empty())
    stddev = 1.0f / std::sqrt(static_cast<float>(p.type.shape.back()));
  for (float &x : data)
    x = stddev * rng.normal();
}

HostState host::initHostState(const exec::ExecPlan &plan, uint64_t seed) {
  HostState state;
  state.tensors.reserve(plan.params.size());
  for (const exec::Param &p : plan.params) {
    if (p.role != "master" && p.role != "moment" && p.role != "frozen")
      continue;
    HostTensor t;
    t.param = &p;
    t.data.assign(p.type.numElements(), 0.0f);
    initTensor(p, seed, t.data);
    state.index[p.name] = state.tensors.size();
    state.tensors.push_back(std::move(t));
  }
  return state;
}
