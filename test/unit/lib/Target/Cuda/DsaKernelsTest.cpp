//===- DsaKernelEmulationTest.cpp - Generated 3D-DSA kernels on the host --===//
//
// The CUDA kernels of lib/Target/Cuda cannot run here (no GPU), so this test
// compiles the generated source with the host C++ compiler against a small
// emulation of the CUDA execution model and compares the results with the
// CPU reference kernels (include/megaslide/runtime/cpu/Dsa3d.h). The emulation is the tests'
// shared one (support/CudaEmulation.h: threads are fibers scheduled
// cooperatively; __syncthreads and warp collectives are rendezvous of the
// fibers of a block or warp); this test adds the collectives of the
// kernels' inline PTX (mma.sync m16n8k16, ldmatrix), with the PTX ISA's
// fragment layouts written out independently of the kernels. What this
// checks: tile/window geometry, chunking and masking, online softmax, the
// backward's work split and atomics, offset estimation, fragment indexing.
// What it cannot: timing, races of real asynchronous copies, or the
// hardware's own reading of the PTX (that needs a GPU:
// scripts/device-check.sh).
//
// Skips when no host C++ compiler ($CXX or c++) can build the emulation.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Target/Cuda/DsaKernels.h"
#include "megaslide/Testing/CudaEmulation.h"
#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cuda/Nvrtc.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <tuple>

#include <dlfcn.h>
#include <unistd.h>

using namespace megaslide;
namespace fs = std::filesystem;

namespace {

/// Replaces the kernels' inline-PTX primitives (inserted where they are).
constexpr const char *kPrimitives = R"emu(
inline float toFloat(elem_t v) {
#if DSA_BF16
  return __uint_as_float(static_cast<unsigned>(v) << 16);
#else
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
#endif
}
inline elem_t toElem(float f) {
#if DSA_BF16
  unsigned u = __float_as_uint(f);
  u += 0x7fff + ((u >> 16) & 1); // round to nearest even
  return (elem_t)(u >> 16);
#else
  _Float16 h = (_Float16)f;
  elem_t v;
  std::memcpy(&v, &h, 2);
  return v;
#endif
}
inline unsigned pack2(float lo, float hi) {
  return toElem(lo) | (unsigned(toElem(hi)) << 16);
}

inline void mma16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
  emu::mma16816<toFloat>(c, a, b0, b1);
}

inline unsigned smemAddr(const void *p) {
  if (!emu::inSmem(p, 0, "smemAddr"))
    emu::fail("smemAddr of a pointer outside shared memory");
  return unsigned(static_cast<const unsigned char *>(p) - emu::g_smem);
}

/// ldmatrix on an address in the emulated shared memory.
template <bool Trans> inline void ldsm(unsigned r[4], unsigned addr) {
  emu::ldsm<Trans>(r, emu::g_smem + addr);
}
inline void ldsm4(unsigned r[4], unsigned addr) { ldsm<false>(r, addr); }
inline void ldsm4T(unsigned r[4], unsigned addr) { ldsm<true>(r, addr); }

inline void cpAsync16(void *dst, const void *src, int bytes) {
  smemAddr(dst);
  emu::cpAsync16(dst, src, bytes);
}
inline void cpAsync4(void *dst, const void *src) {
  smemAddr(dst);
  emu::cpAsync(dst, src, 4, 4);
}
inline void cpAsyncCommit() {}
template <int Pending> inline void cpAsyncWait() {}
inline float infinity() { return INFINITY; }
inline float fastExp2(float x) { return std::exp2(x); }
)emu";

