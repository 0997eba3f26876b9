//===- ExecPlan.h - The serialised execution plan ---------------*- C++ -*-===//
//
// What the compiler hands the runtime: the scheduled training step as a flat
// program over numbered tensors, with every device tensor at its planned
// arena offset. Written by lib/Target/ExecPlan from the pipeline's final IR,
// read here without MLIR. The file format (JSON) is docs/ExecutionPlan.md;
// its reader and writer are ExecPlanJson.h, which validates a loaded plan
// as untrusted input (Validate.h) before any backend sees it; Liveness.h
// and DeferredUpdates.h hold the rules the planner and the runtime share.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_EXECPLAN_H
#define MEGASLIDE_RUNTIME_PLAN_EXECPLAN_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "megaslide/Version.h"
#include "megaslide/runtime/plan/OpCode.h"
#include "megaslide/runtime/plan/Stream.h"

namespace megaslide::exec {

/// Bump on any change a reader of the previous version would misread.
/// Version 3 added deferred updates (kDeferredAttr): a reader of version
/// 2 would run their host_adamw as an update, at the wrong time. Version 4
/// added the exact GELU (kExactAttr on gelu and gelu_grad), which a reader
/// of version 3 would run as the tanh form. Version 5 added the weighted
/// loss (kLossWeightsInput), which a reader of version 4 would reject
/// operand by operand or train unweighted. Version 6 added the NVMe tier
/// (`host_tier`), which a reader of version 5 would ignore and so hold the
/// tier's state in RAM the plan did not count, and the host state
/// (ExecPlan::hostState: int8 or factored AdamW moments), which a reader of
/// version 5 would ignore and train with fp32 moments. A plan without them
/// is written
/// as version 2, which such readers still run as before (the exporter
/// writes the oldest version that describes a plan: oldestVersion()).
inline constexpr int64_t kPlanFormatVersion = 6;
inline constexpr int64_t kOldestPlanFormatVersion = 2;
inline constexpr int64_t kDeferredUpdateFormatVersion = 3;
inline constexpr int64_t kExactGeluFormatVersion = 4;
inline constexpr int64_t kWeightedLossFormatVersion = 5;
inline constexpr int64_t kNvmeTierFormatVersion = 6;

/// The roles of persistent tensors the NVMe tier can hold (the runtime's
/// host::NvmeTier streams them through the host optimizer's updates): the
/// AdamW moments and the EMA, each read and written once per optimizer
/// step. The masters stay in RAM: every fetch reads them.
inline constexpr const char *kTierRoles[] = {"moment", "ema"};
inline constexpr int64_t kHostStateFormatVersion = 6;
/// ExecPlan::hostState's values: how the host keeps the AdamW moments
/// when not as their params' dtype says (docs/Training.md, "Leaner
/// optimizer states"); the --host-state-policy names.
inline constexpr llvm::StringLiteral kInt8Moments = "int8-moments";
inline constexpr llvm::StringLiteral kFactoredMoments = "factored-moments";
/// Unit attribute of gelu and gelu_grad: the erf form, not tanh's.
inline constexpr llvm::StringLiteral kExactAttr = "exact";
/// The step input of a weighted loss: one fp32 weight per sample, the
/// fourth operand of flow_matching_loss and flow_matching_loss_grad; the
/// loss then also returns the unweighted loss, the plan's second output.
inline constexpr llvm::StringLiteral kLossWeightsInput = "loss_weights";

/// Unit attributes (integer 1) of a plan with deferred updates
/// (docs/ExecutionPlan.md, "Deferred updates"). On host_adamw: retain
/// the gradient (summing its squared norm and finiteness) instead of
/// updating; the update runs before the next step's fetch marked
/// `applies_update`. On fetch: the first of the step that reads the
/// parameter (or its persistent bf16 copy) a deferred host_adamw
/// updates; it waits for that update.
inline constexpr llvm::StringLiteral kDeferredAttr = "deferred";
inline constexpr llvm::StringLiteral kAppliesUpdateAttr = "applies_update";
inline constexpr llvm::StringLiteral kPlanFormatName = "megaslide-exec-plan";
/// The most tokens (batch x tokens per sample) a step may have: what the
/// planner accepts (buildTrainingStep) and validate() holds a plan's
/// `batch` x `grid` to, so every tensor's byte count stays far from
/// overflowing int64.
inline constexpr int64_t kMaxTokensPerStep = int64_t(1) << 31;
/// The most micro-batches an optimizer step takes (--grad-accum): each is
/// a full forward and backward, so 2^20 of them is already days a step.
inline constexpr int64_t kMaxGradAccum = int64_t(1) << 20;

enum class DType : uint8_t { BF16, F16, F32, I32, I64 };
const char *dtypeName(DType dtype);
std::optional<DType> parseDType(llvm::StringRef name);
int64_t dtypeBytes(DType dtype);

struct TensorType {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  int64_t numElements() const;
  int64_t bytes() const { return numElements() * dtypeBytes(dtype); }
};

/// Where a tensor of the step lives.
enum class Home : uint8_t {
  Device, ///< in the arena at `offset` (or a view of another device value)
  Input,  ///< an argument of the step, provided by the caller on the host
  Host,   ///< host memory the runtime allocates (d2h results)
};

struct Value {
  TensorType type;
  Home home = Home::Device;
  int64_t offset = -1;            ///< arena offset of a device value
  std::optional<int64_t> viewOf;  ///< id of the value whose bytes this reuses
  std::string name;               ///< argument name of an input
};

/// A persistent tensor of the model state (`megaslide.param`).
struct Param {
  std::string name;  ///< diffusers name; moments add .exp_avg/.exp_avg_sq
  std::string role;  ///< master | moment | weight | gradient | frozen
  std::string group; ///< embeddings | blocks | head
  std::optional<int64_t> layer;
  std::string of; ///< for moments: the parameter they belong to
  TensorType type;
};

/// An attribute of an instruction, from the op's attribute dictionary with
/// defaults filled in.
using Attr = std::variant<int64_t, double, std::string, std::vector<int64_t>>;

/// What the cost model needs to time an instruction on some hardware.
struct CostInputs {
  uint64_t matmulFlops = 0, attentionFlops = 0, otherFlops = 0;
  uint64_t bytes = 0;       ///< moved through HBM, PCIe or host memory
  uint64_t sourceBytes = 0; ///< fetch: bytes of the persistent source read
  /// A collective: the job's ranks and nodes its ring spans (0 otherwise).
  int64_t ranks = 0, nodes = 0;
};

struct Range {
  int64_t offset = 0;
  int64_t size = 0;
};

/// One op of the step. Program order is a valid serial execution; streams
/// and events say what may overlap on an asynchronous backend.
struct Instruction {
  /// The op (plan/Ops.def); the file names it by opName(op).
  OpCode op{};
  Stream stream = Stream::Compute;
  std::vector<int64_t> operands, results; ///< value ids
  std::map<std::string, Attr, std::less<>> attrs;
  std::optional<int64_t> layer;
  std::string param;                ///< fetch, host_adamw: the Param name
  std::optional<int64_t> event;     ///< record: event defined; wait: used
  std::vector<Range> workspace;     ///< arena scratch live during the op
  CostInputs cost;

