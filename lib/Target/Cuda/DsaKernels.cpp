//===- DsaKernels.cpp - CUDA C++ emission of 3D-DSA kernels ---------------===//
//
// Source emission is a translation of the module (like upstream EmitC's
// TranslateToCpp), not a pass: it reads the dsa3d ops and writes text. The
// kernels are one fixed CUDA C++ text (device/Dsa3dDevice.cuh and
// device/Dsa3dKernels.cu, compiled in as text); what varies per
// configuration is the block of constants in front of it, so every shape
// is a compile-time constant to NVRTC.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Target/Cuda/DsaKernels.h"

#include "dialects/Graph/GraphOps.h"
#include "megaslide/Support/EmbeddedFile.h"
#include "megaslide/runtime/support/AtomicFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MathExtras.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <map>
#include <tuple>

using namespace mlir;

namespace megaslide::cuda {

namespace {
/// The kernels' CUDA C++, written against the constants of
/// emitDsaKernelSource: one text per file of device/, in order.
const EmbeddedFile kDeviceFiles[] = {
#include "megaslide/Target/Cuda/Dsa3dDeviceText.inc"
};
} // namespace

//===----------------------------------------------------------------------===//
// DsaConfig
//===----------------------------------------------------------------------===//

static auto tie(const DsaConfig &c) {
  return std::tie(c.grid, c.window, c.tile, c.heads, c.headDim, c.elementType,
                  c.radius);
}

bool DsaConfig::operator==(const DsaConfig &o) const {
  return tie(*this) == tie(o);
}
bool DsaConfig::operator<(const DsaConfig &o) const {
  return tie(*this) < tie(o);
}

std::array<int64_t, 3> DsaConfig::tileCounts() const {
  return {llvm::divideCeilSigned(grid[0], tile[0]),
          llvm::divideCeilSigned(grid[1], tile[1]),
          llvm::divideCeilSigned(grid[2], tile[2])};
}

int64_t DsaConfig::tiles() const {
  auto n = tileCounts();
  return n[0] * n[1] * n[2];
}

static std::string triple(const std::array<int64_t, 3> &v, StringRef sep) {
  return llvm::formatv("{0}{3}{1}{3}{2}", v[0], v[1], v[2], sep).str();
}

std::string DsaConfig::describe() const {
  return llvm::formatv("grid ({0}) window ({1}) tile ({2}) heads {3} head-dim "
                       "{4} {5} radius {6}",
                       triple(grid, ","), triple(window, ","),
                       triple(tile, ","), heads, headDim, elementType, radius)
      .str();
}

StringRef kindName(DsaKernelKind kind) {
  switch (kind) {
  case DsaKernelKind::Forward:
    return "forward";
  case DsaKernelKind::Backward:
    return "backward";
  case DsaKernelKind::BackwardKeys:
    return "backward_keys";
  case DsaKernelKind::Offsets:
    return "offsets";
  }
  llvm_unreachable("unknown 3D-DSA kernel kind");
}

std::vector<DsaKernelKind> allKernelKinds() {
  return {DsaKernelKind::Forward, DsaKernelKind::Backward,
          DsaKernelKind::BackwardKeys, DsaKernelKind::Offsets};
}

std::string configName(const DsaConfig &c) {
  return llvm::formatv("dsa3d_g{0}_w{1}_t{2}_h{3}_d{4}_{5}_r{6}",
                       triple(c.grid, "x"), triple(c.window, "x"),
                       triple(c.tile, "x"), c.heads, c.headDim, c.elementType,
                       c.radius)
      .str();
}

std::string kernelName(const DsaConfig &config, DsaKernelKind kind) {
  static const char *suffix[] = {"_fwd", "_bwd", "_bwd_keys", "_offsets"};
  return configName(config) + suffix[static_cast<int>(kind)];
}

//===----------------------------------------------------------------------===//
// Planning: warps, key chunks, pipeline stages, shared memory
//===----------------------------------------------------------------------===//

namespace {

// sm_90 (H100/H200): 227 KB of shared memory per block, 228 KB per SM with
// 1 KB reserved per block; static shared memory at most 48 KB.
constexpr int64_t kMaxSharedPerBlock = 227 * 1024;
constexpr int64_t kSharedPerSm = 228 * 1024;
constexpr int64_t kSharedReservedPerBlock = 1024;
constexpr int64_t kMaxStaticShared = 48 * 1024;
/// Warps per CTA: 8 x 16 = 128 queries; more gives fewer registers each.
constexpr int kMaxWarps = 8;

int64_t fwdShared(const DsaConfig &c, int warps, int chunk, int stages) {
  int64_t rows = 16 * warps, dp = c.headDim + 8;
  return rows * dp * 2 + 2 * stages * chunk * dp * 2 + rows * 4 +
         c.window[0] * 4;
}

int64_t bwdShared(const DsaConfig &c, int warps, int chunk, int stages) {
  int64_t rows = 16 * warps, dp = c.headDim + 8;
  return 2 * rows * dp * 2 + 2 * stages * chunk * dp * 2 + rows * 12 +
         c.window[0] * 4;
}

/// The dK/dV kernel's shared memory (the layout of DSA_BWD_KEYS_NAME): K
/// and V of its keys, `stages` buffers of `chunk` query rows (q, dO, lse,
/// Delta, window), key tokens, the step list, candidate flags and the
/// step count (the emulation tests launch with exactly this size).
int64_t keyShared(const DsaConfig &c, int warps, int chunk, int stages,
                  int64_t candidates) {
  int64_t rows = 16 * warps, dp = c.headDim + 8;
  int64_t qchunks = llvm::divideCeilSigned(c.tileQueries(), chunk);
  return 2 * rows * dp * 2 + 2 * stages * chunk * dp * 2 + stages * chunk * 8 +
         stages * (2 * c.window[0] + 1) * 4 + rows * 4 +
         candidates * qchunks * 4 + candidates * 4 + 4;
}

/// Along one axis (grid g, window k, tile t, radius r): for each key tile,
/// the range of query tiles whose window, displaced by any d in [-r, r] and
/// clamped, holds one of its keys (docs/Dsa3dKernels.md, "Backward"). The
/// window start is nondecreasing in the tile and in d, so the union over d
/// is [s(-r), s(r) + k) and the query tiles form one range.
std::vector<std::array<int64_t, 2>> inverseRange(int64_t g, int64_t k,
                                                 int64_t t, int64_t r) {
  int64_t tiles = llvm::divideCeilSigned(g, t);
  auto start = [&](int64_t i, int64_t d) {
    int64_t first = i * t, n = std::min(t, g - first);
    int64_t centre = (2 * first + n - 1) / 2;
    return std::clamp<int64_t>(centre + d - k / 2, 0, g - k);
  };
  std::vector<std::array<int64_t, 2>> ranges;
  for (int64_t m = 0; m < tiles; ++m) {
    int64_t first = m * t, last = std::min(first + t, g) - 1;
    std::array<int64_t, 2> range = {0, -1};
    for (int64_t i = 0; i < tiles; ++i)
      if (start(i, -r) <= last && start(i, r) + k - 1 >= first) {
        if (range[1] < range[0])
          range[0] = i;
        range[1] = i;
      }
    ranges.push_back(range);
  }
  return ranges;
}

/// Splits the tile's 16-query warps into query blocks of at most `maxWarps`
/// warps each, balanced.
void splitQueries(const DsaConfig &c, int maxWarps, int &warps, int &blocks) {
  int64_t needed = llvm::divideCeilSigned(c.tileQueries(), 16);
  blocks = static_cast<int>(llvm::divideCeilSigned(needed, maxWarps));
  warps = static_cast<int>(llvm::divideCeilSigned(needed, blocks));
}

/// Chooses (warps, chunk, stages) for a kernel whose shared memory is
/// `shared`: the preferred chunk, two stages when there is more than one
/// chunk; then fewer stages, smaller chunks, fewer warps until it fits.
template <typename SharedFn>
bool fitShared(const DsaConfig &c, int preferredChunk, SharedFn shared,
               int &warps, int &blocks, int &chunk, int &stages,
               int64_t &bytes) {
  int64_t keys16 = llvm::divideCeilSigned(c.windowKeys(), 16) * 16;
  for (int maxWarps = kMaxWarps; maxWarps >= 1; maxWarps /= 2) {
    splitQueries(c, maxWarps, warps, blocks);
    for (int kc = static_cast<int>(std::min<int64_t>(preferredChunk, keys16));
         kc >= 16; kc /= 2) {
      kc = kc / 16 * 16;
      for (int st = c.windowKeys() > kc ? 2 : 1; st >= 1; --st) {
        bytes = shared(c, warps, kc, st);
        if (bytes <= kMaxSharedPerBlock) {
          chunk = kc;
          stages = st;
          return true;
        }
      }
    }
  }
  return false;
}

std::string kernelArguments(DsaKernelKind kind) {
  switch (kind) {
  case DsaKernelKind::Forward:
    return "const elem_t *q, const elem_t *k, const elem_t *v, const int "
           "*offsets, elem_t *out, float *lse, float scale";
  case DsaKernelKind::Backward:
    return "const elem_t *q, const elem_t *k, const elem_t *v, const int "
           "*offsets, const elem_t *o, const elem_t *dout, const float *lse, "
           "elem_t *dq, float *delta, float scale";
  case DsaKernelKind::BackwardKeys:
    return "const elem_t *q, const elem_t *k, const elem_t *v, const int "
           "*offsets, const elem_t *dout, const float *lse, const float "
           "*delta, elem_t *dk, elem_t *dv, float scale";
  case DsaKernelKind::Offsets:
    return "const elem_t *q, const elem_t *k, int *offsets";
  }
  llvm_unreachable("unknown 3D-DSA kernel kind");
}

} // namespace

bool planDsaKernels(const DsaConfig &c, DsaKernelPlan &plan,
                    std::string &error) {
  plan = DsaKernelPlan();
  if (c.elementType != "bf16" && c.elementType != "f16") {
    error = "3D-DSA CUDA kernels take bf16 or f16 q/k/v (tensor-core mma), "
            "got " +
            c.elementType;
    return false;
  }
  if (c.headDim % 16 != 0 || c.headDim < 16 || c.headDim > 256) {
    error = llvm::formatv("head dim {0} is not supported by the 3D-DSA CUDA "
                          "kernels: it must be a multiple of 16 in [16, 256] "
                          "(the mma k-step is 16)",
                          c.headDim);
    return false;
  }
  for (int i = 0; i < 3; ++i)
    if (c.grid[i] <= 0 || c.window[i] <= 0 || c.tile[i] <= 0 ||
        c.window[i] > c.grid[i]) {
      error = "3D-DSA configuration needs positive extents and a window "
              "within the grid: " +
              c.describe();
      return false;
    }
  // Token indices are 32-bit inside the kernels (element offsets 64-bit).
  if (c.tokens() >= (int64_t(1) << 31)) {
    error = "3D-DSA grid too large for 32-bit token indexing: " + c.describe();
    return false;
  }
  if (c.radius > 4096) {
    error = llvm::formatv("offset radius {0} is too large", c.radius);
    return false;
  }

  // Forward: with D <= 128 the 8-warp CTA fits in 128 registers per thread,
  // so ptxas is asked for two CTAs per SM. The O accumulator takes D / 2
  // registers and S chunk / 2: 64-key chunks fit for D <= 64 and D = 128,
  // 32-key chunks otherwise (NVRTC 13.0: D = 112 with 64-key chunks spills
  // 32 bytes at 128 registers; see docs/Dsa3dKernels.md).
  int fwdChunk = c.headDim <= 64 || c.headDim == 128 ? 64 : 32;
  if (!fitShared(c, fwdChunk, fwdShared, plan.fwdWarps, plan.fwdQueryBlocks,
                 plan.fwdKeyChunk, plan.fwdStages, plan.fwdSharedBytes)) {
    error = "no forward kernel shape fits in shared memory for " + c.describe();
    return false;
  }
  plan.fwdMinBlocks =
      c.headDim <= 128 && 2 * (plan.fwdSharedBytes + kSharedReservedPerBlock) <=
                              kSharedPerSm
          ? 2
          : 1;
  // Q fragments in registers across key chunks (D / 4 registers) when they
  // fit next to O (D / 2), S (chunk / 2) and about 40 for addresses and
  // softmax state. NVRTC 13.0, 105B (D = 128, two CTAs): 488 spill bytes
  // with 64-key chunks, 64 with 32-key chunks; one CTA per SM, 189
  // registers and no spills. Two CTAs with Q reloaded is kept there.
  int64_t fwdRegs = c.headDim / 2 + c.headDim / 4 + plan.fwdKeyChunk / 2 + 40;
  plan.fwdQueryInRegisters = fwdRegs <= (plan.fwdMinBlocks == 2 ? 128 : 255);

  // Backward, queries: dQ (D / 2 registers) stays live across chunks next
  // to S and dP (chunk / 2 each); one CTA per SM, up to 255 registers.
  int bwdChunk = c.headDim <= 128 ? 64 : 32;
  if (!fitShared(c, bwdChunk, bwdShared, plan.bwdWarps, plan.bwdQueryBlocks,
                 plan.bwdKeyChunk, plan.bwdStages, plan.bwdSharedBytes)) {
    error =
        "no backward kernel shape fits in shared memory for " + c.describe();
    return false;
  }

  // Backward, keys: dK and dV (D registers) stay live across the query
  // tiles; 16 queries at a time keep S^T and dP^T at 8 registers each. The
  // whole tile's queries per staged chunk when they fit (one step per
  // query tile), two stages, then smaller chunks, one stage, fewer warps.
  for (int axis = 0; axis < 3; ++axis) {
    plan.inverseRanges[axis] = inverseRange(
        c.grid[axis], c.window[axis], c.tile[axis], axis == 0 ? 0 : c.radius);
    for (const auto &r : plan.inverseRanges[axis])
      plan.maxInverseRange[axis] =
          std::max(plan.maxInverseRange[axis], r[1] - r[0] + 1);
    // At least one, so that the kernel's candidate batches make progress.
    plan.maxInverseRange[axis] =
        std::max<int64_t>(plan.maxInverseRange[axis], 1);
  }
  int64_t candidates = plan.maxInverseRange[0] * plan.maxInverseRange[1] *
                       plan.maxInverseRange[2];
  bool keyFits = false;
  for (int maxWarps = kMaxWarps; maxWarps >= 1 && !keyFits; maxWarps /= 2) {
    splitQueries(c, maxWarps, plan.keyWarps, plan.keyBlocks);
    for (int qc = static_cast<int>(std::min<int64_t>(
             128, llvm::divideCeilSigned(c.tileQueries(), 16) * 16));
         qc >= 16 && !keyFits; qc = qc / 2 / 16 * 16)
      for (int st = 2; st >= 1 && !keyFits; --st) {
        plan.keySharedBytes = keyShared(c, plan.keyWarps, qc, st, candidates);
        if (plan.keySharedBytes <= kMaxSharedPerBlock) {
          plan.keyQueryChunk = qc;
          plan.keyStages = st;
          keyFits = true;
        }
      }
  }
  if (!keyFits) {
    error = "no dK/dV kernel shape fits in shared memory for " + c.describe();
    return false;
  }

  // Offsets: static shared memory for the pooled query, the dot map of the
  // union of candidate windows and one candidate per warp.
  int64_t ry = std::min(c.window[1] + 2 * c.radius, c.grid[1]);
  int64_t rx = std::min(c.window[2] + 2 * c.radius, c.grid[2]);
  plan.offStaticSharedBytes =
      c.headDim * 4 + ry * rx * 4 + (plan.offThreads / 32) * 8;
  if (plan.offStaticSharedBytes > kMaxStaticShared) {
    error = llvm::formatv("offset estimation needs {0} bytes of static shared "
                          "memory (> 48 KB) for radius {1}; use a smaller "
                          "radius",
                          plan.offStaticSharedBytes, c.radius);
    return false;
  }

  auto add = [&](DsaKernelKind kind, std::array<int64_t, 3> grid,
                 std::string formula, int threads, int64_t smem) {
    plan.launches.push_back(DsaLaunch{kind, kernelName(c, kind), grid,
                                      std::move(formula), threads, smem,
                                      kernelArguments(kind)});
  };
  add(DsaKernelKind::Forward, {c.tiles() * plan.fwdQueryBlocks, c.heads, 1},
      llvm::formatv("(tiles {0} x query blocks {1}, heads {2}, batch B)",
                    c.tiles(), plan.fwdQueryBlocks, c.heads),
      32 * plan.fwdWarps, plan.fwdSharedBytes);
  add(DsaKernelKind::Backward, {c.tiles() * plan.bwdQueryBlocks, c.heads, 1},
      llvm::formatv("(tiles {0} x query blocks {1}, heads {2}, batch B)",
                    c.tiles(), plan.bwdQueryBlocks, c.heads),
      32 * plan.bwdWarps, plan.bwdSharedBytes);
  add(DsaKernelKind::BackwardKeys, {c.tiles() * plan.keyBlocks, c.heads, 1},
      llvm::formatv("(key tiles {0} x key blocks {1}, heads {2}, batch B); "
                    "after the backward (reads its delta)",
                    c.tiles(), plan.keyBlocks, c.heads),
      32 * plan.keyWarps, plan.keySharedBytes);
  add(DsaKernelKind::Offsets, {c.tiles(), c.heads, 1},
      llvm::formatv("(tiles {0}, heads {1}, batch B)", c.tiles(), c.heads),
      plan.offThreads, 0);
  return true;
}

//===----------------------------------------------------------------------===//
// Source
//===----------------------------------------------------------------------===//

std::string emitDsaKernelSource(const DsaConfig &c, const DsaKernelPlan &p) {
  std::string out;
  llvm::raw_string_ostream os(out);
  auto n = c.tileCounts();
  os << "// 3D Deformable Slide Attention kernels, generated by MegaSlide "
        "(megaslide-translate\n"
     << "// --emit-dsa-kernels); do not edit. Semantics: docs/Dsa3d.md, "
        "\"Definition\".\n"
     << "// Compile with NVRTC for sm_80 or newer (sm_90a on "
        "H100/H200).\n//\n"
     << "// Configuration " << configName(c) << ":\n"
     << llvm::formatv("//   grid (T, Y, X)      = ({0})  {1} tokens\n",
                      triple(c.grid, ", "), c.tokens())
     << llvm::formatv("//   window (kt, ky, kx) = ({0})  {1} keys per query "
                      "tile\n",
                      triple(c.window, ", "), c.windowKeys())
     << llvm::formatv("//   tile (tt, ty, tx)   = ({0})  {1} queries; {2} x "
                      "{3} x {4} = {5} tiles\n",
                      triple(c.tile, ", "), c.tileQueries(), n[0], n[1], n[2],
                      c.tiles())
     << llvm::formatv("//   heads {0}, head dim {1}, element type {2}, offset "
                      "radius {3}\n//\n",
                      c.heads, c.headDim, c.elementType, c.radius)
     << "// Layouts: q, k, v, out, dq [B, N, H, D] (N = T*Y*X row-major); "
        "offsets i32\n"
     << "// [B, H, nT, nY, nX, kt, 2] (dy, dx); lse fp32 [B, H, N], natural "
        "log of\n"
     << "// sum exp(scale q.k): written by the forward (megaslide.dsa3d's "
        "second result),\n"
     << "// read by the backward (megaslide.dsa3d_grad's lse operand); delta "
        "fp32\n"
     << "// [B, H, N], rowsum(dO * O): scratch written by the backward, read "
        "by the\n"
     << "// dK/dV kernel (launched after it).\n//\n"
     << "// Kernels (grid for batch B; all dynamic shared memory beyond 48 KB "
        "needs\n"
     << "// cudaFuncAttributeMaxDynamicSharedMemorySize):\n";
  for (const DsaLaunch &l : p.launches)
    os << "//   " << l.name << "\n//     grid " << l.gridFormula << ", "
       << l.threads << " threads, " << l.dynamicSharedBytes
       << " bytes dynamic shared memory\n";
  os << "\n#define DSA_BF16 " << (c.elementType == "bf16" ? 1 : 0) << "\n"
     << "#define DSA_FWD_NAME " << kernelName(c, DsaKernelKind::Forward) << "\n"
     << "#define DSA_BWD_NAME " << kernelName(c, DsaKernelKind::Backward)
     << "\n"
     << "#define DSA_BWD_KEYS_NAME "
     << kernelName(c, DsaKernelKind::BackwardKeys) << "\n"
     << "#define DSA_OFFSETS_NAME " << kernelName(c, DsaKernelKind::Offsets)
     << "\n\n"
     << "namespace dsa {\n"
     << "// Configuration.\n"
     << llvm::formatv("constexpr int T = {0}, Y = {1}, X = {2};\n", c.grid[0],
                      c.grid[1], c.grid[2])
     << llvm::formatv("constexpr int KT = {0}, KY = {1}, KX = {2};\n",
                      c.window[0], c.window[1], c.window[2])
     << llvm::formatv("constexpr int TT = {0}, TY = {1}, TX = {2};\n",
                      c.tile[0], c.tile[1], c.tile[2])
     << llvm::formatv("constexpr int H = {0}, D = {1}, R = {2};\n", c.heads,
                      c.headDim, c.radius)
     << "// Kernel shapes (chosen by the generator for registers and shared "
        "memory).\n"
     << llvm::formatv("constexpr int FWD_WARPS = {0}, FWD_KC = {1}, "
                      "FWD_STAGES = {2}, FWD_QBLOCKS = {3};\n",
                      p.fwdWarps, p.fwdKeyChunk, p.fwdStages, p.fwdQueryBlocks)
     << llvm::formatv("constexpr int FWD_MIN_BLOCKS = {0};\n", p.fwdMinBlocks)
     << llvm::formatv("constexpr bool FWD_QREG = {0};\n",
                      p.fwdQueryInRegisters ? "true" : "false")
     << llvm::formatv("constexpr int BWD_WARPS = {0}, BWD_KC = {1}, "
                      "BWD_STAGES = {2}, BWD_QBLOCKS = {3};\n",
                      p.bwdWarps, p.bwdKeyChunk, p.bwdStages, p.bwdQueryBlocks)
     << "constexpr int BWD_MIN_BLOCKS = 1;\n"
     << llvm::formatv("constexpr int BKV_WARPS = {0}, BKV_QC = {1}, "
                      "BKV_STAGES = {2}, BKV_KBLOCKS = {3};\n",
                      p.keyWarps, p.keyQueryChunk, p.keyStages, p.keyBlocks)
     << "// Inverse tile neighbourhood (computed by the generator): per key "
        "tile along\n"
     << "// t, y, x, the first and last query tile whose window can hold one "
        "of its\n"
     << "// keys for some displacement in [-R, R] (none along t).\n"
     << llvm::formatv("constexpr int BKV_CAND_T = {0}, BKV_CAND_Y = {1}, "
                      "BKV_CAND_X = {2};\n",
                      p.maxInverseRange[0], p.maxInverseRange[1],
                      p.maxInverseRange[2]);
  static const char *axisName[] = {"T", "Y", "X"};
  for (int axis = 0; axis < 3; ++axis) {
    os << "__device__ const int INV_" << axisName[axis] << "["
       << p.inverseRanges[axis].size() << "][2] = {";
    llvm::interleaveComma(p.inverseRanges[axis], os,
                          [&](const std::array<int64_t, 2> &r) {
                            os << "{" << r[0] << ", " << r[1] << "}";
                          });
    os << "};\n";
  }
  os << llvm::formatv("constexpr int OFF_THREADS = {0};\n", p.offThreads)
     << "} // namespace dsa\n";
  for (const EmbeddedFile &file : kDeviceFiles)
    os << file.text;
  return out;
}

//===----------------------------------------------------------------------===//
// Collecting configurations
//===----------------------------------------------------------------------===//

namespace {

std::string elementTypeName(Value v) {
  Type t = cast<ShapedType>(v.getType()).getElementType();
  if (t.isBF16())
    return "bf16";
  if (t.isF16())
    return "f16";
  std::string s;
  llvm::raw_string_ostream os(s);
  t.print(os);
  return s;
}

std::array<int64_t, 3> toTriple(ArrayRef<int64_t> v) {
  return {v[0], v[1], v[2]};
}

template <typename OpTy> DsaConfig geometryOf(OpTy op) {
  DsaConfig c;
  c.grid = toTriple(op.getGrid());
  c.window = toTriple(op.getWindow());
  c.tile = toTriple(op.getTile());
  auto shape = cast<ShapedType>(op.getQuery().getType()).getShape();
  c.heads = shape[2];
  c.headDim = shape[3];
  c.elementType = elementTypeName(op.getQuery());
  return c;
}

bool sameGeometry(const DsaConfig &a, const DsaConfig &b) {
  DsaConfig x = a;
  x.radius = b.radius;
  return x == b;
}

/// Every 3D-DSA op with its configuration; attention ops whose offsets do
/// not come from a dsa3d_offsets op get their radius in a second step.
std::vector<std::pair<Operation *, DsaConfig>> opsWithConfigs(ModuleOp m) {
  std::vector<std::pair<Operation *, DsaConfig>> ops;
  std::vector<size_t> unresolved;
  auto attention = [&](Operation *op, DsaConfig c, Value offsets) {
    if (auto est = offsets.getDefiningOp<graph::Dsa3dOffsetsOp>())
      c.radius = est.getRadius();
    else
      unresolved.push_back(ops.size());
    ops.emplace_back(op, c);
  };
  m.walk([&](Operation *op) {
    if (auto est = dyn_cast<graph::Dsa3dOffsetsOp>(op)) {
      DsaConfig c = geometryOf(est);
      c.radius = est.getRadius();
      ops.emplace_back(op, c);
    } else if (auto fwd = dyn_cast<graph::Dsa3dOp>(op)) {
      attention(op, geometryOf(fwd), fwd.getOffsets());
    } else if (auto bwd = dyn_cast<graph::Dsa3dGradOp>(op)) {
      attention(op, geometryOf(bwd), bwd.getOffsets());
    }
  });
  for (size_t i : unresolved) {
    DsaConfig &c = ops[i].second;
    c.radius = -1;
    for (auto &[op, other] : ops)
      if (other.radius >= 0 && sameGeometry(c, other)) {
        c.radius = other.radius;
        break;
      }
    if (c.radius < 0)
      c.radius = 0; // offsets supplied from outside: nothing to estimate
  }
  return ops;
}

} // namespace

std::vector<DsaConfig> collectDsaConfigs(ModuleOp module) {
  std::vector<DsaConfig> configs;
  for (auto &[op, c] : opsWithConfigs(module))
    configs.push_back(c);
  llvm::sort(configs);
  configs.erase(std::unique(configs.begin(), configs.end()), configs.end());
  return configs;
}

//===----------------------------------------------------------------------===//
// Manifest and files
//===----------------------------------------------------------------------===//

void writeDsaManifest(ArrayRef<DsaConfig> configs,
                      ArrayRef<DsaKernelPlan> plans, llvm::raw_ostream &os) {
  llvm::json::OStream j(os, 2);
  auto array3 = [&](StringRef key, const std::array<int64_t, 3> &v) {
    j.attributeArray(key, [&] {
      for (int64_t x : v)
        j.value(x);
    });
  };
  j.object([&] {
    j.attribute("generator", "megaslide-translate --emit-dsa-kernels");
    j.attribute("layouts",
                "q, k, v, out, dq, dk, dv [B, N, H, D]; offsets i32 [B, H, "
                "nT, nY, nX, kt, 2]; lse, delta fp32 [B, H, N]");
    j.attribute("lse", "forward output (dsa3d's second result), backward "
                       "input (dsa3d_grad's lse operand)");
    j.attributeArray("configs", [&] {
      for (auto pair : llvm::zip(configs, plans)) {
        // Named references, not structured bindings: the lambdas below
        // capture them (a C++20 extension clang warns about).
        const auto &c = std::get<0>(pair);
        const auto &p = std::get<1>(pair);
        j.object([&] {
          j.attribute("name", configName(c));
          j.attribute("source", configName(c) + ".cu");
          array3("grid", c.grid);
          array3("window", c.window);
          array3("tile", c.tile);
          j.attribute("heads", c.heads);
          j.attribute("head_dim", c.headDim);
          j.attribute("element_type", c.elementType);
          j.attribute("radius", c.radius);
          j.attribute("tokens", c.tokens());
          array3("tile_counts", c.tileCounts());
          j.attribute("tile_queries", c.tileQueries());
          j.attribute("window_keys", c.windowKeys());
          j.attribute("scale", "kernel argument (default 1/sqrt(head_dim))");
          // lse is a graph tensor (planned like any result), not scratch.
          j.attribute("lse_bytes_per_sample", c.heads * c.tokens() * 4);
          // The backward's scratch: Delta = rowsum(dO * O), written by the
          // backward, read by the dK/dV kernel (no dK/dV accumulators).
          j.attributeObject("workspace_bytes_per_sample", [&] {
            j.attribute("delta", c.heads * c.tokens() * 4);
          });
          j.attributeArray("kernels", [&] {
            for (const DsaLaunch &l : p.launches)
              j.object([&] {
                j.attribute("kind", kindName(l.kind));
                j.attribute("name", l.name);
                j.attribute("grid_formula", l.gridFormula);
                j.attributeArray("grid_for_batch_1", [&] {
                  for (int64_t x : l.grid)
                    j.value(x);
                });
                j.attributeArray("block", [&] {
                  j.value(l.threads);
                  j.value(1);
                  j.value(1);
                });
                j.attribute("dynamic_shared_bytes", l.dynamicSharedBytes);
                j.attribute("arguments", l.arguments);
              });
          });
        });
      }
    });
  });
  os << "\n";
}

LogicalResult emitDsaKernels(ModuleOp module, StringRef dir,
                             llvm::raw_ostream &stdoutStream,
                             EmittedDsaKernels &emitted) {
  emitted = EmittedDsaKernels();
  // First op of each configuration, for diagnostics.
  std::map<DsaConfig, Operation *> firstUse;
  for (auto &[op, c] : opsWithConfigs(module))
    firstUse.emplace(c, op);

  bool failed = false;
  for (auto &[c, op] : firstUse) {
    DsaKernelPlan plan;
    std::string error;
    if (!planDsaKernels(c, plan, error)) {
      op->emitError() << error;
      failed = true;
      continue;
    }
    emitted.configs.push_back(c);
    emitted.plans.push_back(std::move(plan));
    emitted.sources.push_back(emitDsaKernelSource(c, emitted.plans.back()));
  }
  if (failed)
    return failure();

  if (dir.empty()) {
    for (auto [c, source] : llvm::zip(emitted.configs, emitted.sources))
      stdoutStream << "//--- " << configName(c) << ".cu\n" << source;
    return success();
  }
  // A folder that is missing is created, and removed again if the files
  // cannot be written; a path that exists is left to the writes below,
  // which name the file when it is not a folder.
  std::vector<std::string> created;
  if (!llvm::sys::fs::exists(dir))
    if (llvm::Error err = prepareOutputDirectory(dir, &created))
      return module.emitError() << llvm::toString(std::move(err));
  // Every file is written and fsynced under a temporary name first, and
  // they replace their destinations, the manifest last, only once all of
  // them are complete: a full disk leaves the folder as it was (old
  // manifest, old sources), and a source renamed before a failure is one
  // of the configurations its name encodes, consistent with either
  // manifest.
  std::vector<std::unique_ptr<AtomicFile>> files;
  auto fail = [&](llvm::Error err) -> LogicalResult {
    files.clear(); // removes the temporaries
    removeCreatedDirectories(created);
    return module.emitError() << llvm::toString(std::move(err));
  };
  auto write = [&](StringRef name, StringRef text) -> llvm::Error {
    llvm::SmallString<256> path(dir);
    llvm::sys::path::append(path, name);
    llvm::Expected<std::unique_ptr<AtomicFile>> file = AtomicFile::create(path);
    if (!file)
      return file.takeError();
    if (llvm::Error err = (*file)->write(text.data(), text.size()))
      return err;
    files.push_back(std::move(*file));
    return llvm::Error::success();
  };
  for (auto [c, source] : llvm::zip(emitted.configs, emitted.sources))
    if (llvm::Error err = write(configName(c) + ".cu", source))
      return fail(std::move(err));
  std::string manifest;
  llvm::raw_string_ostream ms(manifest);
  writeDsaManifest(emitted.configs, emitted.plans, ms);
  if (llvm::Error err = write("manifest.json", manifest))
    return fail(std::move(err));
  for (std::unique_ptr<AtomicFile> &file : files)
    if (llvm::Error err = file->finish())
      return fail(std::move(err));
  for (std::unique_ptr<AtomicFile> &file : files) {
    if (llvm::Error err = file->commit())
      return fail(std::move(err));
    emitted.paths.push_back(file->path().str());
  }
  return success();
}

} // namespace megaslide::cuda