/// Appended: C entry points launching each kernel over its whole grid with
/// `smem` bytes of dynamic shared memory (the plan's, unless a test says
/// otherwise).
constexpr const char *kLaunchers = R"emu(
#define EMU_ENTRY extern "C" __attribute__((visibility("default"))) void
#define EMU_STR2(x) #x
#define EMU_STR(x) EMU_STR2(x)
EMU_ENTRY emuForward(size_t smem, int batch, const elem_t *q, const elem_t *k,
                     const elem_t *v, const int *offsets, elem_t *out,
                     float *lse, float scale) {
  emu::launch(EMU_STR(DSA_FWD_NAME),
              {unsigned(NTILES * FWD_QBLOCKS), unsigned(H), unsigned(batch)},
              FWD_THREADS, smem,
              [&] { DSA_FWD_NAME(q, k, v, offsets, out, lse, scale); });
}
EMU_ENTRY emuBackward(size_t smem, int batch, const elem_t *q, const elem_t *k,
                      const elem_t *v, const int *offsets, const elem_t *o,
                      const elem_t *dout, const float *lse, elem_t *dq,
                      float *delta, float scale) {
  emu::launch(EMU_STR(DSA_BWD_NAME),
              {unsigned(NTILES * BWD_QBLOCKS), unsigned(H), unsigned(batch)},
              BWD_THREADS, smem, [&] {
                DSA_BWD_NAME(q, k, v, offsets, o, dout, lse, dq, delta, scale);
              });
}
/// The dK/dV kernel over its whole grid, or (`block` >= 0) over the one
/// block (block, 0, 0): the 105B subset.
EMU_ENTRY emuBackwardKeys(size_t smem, int batch, int block, const elem_t *q,
                          const elem_t *k, const elem_t *v, const int *offsets,
                          const elem_t *dout, const float *lse,
                          const float *delta, elem_t *dk, elem_t *dv,
                          float scale) {
  auto run = [&] {
    DSA_BWD_KEYS_NAME(q, k, v, offsets, dout, lse, delta, dk, dv, scale);
  };
  if (block >= 0) {
    emu::launch(EMU_STR(DSA_BWD_KEYS_NAME), {1, 1, 1}, BKV_THREADS, smem, [&] {
      emu::gBlockIdx = {unsigned(block), 0, 0};
      run();
    });
    return;
  }
  emu::launch(EMU_STR(DSA_BWD_KEYS_NAME),
              {unsigned(NTILES * BKV_KBLOCKS), unsigned(H), unsigned(batch)},
              BKV_THREADS, smem, run);
}
EMU_ENTRY emuOffsets(size_t smem, int batch, const elem_t *q, const elem_t *k,
                     int *offsets) {
  emu::launch(EMU_STR(DSA_OFFSETS_NAME),
              {unsigned(NTILES), unsigned(H), unsigned(batch)}, OFF_THREADS,
              smem, [&] { DSA_OFFSETS_NAME(q, k, offsets); });
}
)emu";

/// Builds the emulation of one configuration into a shared library.
void *buildEmulation(const cuda::DsaConfig &config, const fs::path &dir,
                     std::string &why, cuda::DsaKernelPlan &plan) {
  std::string error;
  if (!cuda::planDsaKernels(config, plan, error)) {
    why = error;
    return nullptr;
  }
  std::string source = cuda::emitDsaKernelSource(config, plan);
  auto replace = [&](const std::string &from, const std::string &to) {
    size_t at = source.find(from);
    if (at == std::string::npos)
      return false;
    source.replace(at, from.size(), to);
    return true;
  };
  // Dynamic shared memory is the emulator's buffer; the primitives go
  // where the PTX versions are compiled out. Both occur in every kernel
  // using them, so replace all.
  while (replace("extern __shared__ __align__(16) unsigned char smem[];",
                 "unsigned char *smem = emu::g_smem;"))
    ;
  if (!replace("#ifndef DSA_HOST_EMULATION",
               std::string(kPrimitives) + "\n#ifndef DSA_HOST_EMULATION")) {
    why = "no primitives marker in the generated source";
    return nullptr;
  }
  // DSA_HOST_EMULATION compiles the PTX primitives out.
  return test::buildHostLibrary(std::string(test::kCudaEmulationPrelude) +
                                    "#define DSA_HOST_EMULATION 1\n" + source +
                                    kLaunchers,
                                dir, cuda::configName(config), why);
}

using elem_t = uint16_t;

/// A fresh directory for an emulation's sources, removed with it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern =
        (fs::temp_directory_path() / "megaslide-emu-XXXXXX").string();
    if (mkdtemp(pattern.data()))
      path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Whether `why` (a failed build) is for want of a host compiler.
bool noHostCompiler(const std::string &why) {
  return why.find("host compiler failed") != std::string::npos &&
         std::system(
             (test::hostCompiler() + " --version > /dev/null 2>&1").c_str());
}

/// One configuration's emulation: its plan and library, failures
/// recovered (a failing launch ends and failure() says why).
struct Emulation {
  TempDir dir;
  cuda::DsaKernelPlan plan;
  void *lib = nullptr;
  std::string why;
  Emulation(const cuda::DsaConfig &config) {
    if (dir.path.empty())
      why = "cannot make a temporary directory";
    else if ((lib = buildEmulation(config, dir.path, why, plan)))
      reinterpret_cast<void (*)(int)>(dlsym(lib, "emuRecoverFailures"))(1);
  }
  ~Emulation() {
    if (lib)
      dlclose(lib);
  }
  template <typename Fn> Fn entry(const char *name) {
    return reinterpret_cast<Fn>(dlsym(lib, name));
  }
  /// The last launch's failure, "" if none.
  std::string failure() { return entry<const char *(*)()>("emuFailure")(); }
};

float toFloat(elem_t v, bool bf16) {
  if (bf16) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return float(h);
}

elem_t toElem(float f, bool bf16) {
  if (bf16) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return elem_t(u >> 16);
  }
  _Float16 h = _Float16(f);
  elem_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