  const Attr *attr(llvm::StringRef name) const;
  /// Whether the instruction has the attribute (a unit attribute such as
  /// kDeferredAttr).
  bool hasAttr(llvm::StringRef name) const { return attr(name) != nullptr; }
  std::optional<int64_t> intAttr(llvm::StringRef name) const;
  std::optional<double> floatAttr(llvm::StringRef name) const;
  std::optional<std::vector<int64_t>> intsAttr(llvm::StringRef name) const;
};

/// Generated device code the plan's kernels need (the 3D-DSA kernels of
/// lib/Target/Cuda), compiled by the cuda backend with NVRTC.
struct KernelModule {
  std::string name;     ///< configuration name, e.g. dsa3d_g2x4x4_..._r4
  std::string source;   ///< CUDA C++
  std::string manifest; ///< JSON: launch shapes per kernel (DsaLaunch)
};

struct ExecPlan {
  int64_t version = kPlanFormatVersion;
  /// The MegaSlide release whose runtime the plan was compiled for; a
  /// runtime of another release refuses it (docs/ExecutionPlan.md).
  std::string runtimeVersion = MEGASLIDE_VERSION;
  std::string model; ///< preset name or config path it was compiled from
  /// The model config as JSON text (diffusers keys), for weight loading.
  std::string modelConfig;
  std::vector<int64_t> grid; ///< (T, Y, X) tokens per sample
  int64_t batch = 1;

