//===- CudaEmulation.cpp - Generated CUDA C++ built for the host ----------===//

#include "megaslide/Testing/CudaEmulation.h"

#include <cstdlib>
#include <fstream>
#include <iterator>

#include <dlfcn.h>

namespace fs = std::filesystem;

// Fibers start on their own stack through makecontext; after that they
// switch with _setjmp/_longjmp, which (unlike swapcontext) makes no system
// call: every warp collective switches all 32 lanes. The jump is libc's
// own: in the sanitize build ASan interposes _longjmp to unpoison the
// thread's stack below the jump's target, and from a fiber's heap stack
// that range can be megabytes of shadow, rewritten with mmap at every
// switch (a fake-device test took 60 s instead of 1). Nothing here is
// instrumented, so there is nothing to unpoison. Warp collectives are
// double-buffered by parity, so a lane may be one collective ahead of the
// slowest reader of the previous one.
const char *const megaslide::test::kCudaEmulationPrelude = R"emu(
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __log2f(float x) { return std::log2(x); }
inline void atomicAdd(float2 *p, float2 v) { p->x += v.x; p->y += v.y; }

namespace emu {
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
inline Dim3 gBlockIdx, gBlockDim, gGridDim;
/// The most dynamic shared memory a launch may ask for.
constexpr size_t kSmemBytes = 256 * 1024;
/// The running launch's dynamic shared memory: g_smemBytes bytes at
/// g_smem, which is 16-byte aligned and ends where a PROT_NONE page begins
/// but for the 0-15 bytes rounding the size up to 16, which hold kCanary.
inline unsigned char *g_smem = nullptr;
inline size_t g_smemBytes = 0;
inline const char *g_kernel = "";
constexpr unsigned char kCanary = 0xa5;
constexpr size_t kStackBytes = 128 * 1024;

struct Slot { unsigned w[12]; };
struct Fiber {
  ucontext_t ctx;
  jmp_buf env;
  Dim3 idx;
  bool done = false, started = false;
  int parity = 0;
};
struct State {
  std::vector<Fiber> fibers;
  std::vector<std::vector<char>> stacks;
  ucontext_t scheduler;
  jmp_buf schedulerEnv;
  Fiber *current = nullptr;
  std::function<void()> kernel;
  int blockArrived = 0; long blockGeneration = 0;
  int blockOr = 0, blockResult[2] = {0, 0};
  std::vector<int> warpArrived; std::vector<long> warpGeneration;
  std::vector<Slot> in, out; // [warp][parity][lane]
  long progress = 0;
};
inline State &state() { static State s; return s; }
[[noreturn]] inline void jump(jmp_buf env) {
  using Jump = void (*)(jmp_buf, int);
  static const Jump libc = [] {
    void *so = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *fn = so ? dlsym(so, "_longjmp") : nullptr;
    return fn ? reinterpret_cast<Jump>(fn) : &_longjmp;
  }();
  libc(env, 1);
  __builtin_unreachable();
}
/// Failures abort unless the library's user asked, through
/// emuRecoverFailures, for them to end the launch and be read back with
/// emuFailure.
inline bool g_recover = false, g_inLaunch = false;
inline char g_failure[512];
inline sigjmp_buf g_failEnv;
[[noreturn]] inline void fail(const char *what) {
  std::snprintf(g_failure, sizeof g_failure, "emulation: %s: %s", g_kernel, what);
  if (g_recover && g_inLaunch) {
    // libc's own, like jump's: a fiber's stack is not below the target's,
    // which fortified longjmp takes for a corrupt jump.
    using Jump = void (*)(sigjmp_buf, int);
    void *so = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *fn = so ? dlsym(so, "siglongjmp") : nullptr;
    (fn ? reinterpret_cast<Jump>(fn) : &siglongjmp)(g_failEnv, 1);
  }
  std::fprintf(stderr, "%s\n", g_failure);
  std::abort();
}
inline void yield() {
  State &s = state();
  if (!_setjmp(s.current->env)) jump(s.schedulerEnv);
}

/// __syncthreads_or: returns whether `pred` was nonzero in any thread. The
/// result is kept by the generation's parity: the last to arrive may reach
/// the next barrier before the others have read it.
inline int blockBarrier(int pred = 0) {
  State &s = state();
  long gen = s.blockGeneration;
  ++s.progress;
  s.blockOr |= pred != 0;
  if (++s.blockArrived == (int)gBlockDim.x) {
    s.blockResult[gen & 1] = s.blockOr;
    s.blockOr = 0;
    s.blockArrived = 0;
    ++s.blockGeneration;
    return s.blockResult[gen & 1];
  }
  while (s.blockGeneration == gen) yield();
  return s.blockResult[gen & 1];
}

/// The page past the dynamic shared memory, PROT_NONE; the arena before
/// it holds the largest allocation.
inline unsigned char *guardPage() {
  static unsigned char *guard = [] {
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t arena = (kSmemBytes + 16 + page - 1) / page * page;
    void *p = mmap(nullptr, arena + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("cannot map the shared memory arena");
    unsigned char *g = static_cast<unsigned char *>(p) + arena;
    if (mprotect(g, page, PROT_NONE)) fail("cannot protect the guard page");
    return g;
  }();
  return guard;
}

/// A fault on the guard page is an access past the dynamic shared memory:
/// names the kernel and the byte; any other fault goes to the handler
/// before ours (installed while a launch runs), which sees it again.
inline struct sigaction gPreviousSegv;
inline void onSegv(int sig, siginfo_t *info, void *) {
  unsigned char *at = static_cast<unsigned char *>(info->si_addr);
  unsigned char *guard = guardPage();
  if (at >= guard && at < guard + sysconf(_SC_PAGESIZE)) {
    char what[160];
    std::snprintf(what, sizeof what,
                  "shared memory access at byte %zu of a %zu-byte dynamic "
                  "allocation (block %u,%u,%u)",
                  size_t(at - g_smem), g_smemBytes, gBlockIdx.x, gBlockIdx.y,
                  gBlockIdx.z);
    fail(what);
  }
  sigaction(sig, &gPreviousSegv, nullptr);
}

/// Every lane of the current warp deposits `mine`; the last to arrive maps
/// the 32 slots to the 32 results with `all`; each lane gets its own.
inline Slot collective(const Slot &mine, void (*all)(const Slot *, Slot *)) {
  State &s = state();
  Fiber *me = s.current;
  unsigned w = me->idx.x / 32, lane = me->idx.x % 32;
  size_t base = (size_t(w) * 2 + me->parity) * 32;
  me->parity ^= 1;
  s.in[base + lane] = mine;
  long gen = s.warpGeneration[w];
  ++s.progress;
  if (++s.warpArrived[w] == 32) {
    all(&s.in[base], &s.out[base]);
    s.warpArrived[w] = 0;
    ++s.warpGeneration[w];
  } else {
    while (s.warpGeneration[w] == gen) yield();
  }
  return s.out[base + lane];
}

inline void entry() {
  State &s = state();
  s.kernel();
  s.current->done = true;
  ++s.progress;
  jump(s.schedulerEnv);
}

/// Runs kernel `name` over `grid` with `threads` threads a block and
/// `dynamicShared` bytes of dynamic shared memory (g_smem); an access past
/// them aborts, naming the kernel: at once from the guard page, after the
/// block for a write to the bytes rounding the size up to 16.
inline void launch(const char *name, Dim3 grid, unsigned threads,
                   size_t dynamicShared, std::function<void()> kernel) {
  State &s = state();
  g_kernel = name;
  g_failure[0] = 0;
  unsigned char *guard = guardPage();
  struct sigaction ours = {};
  ours.sa_sigaction = onSegv;
  ours.sa_flags = SA_SIGINFO;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGSEGV, &ours, &gPreviousSegv);
  if (sigsetjmp(g_failEnv, 1)) {
    g_inLaunch = false;
    sigaction(SIGSEGV, &gPreviousSegv, nullptr);
    return;
  }
  g_inLaunch = true;
  if (dynamicShared > kSmemBytes) fail("dynamic shared memory above the emulator's 256 KiB");
  size_t rounded = (dynamicShared + 15) / 16 * 16;
  g_smem = guard - rounded;
  g_smemBytes = dynamicShared;
  gGridDim = grid;
  gBlockDim = {threads, 1, 1};
  s.kernel = std::move(kernel);
  s.blockOr = 0;
  if (s.stacks.size() < threads) s.stacks.resize(threads, std::vector<char>(kStackBytes));
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        gBlockIdx = {x, y, z};
        // Uninitialised shared memory reads as NaN (0xffff in 16 bits).
        std::memset(g_smem, 0xff, dynamicShared);
        std::memset(g_smem + dynamicShared, kCanary, rounded - dynamicShared);
        unsigned warps = (threads + 31) / 32;
        s.fibers.assign(threads, Fiber());
        s.warpArrived.assign(warps, 0);
        s.warpGeneration.assign(warps, 0);
        s.in.assign(size_t(warps) * 64, Slot());
        s.out.assign(size_t(warps) * 64, Slot());
        s.blockArrived = 0;
        for (unsigned t = 0; t < threads; ++t) {
          Fiber &f = s.fibers[t];
          f.idx = {t, 0, 0};
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = s.stacks[t].data();
          f.ctx.uc_stack.ss_size = s.stacks[t].size();
          f.ctx.uc_link = &s.scheduler;
          makecontext(&f.ctx, entry, 0);
        }
        for (;;) {
          bool live = false;
          long before = s.progress;
          for (Fiber &f : s.fibers) {
            if (f.done) continue;
            live = true;
            s.current = &f;
            if (!_setjmp(s.schedulerEnv)) {
              if (f.started) jump(f.env);
              f.started = true;
              swapcontext(&s.scheduler, &f.ctx);
            }
          }
          if (!live) break;
          if (s.progress == before) fail("deadlock: no thread made progress");
        }
        for (size_t i = dynamicShared; i < rounded; ++i)
          if (g_smem[i] != kCanary) {
            char what[160];
            std::snprintf(what, sizeof what,
                          "shared memory write at byte %zu of a %zu-byte "
                          "dynamic allocation (block %u,%u,%u)",
                          i, dynamicShared, x, y, z);
            fail(what);
          }
      }
  g_inLaunch = false;
  sigaction(SIGSEGV, &gPreviousSegv, nullptr);
}