/// A buffer with canaries on both sides to catch out-of-bounds writes.
template <typename T> struct Guarded {
  static constexpr size_t kPad = 64;
  std::vector<T> storage;
  size_t size;
  explicit Guarded(size_t n, T fill = T()) : storage(n + 2 * kPad), size(n) {
    std::memset(storage.data(), 0x5a, storage.size() * sizeof(T));
    std::fill(data(), data() + n, fill);
  }
  T *data() { return storage.data() + kPad; }
  T &operator[](size_t i) { return data()[i]; }
  bool intact() const {
    const unsigned char *p =
        reinterpret_cast<const unsigned char *>(storage.data());
    size_t pad = kPad * sizeof(T), total = storage.size() * sizeof(T);
    for (size_t i = 0; i < pad; ++i)
      if (p[i] != 0x5a || p[total - 1 - i] != 0x5a)
        return false;
    return true;
  }
};

struct Case {
  const char *name;
  std::array<int64_t, 3> grid, window, tile;
  int64_t heads, headDim;
  const char *elem;
  int64_t radius;
  int batch;
  bool beyondRadius = false; ///< displacements up to R + 2, not R
};

void PrintTo(const Case &c, std::ostream *os) { *os << c.name; }

/// The dynamic shared memory the plan gives kernel `kind`.
size_t dynamicShared(const cuda::DsaKernelPlan &plan,
                     cuda::DsaKernelKind kind) {
  for (const cuda::DsaLaunch &l : plan.launches)
    if (l.kind == kind)
      return size_t(l.dynamicSharedBytes);
  ADD_FAILURE() << "no launch of kind " << cuda::kindName(kind).str();
  return 0;
}

using BwdKeys = void (*)(size_t, int, int, const elem_t *, const elem_t *,
                         const elem_t *, const int *, const elem_t *,
                         const float *, const float *, elem_t *, elem_t *,
                         float);

class DsaKernelEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(DsaKernelEmulation, MatchesTheCpuReference) {
  const Case &tc = GetParam();
  cuda::DsaConfig config;
  config.grid = tc.grid;
  config.window = tc.window;
  config.tile = tc.tile;
  config.heads = tc.heads;
  config.headDim = tc.headDim;
  config.elementType = tc.elem;
  config.radius = tc.radius;
  const bool bf16 = config.elementType == "bf16";

  Emulation emu(config);
  if (!emu.lib && noHostCompiler(emu.why))
    GTEST_SKIP() << "no host C++ compiler: " << emu.why;
  ASSERT_TRUE(emu.lib) << emu.why;
  const cuda::DsaKernelPlan &plan = emu.plan;

  using Fwd = void (*)(size_t, int, const elem_t *, const elem_t *,
                       const elem_t *, const int *, elem_t *, float *, float);
  using Bwd = void (*)(size_t, int, const elem_t *, const elem_t *,
                       const elem_t *, const int *, const elem_t *,
                       const elem_t *, const float *, elem_t *, float *, float);
  using Off = void (*)(size_t, int, const elem_t *, const elem_t *, int *);
  using Kind = cuda::DsaKernelKind;
  auto fwd = emu.entry<Fwd>("emuForward");
  auto bwd = emu.entry<Bwd>("emuBackward");
  auto keys = emu.entry<BwdKeys>("emuBackwardKeys");
  auto off = emu.entry<Off>("emuOffsets");
  ASSERT_TRUE(fwd && bwd && keys && off);

  cpu::Dsa3dConfig cfg;
  cfg.batch = tc.batch;
  cfg.heads = tc.heads;
  cfg.T = tc.grid[0];
  cfg.Y = tc.grid[1];
  cfg.X = tc.grid[2];
  cfg.headDim = tc.headDim;
  cfg.window = tc.window;
  cfg.tile = tc.tile;
  cfg.scale = 1.0 / std::sqrt(double(tc.headDim));
  ASSERT_EQ(cfg.validate(), "");
  const size_t n = size_t(cfg.batch) * cfg.tokens() * cfg.heads * cfg.headDim;
  const size_t lseSize = size_t(cfg.batch) * cfg.heads * cfg.tokens();

  // Inputs in the element type; the reference sees the same values.
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  auto input = [&] {
    std::pair<Guarded<elem_t>, std::vector<float>> x{Guarded<elem_t>(n),
                                                     std::vector<float>(n)};
    for (size_t i = 0; i < n; ++i) {
      x.first[i] = toElem(normal(rng), bf16);
      x.second[i] = toFloat(x.first[i], bf16);
    }
    return x;
  };
  auto [q, qf] = input();
  auto [k, kf] = input();
  auto [v, vf] = input();
  auto [dout, doutf] = input();
  auto view = [&](const std::vector<float> &x) {
    return cpu::dsa3dGraphLayout(x.data(), cfg);
  };

