//===- HostPool.cpp - Layout of the cuda backend's pinned pools -----------===//
//
// Inputs are written before the step starts and only read; host values are
// written by d2h copies. Each input has bytes of its own; so do the host
// values while all of them fit CudaOptions::hostPoolNoReuseBytes, beyond
// which they share bytes by liveness, packed like the device arena
// (support/Packing.h).
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaPlan.h"

#include "megaslide/runtime/support/Packing.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>

namespace megaslide::cuda {

using exec::Home;

namespace {

constexpr int64_t kPoolAlign = 256;

/// Pinned bytes of a value: at least one, so every value has an address of
/// its own.
int64_t poolBytes(const exec::Value &v) {
  return alignTo(std::max<int64_t>(v.type.bytes(), 1), kPoolAlign);
}

} // namespace

void layoutHostPools(const exec::ExecPlan &plan, const exec::Liveness &live,
                     const CudaOptions &options, PreparedPlan &p) {
  p.hostOffset.assign(plan.values.size(), -1);
  std::vector<int64_t> hostValues;
  for (size_t id = 0; id < plan.values.size(); ++id) {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Input) {
      p.hostOffset[id] = p.inputPoolBytes;
      p.inputPoolBytes += poolBytes(v);
    } else if (v.home == Home::Host) {
      hostValues.push_back(id);
    }
  }
  int64_t hostTotal = 0;
  for (int64_t id : hostValues)
    hostTotal += poolBytes(plan.values[id]);
  if (hostTotal <= options.hostPoolNoReuseBytes) {
    for (int64_t id : hostValues) {
      p.hostOffset[id] = p.hostPoolBytes;
      p.hostPoolBytes += poolBytes(plan.values[id]);
    }
    return;
  }
  // Program-order lifetimes; outputs live to the end.
  p.hostPoolShared = true;
  std::vector<bool> isOutput(plan.values.size());
  for (int64_t id : plan.outputs)
    isOutput[id] = true;
  std::vector<Slice> slices;
  for (int64_t id : hostValues)
    slices.push_back({poolBytes(plan.values[id]), live.def[id],
                      isOutput[id]
                          ? static_cast<int64_t>(plan.instructions.size())
                          : std::max(live.def[id], live.lastUse[id])});
  Packing packing = packSlices(slices, kPoolAlign);
  for (auto [k, id] : llvm::enumerate(hostValues))
    p.hostOffset[id] = packing.offsets[k];
  p.hostPoolBytes = packing.arenaSize;
}

} // namespace megaslide::cuda