  int64_t arenaBytes = 0; ///< planned device peak (msched.pack arena_size)
  /// The budget the planner checked the arena against (msched.budget_check
  /// of @device_arena: gpu-mem less gpu-reserve), which the cuda backend's
  /// device guard holds it to; none for a plan that was not checked.
  std::optional<int64_t> arenaBudgetBytes;
  int64_t alignment = 1;
  int64_t plannedLiveBytes = 0; ///< planned peak of live (unaligned) bytes
  /// Pinned buffers, each one layer's gradients, that gradient copies
  /// cycle through when host values share bytes (HostPool.h).
  int64_t gradientBuffers = 2;
  /// The recipe facts the plan was compiled for and the runtime must
  /// follow (megaslide-defer-updates: msched.grad_accum, msched.ema):
  /// micro-batches per optimizer step, and the EMA's dtype ("none", "f32"
  /// or "bf16"), whose host bytes the plan counts.
  int64_t gradAccum = 1;
  std::string emaDtype = "none";
  /// The NVMe tier (docs/Runtime.md, "NVMe tier"): the roles of the
  /// persistent tensors the host keeps in files on NVMe instead of RAM
  /// (kTierRoles), the RAM window they stream through, which the plan
  /// counts as host memory, and the drives its I/O was priced for. No
  /// roles: everything in RAM.
  std::vector<std::string> tierRoles;
  int64_t tierWindowBytes = 0;
  int64_t tierDrives = 0;
  /// How the host keeps the AdamW moments: empty for as their params'
  /// dtype, kInt8Moments (block-wise 8-bit codes and absmax) or
  /// kFactoredMoments (bf16 m, row/column statistics of v for matrices).
  /// The moment params then stay fp32-typed: the element count and role
  /// they describe.
  std::string hostState;

  std::vector<Param> params;
  std::vector<Value> values;
  std::vector<int64_t> inputs;  ///< value ids, in argument order
  /// Value ids returned: the loss, then a weighted loss's unweighted one.
  std::vector<int64_t> outputs;
  int64_t numEvents = 0;
  std::vector<Instruction> instructions;
  std::vector<KernelModule> kernelModules;

  const Param *findParam(llvm::StringRef name) const;
  /// The master parameter whose update a fetch of `fetched` reads: the
  /// parameter itself, or the master of a persistent bf16 copy (role
  /// weight, `of` the master); nullptr for anything else.
  const Param *updatedParam(llvm::StringRef fetched) const;
  /// Whether the host_adamw instructions are deferred (kDeferredAttr).
  bool defersUpdates() const;
  /// Whether an instruction runs the exact GELU (kExactAttr).
  bool hasExactGelu() const;
  /// Whether the loss is weighted per sample (kLossWeightsInput).
  bool hasWeightedLoss() const;
  /// Whether the moments are int8 or factored (hostState).
  bool hasLeanMoments() const { return !hostState.empty(); }
  /// The oldest format version that describes the plan.
  int64_t oldestVersion() const;
  /// The ranks of the job the plan was compiled for (megaslide-plan
  /// --gpus-per-node x --nodes): its collectives' (validate() holds every
  /// collective and every `ranks` copy to one number); 1 without any.
  int64_t jobRanks() const;
};

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_EXECPLAN_H