  // Offsets: the emulated estimate must equal the reference's.
  Guarded<int32_t> offsets(cfg.offsetsSize(), -99);
  std::vector<int32_t> offsetsRef(cfg.offsetsSize());
  off(dynamicShared(plan, Kind::Offsets), tc.batch, q.data(), k.data(),
      offsets.data());
  ASSERT_EQ(emu.failure(), "");
  cpu::dsa3dOffsets(cfg, view(qf), view(kf), tc.radius, offsetsRef.data());
  EXPECT_TRUE(offsets.intact());
  size_t offsetMismatches = 0;
  for (size_t i = 0; i < offsetsRef.size(); ++i)
    offsetMismatches += offsets[i] != offsetsRef[i];
  EXPECT_EQ(offsetMismatches, 0u) << "of " << offsetsRef.size();

  // Random displacements exercise the clamping and the dK/dV kernel's
  // inverse tile neighbourhood (windows shifted by up to R across tile
  // borders and against the grid's edges); displacements beyond the
  // radius, its fallback to every query tile.
  const int reach = tc.beyondRadius ? int(tc.radius) + 2 : int(tc.radius);
  std::uniform_int_distribution<int> shift(-reach, reach);
  for (size_t i = 0; i < offsetsRef.size(); ++i)
    offsets[i] = offsetsRef[i] = shift(rng);

  const float scale = float(cfg.scale);
  Guarded<elem_t> out(n);
  Guarded<float> lse(lseSize);
  fwd(dynamicShared(plan, Kind::Forward), tc.batch, q.data(), k.data(),
      v.data(), offsets.data(), out.data(), lse.data(), scale);
  ASSERT_EQ(emu.failure(), "");
  std::vector<float> outRef(n), lseRef(lseSize);
  cpu::dsa3dForward(cfg, view(qf), view(kf), view(vf), offsetsRef.data(),
                    cpu::dsa3dGraphLayout(outRef.data(), cfg), lseRef.data());
  EXPECT_TRUE(out.intact() && lse.intact());

  const float tol = 2e-2f;
  auto expectClose = [&](const char *what, auto got,
                         const std::vector<float> &want, float atol) {
    size_t bad = 0, worst = 0;
    float worstErr = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      float err = std::fabs(got(i) - want[i]);
      if (!(err <= atol + tol * std::fabs(want[i])))
        ++bad;
      if (!(err <= worstErr)) {
        worstErr = err;
        worst = i;
      }
    }
    EXPECT_EQ(bad, 0u) << what << ": worst error " << worstErr << " at "
                       << worst << " (got " << got(worst) << ", want "
                       << want[worst] << ")";
  };
  auto maxAbs = [](const std::vector<float> &x) {
    float m = 0;
    for (float f : x)
      m = std::max(m, std::fabs(f));
    return m;
  };
  expectClose(
      "out", [&](size_t i) { return toFloat(out[i], bf16); }, outRef, tol);
  expectClose(
      "lse", [&](size_t i) { return lse[i]; }, lseRef, 1e-3f);

  // dK and dV start as NaN: the key kernel must write every element.
  Guarded<elem_t> dq(n), dk(n, 0xffff), dv(n, 0xffff);
  Guarded<float> delta(lseSize, NAN);
  bwd(dynamicShared(plan, Kind::Backward), tc.batch, q.data(), k.data(),
      v.data(), offsets.data(), out.data(), dout.data(), lse.data(), dq.data(),
      delta.data(), scale);
  ASSERT_EQ(emu.failure(), "");
  keys(dynamicShared(plan, Kind::BackwardKeys), tc.batch, -1, q.data(),
       k.data(), v.data(), offsets.data(), dout.data(), lse.data(),
       delta.data(), dk.data(), dv.data(), scale);
  ASSERT_EQ(emu.failure(), "");
  EXPECT_TRUE(dq.intact() && dk.intact() && dv.intact() && delta.intact());
  std::vector<float> dqRef(n), dkRef(n), dvRef(n);
  cpu::dsa3dBackward(cfg, view(qf), view(kf), view(vf), offsetsRef.data(),
                     view(outRef), view(doutf), lseRef.data(),
                     cpu::dsa3dGraphLayout(dqRef.data(), cfg),
                     cpu::dsa3dGraphLayout(dkRef.data(), cfg),
                     cpu::dsa3dGraphLayout(dvRef.data(), cfg));
  expectClose(
      "dq", [&](size_t i) { return toFloat(dq[i], bf16); }, dqRef,
      tol * maxAbs(dqRef));
  expectClose(
      "dk", [&](size_t i) { return toFloat(dk[i], bf16); }, dkRef,
      tol * maxAbs(dkRef));
  expectClose(
      "dv", [&](size_t i) { return toFloat(dv[i], bf16); }, dvRef,
      tol * maxAbs(dvRef));
}

