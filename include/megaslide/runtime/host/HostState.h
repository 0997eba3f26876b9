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

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::host {

class NvmeTier;
struct NvmeTierOptions;

/// One persistent tensor on the host: fp32 in `data`, or as one of the forms
/// below.
struct HostTensor {
  const exec::Param *param = nullptr; ///< in the plan the state was made for
  std::vector<float> data;
  /// The values of a tensor kept in bf16 (param's dtype BF16: an EMA with
  /// --ema-dtype bf16, the moments of bf16-moments); `data` is then empty.
  std::vector<uint16_t> bf16;
  /// An AdamW moment kept as ExecPlan::hostState says (docs/Training.md,
  /// "Leaner optimizer states"); `data` is then empty.
  /// int8-moments: block-wise 8-bit codes (cpu::adamw8bitStep; exp_avg with
  /// the signed map, exp_avg_sq the unsigned) and one fp32 absmax per
  /// cpu::kQuantBlock elements.
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  /// factored-moments, exp_avg_sq of a matrix: fp32 row and column
  /// statistics (cpu::factoredStatsStep). Its exp_avg is then in `bf16`.
  std::vector<float> rowStat, colStat;
  /// Whether the values are kept in one of the forms above.
  bool lean() const { return !codes.empty() || !rowStat.empty(); }
  /// Whether the tensor is sharded over a job's ranks (the masters, AdamW
  /// moments and EMA of a job of several; docs/Distributed.md, "Memory"):
  /// `data` (or `bf16`) then holds this rank's elements [shardBegin,
  /// shardEnd), which may be none. The same on every rank of a job.
  bool sharded = false;
  int64_t shardBegin = 0, shardEnd = 0;
  /// The elements held, [heldBegin(), heldEnd()): all unless sharded.
  int64_t heldBegin() const { return sharded ? shardBegin : 0; }
  int64_t heldEnd() const {
    return sharded ? shardEnd : param->type.numElements();
  }
  int64_t held() const { return heldEnd() - heldBegin(); }
  /// Keeps this tensor's elements of `whole`, the tensor's values.
  void keep(llvm::ArrayRef<float> whole);
  /// Held in the NVMe tier (attachTier) as its tensor `tierId`: `data`
  /// and `bf16` are then empty, and the held elements are read and written
  /// through the tier.
  NvmeTier *tier = nullptr;
  int64_t tierId = -1;
};

/// The held elements of `t` as fp32, from RAM or the NVMe tier.
llvm::Expected<std::vector<float>> heldValues(const HostTensor &t);

struct HostState {
  /// Tensors in the plan's parameter order, then those the trainer adds
  /// (addTensor); `index` maps names to them.
  std::vector<HostTensor> tensors;
  llvm::StringMap<size_t> index;
  /// The parameters of added tensors (stable addresses).
  std::deque<exec::Param> ownParams;
  /// The NVMe tier of the tensors of the plan's tier roles
  /// (ExecPlan::tierRoles), if any; they point at it.
  std::shared_ptr<NvmeTier> tier;
  /// How the moments are kept: the plan's ExecPlan::hostState (empty: as
  /// their params' dtype says, fp32 on the host).
  std::string hostState;
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
  /// Bytes of all tensors in RAM.
  uint64_t bytes() const;
  /// Adds a zero tensor described by `param` (e.g. an EMA, role "ema"),
  /// sharded like `like` (which must not be added to); without
  /// `allocate`, its values are left for the NVMe tier (attachTier).
  /// Invalidates pointers to tensors.
  HostTensor &addTensor(exec::Param param, const HostTensor *like = nullptr,
                        bool allocate = true);
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

/// The peak resident set of this program so far (VmHWM; getrusage's
/// maxrss where /proc is missing), in bytes: what the metrics report as
/// host memory.
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
/// moments (as ExecPlan::hostState keeps them: momentBytes) and frozen
/// buffers, but those of the NVMe tier's roles.
/// With `ranks` > 1, a rank's: the masters and moments are sharded, rank
/// 0's shard the largest.
uint64_t stateBytes(const exec::ExecPlan &plan, int ranks = 1);
/// Whether `plan` keeps tensors of `role` in the NVMe tier.
bool tieredRole(const exec::ExecPlan &plan, llvm::StringRef role);
/// Whether a tensor of `role` is sharded over a job of `ranks` ranks: the
/// trainable state (masters, moments, EMA); frozen buffers are whole on
/// every rank.
bool shardedRole(llvm::StringRef role, int ranks);
/// Host bytes of AdamW moment `moment` of `plan` as the plan's hostState
/// keeps it: the runtime's side of the planner's schedule::momentBytes
/// (the same formulas).
uint64_t momentBytes(const exec::ExecPlan &plan, const exec::Param &moment);
/// The whole of sharded tensor `t` in `dtype` (F32, BF16 or F16) at `dst`,
/// which has room for all of it: this rank's shard cast, then all-gathered
/// from the job's ranks in that dtype (what a fetch of it reads). Every
/// rank calls it for the same tensors in the same order.
llvm::Error gatherWhole(const HostTensor &t, exec::DType dtype, void *dst,
                        dist::Collectives &job);

/// The values of AdamW moment `t` in fp32, however it is kept: int8 codes
/// dequantized (map value times block absmax), a factored exp_avg_sq as
/// R_i C_j / sum(R), a bf16 exp_avg widened.
std::vector<float> momentValues(const HostTensor &t);

/// Allocates the state of `plan` and initialises it deterministically from
/// `seed` (docs/Runtime.md, "Initialisation"): weights of linear and patch
/// layers ~ N(0, 0.02), biases and moments zero, norm weights one,
/// embedding tables ~ N(0, 0.02), the output projection zero as in DiT.
/// With `ranks` > 1, rank `rank`'s: its shard (dist::shardRange) of every
/// master and AdamW moment, the frozen buffers whole; a shard's values are
/// those of the whole tensor's initialisation. Tensors of the NVMe tier's
/// roles (zeros) are not allocated: attachTier holds them.
HostState initHostState(const exec::ExecPlan &plan, uint64_t seed,
                        int rank = 0, int ranks = 1);

/// Moves the tensors of `plan`'s tier roles (ExecPlan::tierRoles) into a
/// new NVMe tier on `options`' drives: their values are written there (a
/// tensor without values, as initHostState leaves them, is zeros) and
/// their RAM freed. Nothing to do for a plan without tier roles.
llvm::Error attachTier(HostState &state, const exec::ExecPlan &plan,
                       const NvmeTierOptions &options);

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_HOSTSTATE_H