/// Whether [p, p + bytes) lies in the running launch's dynamic shared
/// memory; fails naming `what` when it starts there and runs past it.
inline bool inSmem(const void *p, size_t bytes, const char *what) {
  const unsigned char *b = static_cast<const unsigned char *>(p);
  unsigned char *guard = guardPage();
  if (b < guard - kSmemBytes - 16 || b >= guard) return false;
  if (b < g_smem || b + bytes > g_smem + g_smemBytes) {
    char msg[192];
    std::snprintf(msg, sizeof msg,
                  "%s at byte %td of a %zu-byte dynamic shared allocation",
                  what, b - g_smem, g_smemBytes);
    fail(msg);
  }
  return true;
}
} // namespace emu

/// The last launch's failure ("" if none); with recovery on, a failure ends
/// its launch instead of aborting.
extern "C" __attribute__((visibility("default"))) const char *emuFailure() {
  return emu::g_failure;
}
extern "C" __attribute__((visibility("default"))) void emuRecoverFailures(int on) {
  emu::g_recover = on != 0;
}

#define threadIdx (emu::state().current->idx)
#define blockIdx (emu::gBlockIdx)
#define blockDim (emu::gBlockDim)
#define gridDim (emu::gGridDim)

inline void __syncthreads() { emu::blockBarrier(); }
inline int __syncthreads_or(int pred) { return emu::blockBarrier(pred); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  emu::Slot in{};
  in.w[0] = __float_as_uint(v);
  in.w[1] = unsigned(mask);
  emu::Slot out = emu::collective(in, [](const emu::Slot *all, emu::Slot *res) {
    for (int l = 0; l < 32; ++l)
      res[l].w[0] = all[l ^ all[l].w[1]].w[0];
  });
  return __uint_as_float(out.w[0]);
}
inline int __shfl_xor_sync(unsigned m, int v, int mask) {
  return (int)__float_as_uint(__shfl_xor_sync(m, __int_as_float(v), mask));
}