// The dK/dV kernel of the 105B configuration (grid (21, 45, 80), window
// (9, 15, 24), tile (3, 5, 8), D 128, R 4: 630 key tiles, up to 4 x 5 x 5
// candidate query tiles each, 128-query chunks in two stages), emulated for
// a subset: one head (H only strides the tensors; the kernel's plan does not
// depend on it) and 4 key tiles, the two grid corners, one on the y = 0 edge
// and one inside, against sums written from the definition (every query
// tile whose window holds the key). Windows are displaced by random offsets
// in [-4, 4]. lse and Delta are inputs of the kernel, so they are drawn at
// random too (the full 105B forward is out of reach of the emulation); the
// gradient formulas hold for any values.
TEST(DsaKernelEmulation105B, KeyTilesMatchTheDefinition) {
  cuda::DsaConfig config;
  config.grid = {21, 45, 80};
  config.window = {9, 15, 24};
  config.tile = {3, 5, 8};
  config.heads = 1;
  config.headDim = 128;
  config.elementType = "bf16";
  config.radius = 4;
  Emulation emu(config);
  if (!emu.lib && noHostCompiler(emu.why))
    GTEST_SKIP() << "no host C++ compiler: " << emu.why;
  ASSERT_TRUE(emu.lib) << emu.why;
  auto keys = emu.entry<BwdKeys>("emuBackwardKeys");
  ASSERT_TRUE(keys);

  const int T = 21, Y = 45, X = 80, D = 128;
  const int KT = 9, KY = 15, KX = 24, TT = 3, TY = 5, TX = 8;
  const int NT = 7, NY = 9, NX = 10, N = T * Y * X;
  const size_t n = size_t(N) * D;
  std::mt19937 rng(105);
  std::normal_distribution<float> normal;
  auto input = [&] {
    std::pair<std::vector<elem_t>, std::vector<float>> x{std::vector<elem_t>(n),
                                                         std::vector<float>(n)};
    for (size_t i = 0; i < n; ++i) {
      x.first[i] = toElem(normal(rng), true);
      x.second[i] = toFloat(x.first[i], true);
    }
    return x;
  };
  auto qIn = input();
  std::vector<elem_t> &q = qIn.first;
  std::vector<float> &qf = qIn.second;
  auto kIn = input();
  std::vector<elem_t> &k = kIn.first;
  std::vector<float> &kf = kIn.second;
  auto vIn = input();
  std::vector<elem_t> &v = vIn.first;
  std::vector<float> &vf = vIn.second;
  auto doutIn = input();
  std::vector<elem_t> &dout = doutIn.first;
  std::vector<float> &doutf = doutIn.second;
  std::vector<float> lse(N), delta(N);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (int i = 0; i < N; ++i) {
    lse[i] = 6.f + unit(rng);
    delta[i] = 0.1f * normal(rng);
  }
  std::vector<int32_t> offsets(size_t(NT) * NY * NX * KT * 2);
  std::uniform_int_distribution<int> shift(-4, 4);
  for (int32_t &o : offsets)
    o = shift(rng);
  const float scale = 1.f / std::sqrt(float(D));

  // The definition: tile centres, clamped and displaced windows.
  auto centre = [](int i, int t, int g) {
    int first = i * t, count = std::min(t, g - first);
    return (2 * first + count - 1) / 2;
  };
  auto clampTo = [](int v, int lo, int hi) {
    return std::max(lo, std::min(v, hi));
  };
  auto inWindow = [&](int tile, int key) {
    int it = tile / (NY * NX), iy = tile / NX % NY, ix = tile % NX;
    int t = key / (Y * X), y = key / X % Y, x = key % X;
    int st = clampTo(centre(it, TT, T) - KT / 2, 0, T - KT);
    int j = t - st;
    if (j < 0 || j >= KT)
      return false;
    const int32_t *off = &offsets[(size_t(tile) * KT + j) * 2];
    int sy = clampTo(centre(iy, TY, Y) + off[0] - KY / 2, 0, Y - KY);
    int sx = clampTo(centre(ix, TX, X) + off[1] - KX / 2, 0, X - KX);
    return y >= sy && y < sy + KY && x >= sx && x < sx + KX;
  };
  auto forQueries = [&](int tile, auto fn) {
    int it = tile / (NY * NX), iy = tile / NX % NY, ix = tile % NX;
    for (int t = it * TT; t < std::min(T, it * TT + TT); ++t)
      for (int y = iy * TY; y < std::min(Y, iy * TY + TY); ++y)
        for (int x = ix * TX; x < std::min(X, ix * TX + TX); ++x)
          fn((t * Y + y) * X + x);
  };

  std::vector<elem_t> dk(n, 0xffff), dv(n, 0xffff);
  const int keyTiles[] = {0, NT * NY * NX - 1, (3 * NY + 0) * NX + 4,
                          (3 * NY + 4) * NX + 5};
  for (int kt : keyTiles) {
    keys(dynamicShared(emu.plan, cuda::DsaKernelKind::BackwardKeys), 1, kt,
         q.data(), k.data(), v.data(), offsets.data(), dout.data(), lse.data(),
         delta.data(), dk.data(), dv.data(), scale);
    ASSERT_EQ(emu.failure(), "") << "key tile " << kt;
    std::vector<float> dkRef, dvRef, dkGot, dvGot;
    size_t reached = 0;
    forQueries(kt, [&](int key) {
      std::vector<double> gk(D, 0.0), gv(D, 0.0);
      for (int tile = 0; tile < NT * NY * NX; ++tile) {
        if (!inWindow(tile, key))
          continue;
        ++reached;
        forQueries(tile, [&](int m) {
          double s = 0, dp = 0;
          for (int d = 0; d < D; ++d) {
            s += double(qf[size_t(m) * D + d]) * kf[size_t(key) * D + d];
            dp += double(doutf[size_t(m) * D + d]) * vf[size_t(key) * D + d];
          }
          double p = std::exp(scale * s - lse[m]);
          double ds = p * (dp - delta[m]);
          for (int d = 0; d < D; ++d) {
            gv[d] += p * doutf[size_t(m) * D + d];
            gk[d] += scale * ds * qf[size_t(m) * D + d];
          }
        });
      }
      for (int d = 0; d < D; ++d) {
        dkRef.push_back(float(gk[d]));
        dvRef.push_back(float(gv[d]));
        dkGot.push_back(toFloat(dk[size_t(key) * D + d], true));
        dvGot.push_back(toFloat(dv[size_t(key) * D + d], true));
      }
    });
    EXPECT_GT(reached, 0u) << "key tile " << kt;
    for (auto [what, got, want] :
         {std::tuple{"dk", &dkGot, &dkRef}, std::tuple{"dv", &dvGot, &dvRef}}) {
      float big = 0;
      for (float w : *want)
        big = std::max(big, std::fabs(w));
      size_t bad = 0;
      float worst = 0;
      for (size_t i = 0; i < want->size(); ++i) {
        float err = std::fabs((*got)[i] - (*want)[i]);
        bad += !(err <= 2e-2f * big + 2e-2f * std::fabs((*want)[i]));
        worst = std::max(worst, err);
      }
      EXPECT_EQ(bad, 0u) << what << " of key tile " << kt << ": worst error "
                         << worst << " (largest value " << big << ")";
    }
  }
}

