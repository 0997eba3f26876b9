//===- SchedulePolicies.h - What each planning policy means -----*- C++ -*-===//
//
// The per-case facts of the policy enums (SchedulePolicies.td): one row per
// case, beside its name, and a table that misses a case does not compile.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H
#define MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H

#include "dialects/Schedule/ScheduleOps.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"

#include <iterator>

namespace megaslide::schedule {

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
inline llvm::SmallVector<UpdatePolicy> updatePolicies() {
  return allCases<UpdatePolicy, getMaxEnumValForUpdatePolicy()>();
}
inline llvm::SmallVector<EmaPolicy> emaPolicies() {
  return allCases<EmaPolicy, getMaxEnumValForEmaPolicy()>();
}

/// What a host-state policy costs and keeps, per trainable parameter.
struct HostStatePolicyFacts {
  /// Whole bytes per parameter; the exact bytes of a parameter are
  /// trainableStateBytes().
  uint64_t bytesPerParam;
  llvm::StringRef description; ///< model reports, --help
};
inline constexpr HostStatePolicyFacts kHostStatePolicyFacts[] = {
    /*master_moments*/ {12, "fp32 master + AdamW m + v"},
    /*persistent_bf16*/ {14, "+ persistent bf16 working copy"},
    /*bf16_moments*/ {8, "fp32 master + bf16 AdamW m + v"},
    /*int8_moments*/
    {6, "fp32 master + 8-bit m + v + absmax/256"},
    /*factored_moments*/
    {6, "fp32 master + bf16 m + factored v"},
};
static_assert(std::size(kHostStatePolicyFacts) ==
                  getMaxEnumValForHostStatePolicy() + 1,
              "a host-state policy without its facts");

inline constexpr llvm::StringLiteral kActivationPolicyDescriptions[] = {
    /*keep*/ "every activation stays on device until backward",
    /*recompute*/ "keep each block's input on device, recompute the rest",
    /*offload*/ "recompute, with the block input in host memory",
    /*auto*/ "keep if it fits gpu-mem, else recompute and offload as needed",
};
static_assert(std::size(kActivationPolicyDescriptions) ==
                  getMaxEnumValForActivationPolicy() + 1,
              "an activation policy without its description");

inline constexpr llvm::StringLiteral kUpdatePolicyDescriptions[] = {
    /*auto*/ "deferred if host-mem holds the retained gradients, else "
             "streaming",
    /*deferred*/
    "keep the gradients until backward ends (clipping, "
    "skipping, accumulation); update each parameter before "
    "the next step's first fetch of it",
    /*streaming*/ "update each parameter as soon as its gradient lands",
};
static_assert(std::size(kUpdatePolicyDescriptions) ==
                  getMaxEnumValForUpdatePolicy() + 1,
              "an update policy without its description");

/// What an EMA policy costs per trainable parameter on the host.
struct EmaPolicyFacts {
  uint64_t bytesPerParam;
  llvm::StringRef description;
};
inline constexpr EmaPolicyFacts kEmaPolicyFacts[] = {
    /*none*/ {0, "no EMA of the weights"},
    /*f32*/ {4, "fp32 EMA of the weights"},
    /*bf16*/ {2, "bf16 EMA of the weights"},
};
static_assert(std::size(kEmaPolicyFacts) == getMaxEnumValForEmaPolicy() + 1,
              "an EMA policy without its facts");

/// Host bytes of the fp32 gradient accumulator per trainable parameter
/// (grad-accum > 1; it is the deferred update's retained gradient then).
inline constexpr uint64_t kGradAccumBytesPerParam = 4;

inline uint64_t bytesPerParam(EmaPolicy policy) {
  return kEmaPolicyFacts[static_cast<unsigned>(policy)].bytesPerParam;
}
inline llvm::StringRef describe(EmaPolicy policy) {
  return kEmaPolicyFacts[static_cast<unsigned>(policy)].description;
}
inline llvm::StringRef describe(UpdatePolicy policy) {
  return kUpdatePolicyDescriptions[static_cast<unsigned>(policy)];
}

/// Host bytes of persistent state per trainable parameter (whole bytes:
/// int8-moments' block scales and factored-moments' statistics come on
/// top, trainableStateBytes()).
inline uint64_t bytesPerParam(HostStatePolicy policy) {
  return kHostStatePolicyFacts[static_cast<unsigned>(policy)].bytesPerParam;
}

/// Elements per block of int8-moments' quantization (bitsandbytes'
/// optimizer blocksize; the runtime's cpu::kQuantBlock).
inline constexpr uint64_t kInt8MomentBlock = 256;
/// Parameters with fewer elements keep fp32 moments under int8-moments
/// (bitsandbytes' min_8bit_size: biases and norms, whose few moments cost
/// nothing and are the most sensitive; the runtime's cpu::kQuantMinSize).
inline constexpr uint64_t kInt8MinSize = 4096;

/// Whether the moments of a parameter of `shape` are factored under
/// factored-moments: a matrix (rank >= 2) viewed as [shape[0], rest].
inline bool factoredShape(llvm::ArrayRef<int64_t> shape) {
  return shape.size() >= 2;
}

/// Whether `policy` is for a job of one rank only: int8 and factored
/// moments' block scales and row/column statistics are not sharded.
inline bool oneRankOnly(HostStatePolicy policy) {
  return policy == HostStatePolicy::int8_moments ||
         policy == HostStatePolicy::factored_moments;
}

/// Host bytes of one AdamW moment (`second`: exp_avg_sq) of a trainable
/// parameter of `shape` under `policy`: the one home of their sizes, which
/// the planner's host accounting and the runtime's state follow.
inline uint64_t momentBytes(HostStatePolicy policy,
                            llvm::ArrayRef<int64_t> shape, bool second) {
  uint64_t n = 1;
  for (int64_t d : shape)
    n *= static_cast<uint64_t>(d);
  switch (policy) {
  case HostStatePolicy::bf16_moments:
    return 2 * n;
  case HostStatePolicy::int8_moments: // codes + an fp32 absmax per block
    if (n < kInt8MinSize)
      return 4 * n;
    return n + 4 * ((n + kInt8MomentBlock - 1) / kInt8MomentBlock);
  case HostStatePolicy::factored_moments:
    if (!factoredShape(shape))
      return 4 * n;
    if (!second)
      return 2 * n; // bf16 m
    return 4 * (static_cast<uint64_t>(shape[0]) + n / shape[0]);
  default:
    return 4 * n;
  }
}

/// Host bytes of a trainable parameter of `shape` under `policy`: its
/// fp32 master, moments and persistent bf16 copy.
inline uint64_t trainableStateBytes(HostStatePolicy policy,
                                    llvm::ArrayRef<int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape)
    n *= static_cast<uint64_t>(d);
  uint64_t copy = policy == HostStatePolicy::persistent_bf16 ? 2 * n : 0;
  return 4 * n + copy + momentBytes(policy, shape, false) +
         momentBytes(policy, shape, true);
}

inline llvm::StringRef describe(HostStatePolicy policy) {
  return kHostStatePolicyFacts[static_cast<unsigned>(policy)].description;
}

inline llvm::StringRef describe(ActivationPolicy policy) {
  return kActivationPolicyDescriptions[static_cast<unsigned>(policy)];
}

} // namespace megaslide::schedule

#endif // MEGASLIDE_SCHEDULE_SCHEDULEPOLICIES_H
