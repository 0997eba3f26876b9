//===- SchedulePolicies.h - What each planning policy means -----*- C++ -*-===//
//
// The per-case facts of the policy enums (SchedulePolicies.td): one switch
// each, so a new case does not compile (-Wswitch, -Werror) until it says
// what it costs and means.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H
#define MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H

#include "Schedule/ScheduleOps.h"

#include "llvm/ADT/SmallVector.h"

namespace megaslide::sched {

/// Every case, in order (the cases are dense from 0).
template <typename E, unsigned Max> llvm::SmallVector<E> allCases() {
  llvm::SmallVector<E> all;
  for (unsigned i = 0; i <= Max; ++i)
    all.push_back(static_cast<E>(i));
  return all;
}
inline llvm::SmallVector<ActivationPolicy> activationPolicies() {
  return allCases<ActivationPolicy, getMaxEnumValForActivationPolicy()>();
}
inline llvm::SmallVector<HostStatePolicy> hostStatePolicies() {
  return allCases<HostStatePolicy, getMaxEnumValForHostStatePolicy()>();
}

/// Host bytes of persistent state per trainable parameter.
inline uint64_t bytesPerParam(HostStatePolicy policy) {
  switch (policy) {
  case HostStatePolicy::master_moments:
    return 12;
  case HostStatePolicy::persistent_bf16:
    return 14;
  case HostStatePolicy::bf16_moments:
    return 8;
  }
  llvm_unreachable("unknown host-state policy");
}

/// What the host keeps per parameter (model reports, --help).
inline llvm::StringRef describe(HostStatePolicy policy) {
  switch (policy) {
  case HostStatePolicy::master_moments:
    return "fp32 master + AdamW m + v";
  case HostStatePolicy::persistent_bf16:
    return "+ persistent bf16 working copy";
  case HostStatePolicy::bf16_moments:
    return "fp32 master + bf16 AdamW m + v";
  }
  llvm_unreachable("unknown host-state policy");
}

inline llvm::StringRef describe(ActivationPolicy policy) {
  switch (policy) {
  case ActivationPolicy::keep:
    return "every activation stays on device until backward";
  case ActivationPolicy::recompute:
    return "keep each block's input on device, recompute the rest";
  case ActivationPolicy::offload:
    return "recompute, with the block input in host memory";
  case ActivationPolicy::automatic:
    return "keep if it fits gpu-mem, else recompute and offload as needed";
  }
  llvm_unreachable("unknown activation policy");
}

} // namespace megaslide::sched

#endif // MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H