// The emulation's bound on dynamic shared memory is the launch's size to
// the byte: the allocation ends at a PROT_NONE page, so a read or write
// past a size that is a multiple of 16 faults at once; for other sizes the
// bytes up to the next 16 hold a canary that a write changes (a read of
// them goes unseen). Both failures name the kernel and the byte, and end
// the launch (recovered) or the process. __syncthreads_or and 4-byte
// cp.async are the emulation's too.
TEST(CudaEmulation, SharedMemoryEndsAtTheLaunchSize) {
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  std::string why;
  void *lib = test::buildHostLibrary(std::string(test::kCudaEmulationPrelude) +
                                         R"emu(
__global__ void probe(int at, bool write, int *out) {
  unsigned char *smem = emu::g_smem;
  if (threadIdx.x == 0) {
    if (write)
      smem[at] = 1;
    else
      *out = smem[at];
  }
  int any = __syncthreads_or(threadIdx.x == 33);
  int none = __syncthreads_or(0);
  if (threadIdx.x == 0)
    *out += 10 * any + 100 * none;
}
extern "C" __attribute__((visibility("default"))) void
emuProbe(size_t smem, int at, bool write, int *out) {
  emu::launch("probe", {2, 1, 1}, 64, smem, [&] { probe(at, write, out); });
}
extern "C" __attribute__((visibility("default"))) void
emuCopy(size_t smem, size_t dst, const float *src) {
  emu::launch("copy", {1, 1, 1}, 32, smem,
              [&] { emu::cpAsync(emu::g_smem + dst, src, 4, 4); });
}
)emu",
                                     dir.path, "probe", why);
  if (!lib && noHostCompiler(why))
    GTEST_SKIP() << "no host C++ compiler: " << why;
  ASSERT_TRUE(lib) << why;
  using Probe = void (*)(size_t, int, bool, int *);
  using Copy = void (*)(size_t, size_t, const float *);
  auto probe = reinterpret_cast<Probe>(dlsym(lib, "emuProbe"));
  auto copy = reinterpret_cast<Copy>(dlsym(lib, "emuCopy"));
  auto failure = reinterpret_cast<const char *(*)()>(dlsym(lib, "emuFailure"));
  auto recover =
      reinterpret_cast<void (*)(int)>(dlsym(lib, "emuRecoverFailures"));
  ASSERT_TRUE(probe && copy && failure && recover);

  // Without recovery a failure aborts, saying what it was.
  EXPECT_DEATH(
      {
        int out = 0;
        probe(64, 64, false, &out);
      },
      "emulation: probe: shared memory access at byte 64 of a 64-byte "
      "dynamic allocation \\(block 0,0,0\\)");

  recover(1);
  int out = 0;
  probe(64, 63, true, &out);
  EXPECT_STREQ(failure(), "");
  EXPECT_EQ(out, 2 * 10);
  // Each block starts with 0xff bytes: block 0's write is gone.
  probe(64, 63, false, &out);
  EXPECT_STREQ(failure(), "");
  EXPECT_EQ(out, 0xff + 10);
  probe(64, 64, false, &out);
  EXPECT_STREQ(failure(), "emulation: probe: shared memory access at byte 64 "
                          "of a 64-byte dynamic allocation (block 0,0,0)");
  probe(64, 64, true, &out);
  EXPECT_STREQ(failure(), "emulation: probe: shared memory access at byte 64 "
                          "of a 64-byte dynamic allocation (block 0,0,0)");
  probe(60, 60, true, &out);
  EXPECT_STREQ(failure(), "emulation: probe: shared memory write at byte 60 "
                          "of a 60-byte dynamic allocation (block 0,0,0)");
  probe(60, 59, true, &out);
  EXPECT_STREQ(failure(), "");

  alignas(16) float src[4] = {1, 2, 3, 4};
  copy(64, 60, src + 1);
  EXPECT_STREQ(failure(), "");
  copy(64, 62, src);
  EXPECT_STREQ(failure(),
               "emulation: copy: cp.async with a misaligned address");
  copy(60, 60, src);
  EXPECT_STREQ(failure(), "emulation: copy: cp.async destination at byte 60 "
                          "of a 60-byte dynamic shared allocation");
  dlclose(lib);
}

