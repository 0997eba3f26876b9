//===- HostState.h - The model state in host memory -------------*- C++ -*-===//
//
// Every persistent tensor of a plan (fp32 masters, AdamW moments, frozen
// buffers) plus the optimizer step, owned by the host
// (docs/MemoryAccounting.md). Backends read masters when staging weights and
// update them in the host AdamW; weights and checkpoints are saved from and
// loaded into it.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_HOSTSTATE_H
#define MEGASLIDE_RUNTIME_HOST_HOSTSTATE_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/StringMap.h"

#include <cstdint>
#include <deque>
#include <vector>

namespace megaslide::host {

/// One persistent tensor, always fp32 on the host.
struct HostTensor {
  const exec::Param *param = nullptr; ///< in the plan the state was made for
  std::vector<float> data;
  /// The values of a tensor kept in bf16 (param's dtype BF16: an EMA with
  /// --ema-dtype bf16); `data` is then empty.
  std::vector<uint16_t> bf16;
  /// A rank's shard of a tensor sharded over a job's ranks (its AdamW
  /// moments; docs/Distributed.md, "Memory"): `data` holds the elements
  /// from this one on. 0 and the whole tensor otherwise.
  int64_t shardBegin = 0;
  bool whole() const {
    return shardBegin == 0 &&
           static_cast<int64_t>(data.size()) == param->type.numElements();
  }
};

struct HostState {
  /// Tensors in the plan's parameter order, then those the trainer adds
  /// (addTensor); `index` maps names to them.
  std::vector<HostTensor> tensors;
  llvm::StringMap<size_t> index;
  /// The parameters of added tensors (stable addresses).
  std::deque<exec::Param> ownParams;
  /// Completed optimizer steps (the next step passes step + 1 to AdamW).
  int64_t step = 0;
  /// Set by a backend before it applies a step's first update and cleared
  /// when the step completes: while set (a step failed part-way, e.g. on a
  /// non-finite gradient), some tensors hold step + 1's values and others
  /// step's, so the state must not be stepped, saved or checkpointed.
  bool incomplete = false;

  HostTensor *find(llvm::StringRef name);
  const HostTensor *find(llvm::StringRef name) const;
  /// The moments of trainable parameter `name` (role moment, `of` name).
  HostTensor *expAvg(llvm::StringRef name);
  HostTensor *expAvgSq(llvm::StringRef name);
  /// Bytes of all tensors.
  uint64_t bytes() const;
  /// Adds a zero tensor described by `param` (e.g. an EMA, role "ema").
  /// Invalidates pointers to tensors.
  HostTensor &addTensor(exec::Param param);
};

/// What this machine says about its memory (docs/Runtime.md, "Host
/// memory").
struct HostMemoryReadings {
  uint64_t physicalBytes = 0; ///< online pages (MemTotal)
  /// Every block of /sys/devices/system/memory, online or not: a VM whose
  /// memory is hot-plugged as it is used starts with few blocks online.
  std::optional<uint64_t> blockBytes;
  std::optional<uint64_t> cgroupLimit; ///< none for "max" and v1's ~2^63
  std::optional<std::string> override; ///< $MEGASLIDE_HOST_MEMORY
};
HostMemoryReadings readHostMemory();

/// The peak resident set of this process so far (getrusage's maxrss), in
/// bytes: what the metrics report as host memory.
uint64_t residentBytes();

/// Bytes of memory a run may use, what its host memory is checked against
/// before anything is allocated: the override if given (bytes, or with a
/// KiB/MiB/GiB/TiB or KB/MB/GB/TB suffix); else the larger of MemTotal and
/// the memory blocks, capped by the cgroup's limit where there is one
/// (containers, batch jobs). A malformed override is an error.
llvm::Expected<uint64_t> usableHostMemoryBytes(const HostMemoryReadings &r);
/// The same for this machine.
llvm::Expected<uint64_t> usableHostMemoryBytes();

/// The bytes initHostState allocates for `plan`: its fp32 masters, AdamW
/// moments and frozen buffers.
/// With `ranks` > 1, a rank's: the moments are sharded, rank 0's shard the
/// largest.
uint64_t stateBytes(const exec::ExecPlan &plan, int ranks = 1);

/// Allocates the state of `plan` and initialises it deterministically from
/// `seed` (docs/Runtime.md, "Initialisation"): weights of linear and patch
/// layers ~ N(0, 0.02), biases and moments zero, norm weights one,
/// embedding tables ~ N(0, 0.02), the output projection zero as in DiT.
/// With `ranks` > 1, rank `rank`'s: its shard of every AdamW moment
/// (dist::shardRange), the masters and frozen buffers whole.
HostState initHostState(const exec::ExecPlan &plan, uint64_t seed,
                        int rank = 0, int ranks = 1);

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_HOSTSTATE_H
