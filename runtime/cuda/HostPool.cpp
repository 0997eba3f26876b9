//===- HostPool.cpp - Layout of the cuda backend's pinned pools -----------===//
//
// Inputs are written before the step starts and only read: each has bytes
// of its own. Host values (d2h results) are laid out by
// exec::layoutHostPool, which the sim replay prices too.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaPlan.h"

#include "megaslide/runtime/plan/HostPool.h"
#include "megaslide/runtime/support/Packing.h"

#include <algorithm>

namespace megaslide::cuda {

using exec::Home;

void layoutHostPools(const exec::ExecPlan &plan, const exec::Liveness &live,
                     const CudaOptions &options, PreparedPlan &p) {
  exec::HostPoolLayout host =
      exec::layoutHostPool(plan, live, options.hostPoolNoReuseBytes);
  p.hostOffset = std::move(host.offset);
  p.hostPoolBytes = host.bytes;
  p.hostPoolShared = host.shared;
  p.gradientRingSlots = host.ringSlots;
  p.gradientRingSlotBytes = host.ringSlotBytes;
  for (size_t id = 0; id < plan.values.size(); ++id) {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Input) {
      p.hostOffset[id] = p.inputPoolBytes;
      p.inputPoolBytes +=
          alignTo(std::max<int64_t>(v.type.bytes(), 1), exec::kHostPoolAlign);
    }
  }
}

} // namespace megaslide::cuda
