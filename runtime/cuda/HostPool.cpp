//===- HostPool.cpp - Layout of the cuda backend's pinned pools -----------===//
//
// Inputs are written before the step starts and only read; host values are
// written by d2h copies.
//
//===----------------------------------------------------------------------===//

#include "cuda/CudaPlan.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>

namespace megaslide::cuda {

using exec::Home;

namespace {

constexpr int64_t kPoolAlign = 256;

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

} // namespace

void layoutHostPools(const exec::ExecPlan &plan, const exec::Liveness &live,
                     const CudaOptions &options, PreparedPlan &p) {
  p.hostOffset.assign(plan.values.size(), -1);
  std::vector<int64_t> hostValues;
  for (size_t id = 0; id < plan.values.size(); ++id) {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Input) {
      p.hostOffset[id] = p.inputPoolBytes;
      p.inputPoolBytes +=
          alignUp(std::max<int64_t>(v.type.bytes(), 1), kPoolAlign);
    } else if (v.home == Home::Host) {
      hostValues.push_back(id);
    }
  }
  int64_t hostTotal = 0;
  for (int64_t id : hostValues)
    hostTotal +=
        alignUp(std::max<int64_t>(plan.values[id].type.bytes(), 1), kPoolAlign);
  if (hostTotal <= options.hostPoolNoReuseBytes) {
    for (int64_t id : hostValues) {
      p.hostOffset[id] = p.hostPoolBytes;
      p.hostPoolBytes += alignUp(
          std::max<int64_t>(plan.values[id].type.bytes(), 1), kPoolAlign);
    }
  } else {
    // First fit over program-order lifetimes; outputs live to the end.
    p.hostPoolShared = true;
    std::vector<bool> isOutput(plan.values.size());
    for (int64_t id : plan.outputs)
      isOutput[id] = true;
    auto lastOf = [&](int64_t id) {
      return isOutput[id] ? static_cast<int64_t>(plan.instructions.size())
                          : std::max(live.def[id], live.lastUse[id]);
    };
    llvm::sort(hostValues,
               [&](int64_t a, int64_t b) { return live.def[a] < live.def[b]; });
    struct Placed {
      int64_t offset, size, last;
    };
    std::vector<Placed> active;
    for (int64_t id : hostValues) {
      int64_t size = alignUp(std::max<int64_t>(plan.values[id].type.bytes(), 1),
                             kPoolAlign);
      llvm::erase_if(active,
                     [&](const Placed &a) { return a.last < live.def[id]; });
      llvm::sort(active, [](const Placed &a, const Placed &b) {
        return a.offset < b.offset;
      });
      int64_t at = 0;
      for (const Placed &a : active) {
        if (a.offset >= at + size)
          break;
        at = std::max(at, a.offset + a.size);
      }
      p.hostOffset[id] = at;
      p.hostPoolBytes = std::max(p.hostPoolBytes, at + size);
      active.push_back({at, size, lastOf(id)});
    }
  }
}

} // namespace megaslide::cuda
