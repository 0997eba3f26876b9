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
#include <ucontext.h>

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
constexpr size_t kSmemBytes = 256 * 1024;
alignas(16) inline unsigned char g_smem[kSmemBytes];
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
inline void fail(const char *what) { std::fprintf(stderr, "emulation: %s\n", what); std::abort(); }
inline void yield() {
  State &s = state();
  if (!_setjmp(s.current->env)) jump(s.schedulerEnv);
}

inline void blockBarrier() {
  State &s = state();
  long gen = s.blockGeneration;
  ++s.progress;
  if (++s.blockArrived == (int)gBlockDim.x) { s.blockArrived = 0; ++s.blockGeneration; return; }
  while (s.blockGeneration == gen) yield();
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

inline void launch(Dim3 grid, unsigned threads, std::function<void()> kernel) {
  State &s = state();
  gGridDim = grid;
  gBlockDim = {threads, 1, 1};
  s.kernel = std::move(kernel);
  if (s.stacks.size() < threads) s.stacks.resize(threads, std::vector<char>(kStackBytes));
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        gBlockIdx = {x, y, z};
        // Uninitialised shared memory reads as NaN (0xffff in 16 bits).
        std::memset(g_smem, 0xff, kSmemBytes);
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
      }
}
} // namespace emu

#define threadIdx (emu::state().current->idx)
#define blockIdx (emu::gBlockIdx)
#define blockDim (emu::gBlockDim)
#define gridDim (emu::gGridDim)

inline void __syncthreads() { emu::blockBarrier(); }
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
