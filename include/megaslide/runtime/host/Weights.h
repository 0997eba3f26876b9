//===- Weights.h - diffusers-format model weights ---------------*- C++ -*-===//
//
// Loads and saves the model weights of a HostState (its role master and
// frozen tensors) as a diffusers transformer directory, so that a model
// fine-tuned by MegaSlide opens with `from_pretrained` and diffusers
// checkpoints (Wan 2.1) start a fine-tuning run:
//
//   DIR/config.json                                     the model config
//   DIR/diffusion_pytorch_model.safetensors             one file, or
//   DIR/diffusion_pytorch_model-0000i-of-0000N.safetensors   N shards and
//   DIR/diffusion_pytorch_model.safetensors.index.json  their index
//
// Tensor names are the plan's parameter names (diffusers' names).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_HOST_WEIGHTS_H
#define MEGASLIDE_RUNTIME_HOST_WEIGHTS_H

#include "megaslide/runtime/host/HostState.h"
#include "megaslide/runtime/host/Safetensors.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/JSON.h"

#include <cstdint>
#include <vector>

namespace megaslide::dist {
class Collectives;
} // namespace megaslide::dist

namespace megaslide::host {

inline constexpr llvm::StringLiteral kWeightsFile =
    "diffusion_pytorch_model.safetensors";
inline constexpr llvm::StringLiteral kWeightsIndexFile =
    "diffusion_pytorch_model.safetensors.index.json";
inline constexpr llvm::StringLiteral kWeightsConfigFile = "config.json";

struct SaveWeightsOptions {
  /// Largest shard in bytes; a tensor larger than this gets a shard of its
  /// own. diffusers' default max_shard_size "5GB" (decimal, as there).
  uint64_t maxShardBytes = 5'000'000'000;
  /// F32 or BF16 (rounded to nearest even).
  StDType dtype = StDType::F32;
  /// Every plan the run trained with (one per bucket), for the record
  /// under kRunConfigKey; empty: the plan saved with.
  std::vector<const exec::ExecPlan *> runPlans;
  /// In a job of several ranks, every rank calls saveWeights with its
  /// shards: rank 0 writes the folder, gathering each file's tensors as it
  /// writes it; the others only send theirs.
  dist::Collectives *job = nullptr;
};

/// Whether `param` is one of the model weights (role master or frozen).
bool isWeightParam(const exec::Param &param);

/// The key of config.json under which saveWeights records how the plan
/// attends; diffusers passes no key that starts with '_' to a model.
inline constexpr llvm::StringLiteral kRunConfigKey = "_megaslide";

/// What saveWeights records under kRunConfigKey, read from the plan's ops
/// (docs/Runtime.md, "Weights"): {"format": 1, "attention": "dsa" when a
/// self-attention runs as 3D-DSA, else "global", "grid": the token grid,
/// "dsa3d": {"window", "tile", "radius", "layers"} (3D-DSA only), and
/// "global_layers": the blocks whose self-attention stays global}.
/// Self-attention is an attention reading RoPE'd queries and keys, as
/// rewrite-attention-to-dsa decides. An error if two 3D-DSA ops of the
/// plan differ in window, tile or radius (one record cannot say both).
/// Of several plans (a run over buckets): "dsa" when any runs 3D-DSA (all
/// of them with one window, tile and radius), "layers" the blocks that run
/// it in any plan, "global_layers" those that run it in none, and "grids"
/// (one per plan, in order) instead of "grid".
llvm::Expected<llvm::json::Object>
runConfigOf(llvm::ArrayRef<const exec::ExecPlan *> plans);

/// Writes the weights of `state` (made for `plan`) to directory `dir`
/// (created if needed), in plan order, with `plan.modelConfig` as
/// config.json plus runConfigOf(plan) under kRunConfigKey (replacing one
/// the model config carried; keys in sorted order, as diffusers writes). Every
/// file is written and fsynced under a temporary name (support/AtomicFile.h)
/// and renamed into place only once all of them are complete; weight files of
/// an earlier save in `dir` that this one does not produce (other shard counts,
/// a stale index) are removed afterwards. A failed write (disk full, unwritable
/// `dir`) leaves the files of `dir` as they were and removes the folders this
/// call created; the error names the file.
llvm::Error saveWeights(const exec::ExecPlan &plan, const HostState &state,
                        llvm::StringRef dir,
                        const SaveWeightsOptions &options = {});

/// The model config keys (diffusers' WanTransformer3DModel arguments) that
/// fix the weights' shapes and the forward's meaning; the others
/// (rope_max_seq_len, eps, ...) do not. megaslide.export compares the same.
llvm::ArrayRef<llvm::StringLiteral> architectureKeys();

/// Loads the weights of `state` from `path`: a directory as above (the
/// index if present, else the single file) or one .safetensors file. With
/// `plan`, a config.json in the directory must give every
/// architectureKeys() entry it has the plan's model config's value: one
/// error lists the differences (2 heads of 32 and 4 of 16 have the same
/// tensor shapes, not the same model).
/// F32, BF16 and F16 are converted to fp32. Every file is validated and the
/// tensor set compared with the plan before any data is read: unknown,
/// missing and differently shaped tensors are listed together in one
/// error. Only an I/O error while reading data leaves `state` partly
/// loaded. Tensors of other roles (moments) are not touched.
llvm::Error loadWeights(llvm::StringRef path, HostState &state,
                        const exec::ExecPlan *plan = nullptr);

/// A tensor of a file opened for loading.
struct FoundTensor {
  const SafetensorsReader *file = nullptr;
  const StTensorInfo *info = nullptr;
};

/// Compares the tensors found in `source` with those of `state` whose
/// param satisfies `wanted`, and names in one error (first few of each
/// kind, with counts) the missing, unexpected, differently shaped and
/// unreadable (non-float dtype) ones. Shared with checkpoints.
llvm::Error
checkTensorSet(llvm::StringRef source,
               const llvm::StringMap<FoundTensor> &found,
               const HostState &state,
               llvm::function_ref<bool(const exec::Param &)> wanted);

} // namespace megaslide::host

#endif // MEGASLIDE_RUNTIME_HOST_WEIGHTS_H