// The dK/dV kernel launched with 4 bytes less than the plan's dynamic
// shared memory fails on the last 4 bytes of its layout: the plan's size
// is the layout's, and the bound is its end, not a page's or a vector's.
// (Before the fix the plan was 4 bytes short of the layout, and
// DsaKernelEmulation failed with "shared memory write at byte <size>".)
TEST(DsaKernelSharedMemory, BackwardKeysNeedTheirWholeAllocation) {
  cuda::DsaConfig config;
  config.grid = {2, 4, 4};
  config.window = {2, 2, 2};
  config.tile = {1, 2, 2};
  config.heads = 1;
  config.headDim = 16;
  config.elementType = "bf16";
  config.radius = 1;
  Emulation emu(config);
  if (!emu.lib && noHostCompiler(emu.why))
    GTEST_SKIP() << "no host C++ compiler: " << emu.why;
  ASSERT_TRUE(emu.lib) << emu.why;
  auto keys = emu.entry<BwdKeys>("emuBackwardKeys");
  ASSERT_TRUE(keys);
  const size_t n = size_t(config.tokens()) * config.headDim;
  std::vector<elem_t> x(n, 0), dk(n), dv(n);
  std::vector<float> lse(config.tokens(), 0.f), delta(config.tokens(), 0.f);
  std::vector<int32_t> offsets(size_t(config.tiles()) * config.window[0] * 2);
  const size_t smem =
      dynamicShared(emu.plan, cuda::DsaKernelKind::BackwardKeys);
  for (size_t bytes : {smem, smem - 4}) {
    keys(bytes, 1, -1, x.data(), x.data(), x.data(), offsets.data(), x.data(),
         lse.data(), delta.data(), dk.data(), dv.data(), 1.f);
    std::string want =
        bytes == smem
            ? ""
            : "emulation: " +
                  cuda::kernelName(config, cuda::DsaKernelKind::BackwardKeys) +
                  ": shared memory " + (bytes % 16 ? "write" : "access") +
                  " at byte " + std::to_string(bytes) + " of a " +
                  std::to_string(bytes) +
                  "-byte dynamic allocation (block 0,0,0)";
    EXPECT_EQ(emu.failure(), want);
  }
}

/// The PTX of entry `name` in `ptx`, up to the next entry.
std::string ptxEntry(const std::string &ptx, const std::string &name) {
  size_t at = ptx.find(".entry " + name + "(");
  if (at == std::string::npos)
    return "";
  return ptx.substr(at, ptx.find(".entry ", at + 1) - at);
}

size_t occurrences(const std::string &text, const std::string &what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1))
    ++n;
  return n;
}

