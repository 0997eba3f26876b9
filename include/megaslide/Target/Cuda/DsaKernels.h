//===- DsaKernels.h - CUDA C++ emission of 3D-DSA kernels -------*- C++ -*-===//
//
// Collects the distinct 3D Deformable Slide Attention configurations of a
// module and emits, per configuration, one CUDA C++ source with the
// forward, backward (dQ by query tiles, dK/dV by key tiles) and
// offset-estimation kernels, every shape a compile-time constant. The
// sources are compiled at run time by NVRTC
// (include/megaslide/runtime/cuda/Nvrtc.h).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TARGET_CUDA_DSAKERNELS_H
#define MEGASLIDE_TARGET_CUDA_DSAKERNELS_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Support/LLVM.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace megaslide::cuda {

/// Everything a 3D-DSA kernel is specialised on. Batch size and softmax
/// scale are run-time values (launch grid z, kernel argument).
struct DsaConfig {
  std::array<int64_t, 3> grid{};   ///< token grid (T, Y, X)
  std::array<int64_t, 3> window{}; ///< key window (kt, ky, kx)
  std::array<int64_t, 3> tile{};   ///< query tile (tt, ty, tx)
  int64_t heads = 0;
  int64_t headDim = 0;
  std::string elementType; ///< "bf16" or "f16" (anything else is rejected)
  int64_t radius = 0;      ///< offset search radius R: [-R, R]^2

  bool operator==(const DsaConfig &o) const;
  bool operator<(const DsaConfig &o) const;

  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
  std::array<int64_t, 3> tileCounts() const;
  int64_t tiles() const;
  int64_t tileQueries() const { return tile[0] * tile[1] * tile[2]; }
  int64_t windowKeys() const { return window[0] * window[1] * window[2]; }
  /// "grid (21,45,80) window (9,15,24) tile (3,5,8) heads 96 head-dim 128
  /// bf16 radius 4".
  std::string describe() const;
};

enum class DsaKernelKind { Forward, Backward, BackwardKeys, Offsets };

/// "forward", "backward", "backward_keys", "offsets".
llvm::StringRef kindName(DsaKernelKind kind);

/// All kinds, in the order they appear in a source and the manifest.
std::vector<DsaKernelKind> allKernelKinds();

/// Stem of the configuration's source file and kernel names, e.g.
/// dsa3d_g21x45x80_w9x15x24_t3x5x8_h96_d128_bf16_r4.
std::string configName(const DsaConfig &config);

/// The extern "C" name of one kernel: configName + "_fwd" / "_bwd" /
/// "_bwd_keys" / "_offsets".
std::string kernelName(const DsaConfig &config, DsaKernelKind kind);

/// Launch shape of one kernel. Grid extents are given for batch B = 1 with
/// the z extent equal to B; `gridFormula` states them in words.
struct DsaLaunch {
  DsaKernelKind kind;
  std::string name;
  std::array<int64_t, 3> grid{};
  std::string gridFormula;
  int threads = 0;
  int64_t dynamicSharedBytes = 0; ///< needs cudaFuncAttributeMaxDynamic...
  std::string arguments;          ///< the C parameter list, for launchers
};

/// Tuning of a configuration's kernels (chosen by planDsaKernels).
struct DsaKernelPlan {
  int fwdWarps = 0, fwdKeyChunk = 0, fwdStages = 0, fwdQueryBlocks = 0;
  int fwdMinBlocks = 1; ///< __launch_bounds__ min blocks per SM
  /// Q fragments loaded once and kept in registers across key chunks.
  bool fwdQueryInRegisters = false;
  int bwdWarps = 0, bwdKeyChunk = 0, bwdStages = 0, bwdQueryBlocks = 0;
  /// dK/dV kernel: warps of 16 keys, key blocks per key tile, query rows
  /// per staged chunk, stages.
  int keyWarps = 0, keyBlocks = 0, keyQueryChunk = 0, keyStages = 0;
  /// Inverse tile neighbourhood per axis (t, y, x): for key tile m along
  /// the axis, the first and last query tile whose window can hold one of
  /// its keys for some displacement in [-R, R] (R = 0 along t); last <
  /// first when none can. `maxInverseRange`: the longest range per axis
  /// (at least 1).
  std::array<std::vector<std::array<int64_t, 2>>, 3> inverseRanges;
  std::array<int64_t, 3> maxInverseRange{};
  int offThreads = 256;
  int64_t fwdSharedBytes = 0, bwdSharedBytes = 0, keySharedBytes = 0,
          offStaticSharedBytes = 0;
  std::vector<DsaLaunch> launches;
};

/// Checks the configuration is supported (16-bit element type, head dim a
/// multiple of 16 in [16, 256], shared memory within sm_90 limits) and
/// chooses warps, key chunks and pipeline stages. On failure returns false
/// with a message in `error`.
bool planDsaKernels(const DsaConfig &config, DsaKernelPlan &plan,
                    std::string &error);

/// The CUDA C++ source of one configuration: a header comment naming it,
/// its constants, then the kernels. Requires a plan from planDsaKernels.
std::string emitDsaKernelSource(const DsaConfig &config,
                                const DsaKernelPlan &plan);

/// The distinct configurations of the dsa3d, dsa3d_grad and dsa3d_offsets
/// ops of `module`, sorted. The radius of an attention op is that of the
/// dsa3d_offsets op producing its offsets; attention ops with offsets from
/// elsewhere join a configuration of the same geometry, or radius 0.
std::vector<DsaConfig> collectDsaConfigs(mlir::ModuleOp module);

/// The manifest of a set of configurations as JSON: per configuration its
/// parameters, source file and, per kernel, name, grid/block formulas and
/// shared memory bytes.
void writeDsaManifest(llvm::ArrayRef<DsaConfig> configs,
                      llvm::ArrayRef<DsaKernelPlan> plans,
                      llvm::raw_ostream &os);

/// Plans and emits every configuration of `module`: writes `<dir>/<name>.cu`
/// and `<dir>/manifest.json`, or, with an empty `dir`, all sources to
/// `stdout`, each after a line "//--- <name>.cu" (the split-file format).
/// The files of `dir` are replaced all together or not at all (each one
/// atomically, renamed only once all are written, the manifest last; see
/// docs/Runtime.md, "Output files"). Unsupported configurations are
/// reported on the op that uses them. `emitted` receives the
/// configurations, plans and source paths.
struct EmittedDsaKernels {
  std::vector<DsaConfig> configs;
  std::vector<DsaKernelPlan> plans;
  std::vector<std::string> sources; ///< source text per configuration
  std::vector<std::string> paths;   ///< written files (empty with no dir)
};
mlir::LogicalResult emitDsaKernels(mlir::ModuleOp module, llvm::StringRef dir,
                                   llvm::raw_ostream &stdoutStream,
                                   EmittedDsaKernels &emitted);

} // namespace megaslide::cuda

#endif // MEGASLIDE_TARGET_CUDA_DSAKERNELS_H