namespace emu {
/// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: lane = 4 g + c holds
/// A (row g|g+8, cols 2c..2c+1 | 2c+8..2c+9) in a0..a3, B (rows 2c..2c+1 |
/// 2c+8..2c+9, col g) in b0, b1 and C/D (row g|g+8, cols 2c, 2c+1);
/// `Decode` reads one 16-bit element.
template <float (*Decode)(unsigned short)>
inline void mma16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
  Slot in{};
  for (int i = 0; i < 4; ++i) {
    in.w[i] = a[i];
    in.w[6 + i] = __float_as_uint(c[i]);
  }
  in.w[4] = b0;
  in.w[5] = b1;
  Slot out = collective(in, [](const Slot *all, Slot *res) {
    auto lo = [](unsigned x) { return Decode((unsigned short)(x & 0xffff)); };
    auto hi = [](unsigned x) { return Decode((unsigned short)(x >> 16)); };
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      int g = l / 4, c2 = 2 * (l % 4);
      const unsigned *w = all[l].w;
      A[g][c2] = lo(w[0]);     A[g][c2 + 1] = hi(w[0]);
      A[g + 8][c2] = lo(w[1]); A[g + 8][c2 + 1] = hi(w[1]);
      A[g][c2 + 8] = lo(w[2]); A[g][c2 + 9] = hi(w[2]);
      A[g + 8][c2 + 8] = lo(w[3]); A[g + 8][c2 + 9] = hi(w[3]);
      B[c2][g] = lo(w[4]);     B[c2 + 1][g] = hi(w[4]);
      B[c2 + 8][g] = lo(w[5]); B[c2 + 9][g] = hi(w[5]);
      C[g][c2] = __uint_as_float(w[6]);     C[g][c2 + 1] = __uint_as_float(w[7]);
      C[g + 8][c2] = __uint_as_float(w[8]); C[g + 8][c2 + 1] = __uint_as_float(w[9]);
    }
    for (int l = 0; l < 32; ++l) {
      int g = l / 4, c2 = 2 * (l % 4);
      int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {c2, c2 + 1, c2, c2 + 1};
      for (int e = 0; e < 4; ++e) {
        float acc = C[rows[e]][cols[e]];
        for (int k = 0; k < 16; ++k)
          acc += A[rows[e]][k] * B[k][cols[e]];
        res[l].w[e] = __float_as_uint(acc);
      }
    }
  });
  for (int e = 0; e < 4; ++e)
    c[e] = __uint_as_float(out.w[e]);
}

/// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give
/// the row addresses of matrix i; lane 4 g + c receives, per matrix, (row
/// g, cols 2c, 2c+1), or transposed (rows 2c, 2c+1, col g).
template <bool Trans> inline void ldsm(unsigned r[4], const void *row) {
  if (reinterpret_cast<uintptr_t>(row) % 16)
    fail("ldmatrix row address misaligned");
  inSmem(row, 16, "ldmatrix row");
  Slot in{};
  uintptr_t a = reinterpret_cast<uintptr_t>(row);
  in.w[0] = unsigned(a);
  in.w[1] = unsigned(uint64_t(a) >> 32);
  Slot out = collective(in, [](const Slot *all, Slot *res) {
    auto at = [&](int i, int rowIndex, int col) {
      const Slot &s = all[i * 8 + rowIndex];
      uintptr_t base = uintptr_t(s.w[0]) | uintptr_t(uint64_t(s.w[1]) << 32);
      unsigned short v;
      std::memcpy(&v, reinterpret_cast<const unsigned char *>(base) + 2 * col, 2);
      return unsigned(v);
    };
    for (int l = 0; l < 32; ++l) {
      int g = l / 4, c2 = 2 * (l % 4);
      for (int i = 0; i < 4; ++i)
        res[l].w[i] = Trans ? at(i, c2, g) | at(i, c2 + 1, g) << 16
                            : at(i, g, c2) | at(i, g, c2 + 1) << 16;
    }
  });
  for (int i = 0; i < 4; ++i)
    r[i] = out.w[i];
}

/// cp.async.{ca,cg}.shared.global of `size` bytes (4, 8 or 16; .cg takes
/// only 16), both addresses aligned to it; `bytes` = 0 writes `size` zero
/// bytes (the kernels' tail fill). Done at once, so commit and wait are
/// no-ops.
inline void cpAsync(void *dst, const void *src, int size, int bytes) {
  if (size != 4 && size != 8 && size != 16) fail("cp.async of a size other than 4, 8 or 16");
  if (reinterpret_cast<uintptr_t>(dst) % size || reinterpret_cast<uintptr_t>(src) % size)
    fail("cp.async with a misaligned address");
  inSmem(dst, size_t(size), "cp.async destination");
  if (bytes == size)
    std::memcpy(dst, src, size_t(size));
  else if (bytes == 0)
    std::memset(dst, 0, size_t(size));
  else
    fail("cp.async of a partial vector");
}
inline void cpAsync16(void *dst, const void *src, int bytes) { cpAsync(dst, src, 16, bytes); }
} // namespace emu
)emu";

std::string megaslide::test::hostCompiler() {
  const char *cxx = std::getenv("CXX");
  return cxx && *cxx ? cxx : "c++";
}

void *megaslide::test::buildHostLibrary(const std::string &source,
                                        const fs::path &dir,
                                        const std::string &name,
                                        std::string &why) {
  fs::path cpp = dir / (name + ".emu.cpp");
  fs::path so = dir / (name + ".emu.so");
  fs::path log = dir / (name + ".cc.log");
  std::ofstream(cpp) << source;
  // -fno-gnu-unique is GCC's; compilers without it (clang) get a second
  // try.
  std::string cmd;
  int rc = 1;
  for (const char *extra : {" -fno-gnu-unique", ""}) {
    cmd = hostCompiler() +
          " -std=c++17 -O1 -fPIC -shared -w -fvisibility=hidden" + extra +
          " -o '" + so.string() + "' '" + cpp.string() + "' > '" +
          log.string() + "' 2>&1";
    if ((rc = std::system(cmd.c_str())) == 0)
      break;
  }
  if (rc != 0) {
    std::ifstream in(log);
    why = "host compiler failed (" + cmd + "):\n" +
          std::string(std::istreambuf_iterator<char>(in), {});
    return nullptr;
  }
  void *lib = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib)
    why = dlerror();
  return lib;
}