// The dK/dV kernel stages each chunk's lse and Delta with 4-byte cp.async
// in the rows' commit group, not with loads the CTA waits for at the
// barrier: its PTX has 4-byte cp.async and no fp32 global load at all (lse
// and Delta are its only fp32 inputs). One stage (tiny) and two (d128).
TEST(DsaKernelPtx, BackwardKeysStageLseAndDeltaWithCpAsync) {
  std::string why;
  if (!cuda::nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  for (auto [grid, window, tile, d, r] :
       {std::tuple<std::array<int64_t, 3>, std::array<int64_t, 3>,
                   std::array<int64_t, 3>, int64_t, int64_t>{
            {2, 4, 4}, {2, 2, 2}, {1, 2, 2}, 16, 1},
        {{3, 6, 8}, {3, 6, 8}, {2, 3, 4}, 128, 2}}) {
    cuda::DsaConfig config;
    config.grid = grid;
    config.window = window;
    config.tile = tile;
    config.heads = 1;
    config.headDim = d;
    config.elementType = "bf16";
    config.radius = r;
    SCOPED_TRACE(cuda::configName(config));
    cuda::DsaKernelPlan plan;
    std::string error;
    ASSERT_TRUE(cuda::planDsaKernels(config, plan, error)) << error;
    cuda::CompileResult result =
        cuda::compileCuda(cuda::emitDsaKernelSource(config, plan),
                          cuda::configName(config) + ".cu", "sm_90a");
    ASSERT_TRUE(result.ok()) << result.error;
    std::string keys =
        ptxEntry(result.ptx,
                 cuda::kernelName(config, cuda::DsaKernelKind::BackwardKeys));
    ASSERT_FALSE(keys.empty()) << result.ptx.substr(0, 2000);
    // One per call of the stage lambda: before the loop and in it.
    EXPECT_GE(occurrences(keys, "cp.async.ca.shared.global"), 2u);
    EXPECT_EQ(occurrences(keys, "cp.async.ca.shared.global"),
              occurrences(keys, "], 4;"));
    EXPECT_EQ(occurrences(keys, "ld.global.nc.f32"), 0u);
    EXPECT_EQ(occurrences(keys, "ld.global.f32"), 0u);
  }
}

// Small shapes (the emulation runs every thread as a fiber), chosen to
// cover what the kernels specialise on.
INSTANTIATE_TEST_SUITE_P(
    Configs, DsaKernelEmulation,
    ::testing::Values(
        // The tiny model's geometry, two samples: batch and head indexing.
        Case{"tiny_d16", {2, 4, 4}, {2, 2, 2}, {1, 2, 2}, 2, 16, "bf16", 1, 2},
        // Partial border tiles along every axis, one masked 32-key chunk, f16.
        Case{"borders_f16_d64",
             {3, 5, 6},
             {2, 3, 4},
             {2, 2, 4},
             1,
             64,
             "f16",
             1,
             1},
        // 144-key windows: two full 64-key chunks and a masked partial one
        // through two cp.async stages; 2 warps per CTA.
        Case{"chunks_d128",
             {3, 6, 8},
             {3, 6, 8},
             {2, 3, 4},
             1,
             128,
             "bf16",
             2,
             1},
        // 144-query tiles: two query blocks of 5 warps.
        Case{"qblocks_d32",
             {2, 8, 9},
             {2, 4, 4},
             {2, 8, 9},
             1,
             32,
             "bf16",
             1,
             1},
        // 32-key chunks (head dims 96 and 256); dK/dV in two column passes
        // of 128 (D = 256).
        Case{"d96", {2, 4, 4}, {2, 4, 4}, {2, 4, 4}, 1, 96, "bf16", 1, 1},
        Case{"d256", {2, 4, 4}, {2, 4, 4}, {2, 4, 4}, 1, 256, "bf16", 1, 1},
        // dK/dV in two column passes, the second partial (112 + 96).
        Case{"d208", {2, 4, 4}, {2, 4, 4}, {2, 4, 4}, 1, 208, "bf16", 1, 1},
        // 3 x 8 x 6 tiles of 1 x 2 x 2 with 4 x 4 windows displaced by up
        // to R = 3 across tile borders and clamped at the grid's edges:
        // each key tile's inverse neighbourhood is 6 of the 8 (y) or 6 (x)
        // tiles inside the grid, fewer at its edges, and the tiles at R
        // are needed: a bound for R - 1 loses gradient.
        Case{"shifted_r3_d16",
             {3, 16, 12},
             {2, 4, 4},
             {1, 2, 2},
             2,
             16,
             "bf16",
             3,
             1},
        // The same with displacements up to R + 2 (offsets not from this
        // configuration's estimator): every query tile is a candidate.
        Case{"beyond_radius_d32",
             {4, 12, 16},
             {2, 5, 6},
             {1, 3, 4},
             1,
             32,
             "bf16",
             2,
             1,
             true}),
    [](const ::testing::TestParamInfo<Case> &info) {
      return std::string(info.param.name);
    });

} // namespace
