//===- CudaBackendTest.cpp - The cuda backend, with and without a GPU -----===//
//
// Without a GPU (what runs here):
//  * the driver and cuBLASLt symbol tables: a clear error without a driver,
//    every symbol resolved from the toolkit's stub libcuda.so and from
//    libcublasLt, our self-declared ABI constants equal to the CUDA
//    headers' (when a host compiler and the headers exist);
//  * every dense kernel compiles with NVRTC to an sm_90a cubin with no
//    register spills (skips without NVRTC);
//  * every lowered graph op computes what the cpu kernel computes: the
//    generated CUDA C++ is compiled with the host compiler against a small
//    emulation of the CUDA execution model (threads as fibers, warp
//    shuffles and barriers as rendezvous), cuBLASLt GEMMs by a naive
//    column-major GEMM, and compared with cpu::findGraphKernel within bf16
//    rounding (skips without a host compiler);
//  * preparation of a hand-built plan: lowering, pools, cross-stream
//    write-after-read waits; create() says why there is no GPU.
// With a GPU (skipped here): the hand-built plan, and a compiled plan given
// by $MEGASLIDE_CUDA_TEST_PLAN (scripts/device-check.sh sets it), step on
// the cuda backend and match the cpu backend: losses and gradients.
//
//===----------------------------------------------------------------------===//

#include "cuda/CudaBackend.h"
#include "cpu/AdamW.h"
#include "cpu/CpuBackend.h"
#include "cpu/Dsa3d.h"
#include "cpu/GraphKernels.h"
#include "cuda/CudaApi.h"
#include "cuda/ElementwiseKernels.h"
#include "cuda/Nvrtc.h"
#include "train/SyntheticData.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <tuple>

#include <dlfcn.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;
using exec::TensorType;
namespace fs = std::filesystem;

namespace {

std::string hostCompiler() {
  const char *cxx = std::getenv("CXX");
  return cxx && *cxx ? cxx : "c++";
}

fs::path freshDir(const std::string &name) {
  fs::path dir =
      fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string readFile(const fs::path &p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

//===----------------------------------------------------------------------===//
// Symbol tables
//===----------------------------------------------------------------------===//

TEST(CudaApiTest, NoDeviceGivesAClearError) {
  std::string why;
  if (cudaDeviceAvailable(&why))
    GTEST_SKIP() << "a CUDA device is present";
  EXPECT_TRUE(why.find("no CUDA driver: libcuda.so.1 not found") == 0 ||
              why.find("CUDA driver reports no device (CUDA_ERROR_") == 0)
      << why;
}

TEST(CudaApiTest, StubDriverResolvesEverySymbol) {
  const char *stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
  if (!fs::exists(stub))
    GTEST_SKIP() << "no " << stub;
  auto api = openCudaDriver(stub);
  ASSERT_TRUE(!!api) << llvm::toString(api.takeError());
#define MEGASLIDE_CHECK(name, ret, ...)                                        \
  EXPECT_NE((*api)->name, nullptr) << #name;
  MEGASLIDE_CUDA_DRIVER_SYMBOLS(MEGASLIDE_CHECK)
#undef MEGASLIDE_CHECK
  // The stub answers every call with CUDA_ERROR_STUB_LIBRARY.
  auto device = initCudaDevice(**api, 0);
  ASSERT_FALSE(!!device);
  std::string msg = llvm::toString(device.takeError());
  EXPECT_EQ(msg.find("CUDA driver reports no device (CUDA_ERROR_STUB_LIBRARY"),
            0u)
      << msg;
}

TEST(CudaApiTest, CublasLtResolvesEverySymbol) {
  auto lt = loadCublasLt();
  if (!lt)
    GTEST_SKIP() << llvm::toString(lt.takeError());
#define MEGASLIDE_CHECK(name, ret, ...)                                        \
  EXPECT_NE((*lt)->name, nullptr) << #name;
  MEGASLIDE_CUBLASLT_SYMBOLS(MEGASLIDE_CHECK)
#undef MEGASLIDE_CHECK
  EXPECT_GE((*lt)->cublasLtGetVersion(), 120000u);
}

TEST(CudaApiTest, AbiMatchesTheCudaHeaders) {
  static_assert(sizeof(cublasLtMatmulAlgo_t) == 64);
  static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == 96);
  const char *include = "/usr/local/cuda/include";
  if (!fs::exists(fs::path(include) / "cublasLt.h") ||
      !fs::exists(fs::path(include) / "cuda.h"))
    GTEST_SKIP() << "no CUDA headers in " << include;
  fs::path dir = freshDir("megaslide-cuda-abi");
  std::ofstream(dir / "abi.cpp") << R"(
#include <cublasLt.h>
#include <cuda.h>
#include <cstdio>
int main() {
  std::printf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %zu %zu\n",
    (int)CUBLAS_COMPUTE_32F, (int)CUDA_R_32F, (int)CUDA_R_16F, (int)CUDA_R_16BF,
    (int)CUBLAS_OP_N, (int)CUBLAS_OP_T, (int)CUBLASLT_MATMUL_DESC_TRANSA,
    (int)CUBLASLT_MATMUL_DESC_TRANSB, (int)CUBLASLT_MATMUL_DESC_EPILOGUE,
    (int)CUBLASLT_MATMUL_DESC_BIAS_POINTER, (int)CUBLASLT_EPILOGUE_BIAS,
    (int)CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
    (int)CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
    (int)CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    (int)CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    (int)CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    (int)CU_EVENT_DISABLE_TIMING, (int)CU_STREAM_NON_BLOCKING,
    (int)CU_MEMHOSTALLOC_PORTABLE, sizeof(cublasLtMatmulAlgo_t),
    sizeof(cublasLtMatmulHeuristicResult_t));
}
)";
  std::string cmd =
      hostCompiler() + " -std=c++17 -I" + include + " -o '" +
      (dir / "abi").string() + "' '" + (dir / "abi.cpp").string() + "' > '" +
      (dir / "cc.log").string() + "' 2>&1 && '" + (dir / "abi").string() +
      "' > '" + (dir / "out.txt").string() + "'";
  if (std::system(cmd.c_str()) != 0)
    GTEST_SKIP() << "cannot build against the CUDA headers:\n"
                 << readFile(dir / "cc.log");
  std::string expected = llvm::formatv(
      "{0} {1} {2} {3} {4} {5} {6} {7} {8} {9} {10} {11} {12} {13} {14} {15} "
      "{16} {17} {18} 64 96\n",
      CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUBLAS_OP_N,
      CUBLAS_OP_T, CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB,
      CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
      CUBLASLT_EPILOGUE_BIAS, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
      CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_EVENT_DISABLE_TIMING,
      CU_STREAM_NON_BLOCKING, CU_MEMHOSTALLOC_PORTABLE);
  EXPECT_EQ(readFile(dir / "out.txt"), expected);
  fs::remove_all(dir);
}

//===----------------------------------------------------------------------===//
// NVRTC: every dense kernel for sm_90a
//===----------------------------------------------------------------------===//

TEST(CudaKernelsTest, EveryKernelCompilesForSm90aWithoutSpills) {
  std::string why;
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  std::vector<KernelInstance> kernels = representativeKernelInstances();
  std::set<std::string> kinds;
  for (const KernelInstance &k : kernels)
    kinds.insert(k.kind);
  EXPECT_EQ(kinds.size(), elementwiseKernelKinds().size());
  CompileResult r = compileCuda(emitElementwiseSource(kernels),
                                "megaslide_dense_all.cu", "sm_90a");
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_GT(r.cubin.size(), 0u);
  std::vector<KernelResources> res = parsePtxasLog(r.log);
  ASSERT_EQ(res.size(), kernels.size()) << r.log;
  std::set<std::string> names;
  for (const KernelInstance &k : kernels)
    names.insert(k.name());
  for (const KernelResources &k : res) {
    EXPECT_TRUE(names.count(k.kernel)) << k.kernel;
    EXPECT_EQ(k.spillStores, 0) << k.kernel;
    EXPECT_EQ(k.spillLoads, 0) << k.kernel;
    EXPECT_LE(k.registers, 255) << k.kernel;
    // 256 threads must fit one SM at least once.
    EXPECT_GE(occupancySm90(k, kElementwiseBlockThreads).blocksPerSm, 1)
        << k.kernel;
  }
}

//===----------------------------------------------------------------------===//
// Host emulation of the generated kernels
//===----------------------------------------------------------------------===//

/// Prepended to the generated source: the CUDA execution model on fibers.
/// Blocks run one after another; a block's threads are fibers switched at
/// barriers and warp shuffles.
constexpr const char *kEmulation = R"emu(
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <setjmp.h>
#include <ucontext.h>

#define MS_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float msHalfToFloat(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short msFloatToHalf(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }

namespace emu {
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
inline Dim3 gBlockIdx, gBlockDim, gGridDim;
// Fibers start on their own stack through makecontext; after that they
// switch with _setjmp/_longjmp, which (unlike swapcontext) makes no system
// call: warp shuffles switch every lane.
struct Fiber { ucontext_t ctx; jmp_buf env; Dim3 idx; bool done = false, started = false; };
struct State {
  std::vector<Fiber> fibers;
  std::vector<std::vector<char>> stacks;
  ucontext_t scheduler;
  jmp_buf schedulerEnv;
  Fiber *current = nullptr;
  std::function<void()> kernel;
  int blockArrived = 0; long blockGeneration = 0;
  std::vector<int> warpArrived; std::vector<long> warpGeneration;
  std::vector<float> warpIn, warpOut;
  long progress = 0;
};
inline State &state() { static State s; return s; }
inline void fail(const char *what) { std::fprintf(stderr, "emulation: %s\n", what); std::abort(); }
inline void yield() {
  State &s = state();
  if (!_setjmp(s.current->env)) _longjmp(s.schedulerEnv, 1);
}
inline void blockBarrier() {
  State &s = state();
  long gen = s.blockGeneration;
  ++s.progress;
  if (++s.blockArrived == (int)gBlockDim.x) { s.blockArrived = 0; ++s.blockGeneration; return; }
  while (s.blockGeneration == gen) yield();
}
inline float shflXor(float v, int mask) {
  State &s = state();
  unsigned t = s.current->idx.x, w = t / 32, lane = t % 32;
  long gen = s.warpGeneration[w];
  s.warpIn[w * 32 + lane] = v;
  ++s.progress;
  if (++s.warpArrived[w] == 32) {
    for (unsigned l = 0; l < 32; ++l)
      s.warpOut[w * 32 + l] = s.warpIn[w * 32 + (l ^ (unsigned)mask)];
    s.warpArrived[w] = 0;
    ++s.warpGeneration[w];
  } else {
    while (s.warpGeneration[w] == gen) yield();
  }
  return s.warpOut[w * 32 + lane];
}
inline void entry() {
  State &s = state();
  s.kernel();
  s.current->done = true;
  ++s.progress;
  _longjmp(s.schedulerEnv, 1);
}
inline void launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                   std::function<void()> kernel) {
  State &s = state();
  gGridDim = {gx, gy, gz};
  gBlockDim = {threads, 1, 1};
  s.kernel = std::move(kernel);
  if (s.stacks.size() < threads) s.stacks.resize(threads, std::vector<char>(64 * 1024));
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        gBlockIdx = {x, y, z};
        unsigned warps = (threads + 31) / 32;
        s.fibers.assign(threads, Fiber());
        s.warpArrived.assign(warps, 0);
        s.warpGeneration.assign(warps, 0);
        s.warpIn.assign(warps * 32, 0.0f);
        s.warpOut.assign(warps * 32, 0.0f);
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
              if (f.started) _longjmp(f.env, 1);
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
inline float __shfl_xor_sync(unsigned, float v, int mask) { return emu::shflXor(v, mask); }
)emu";

/// The generated kernels built for the host, with one C entry point per
/// instance: emu_<name>(grid x, y, z, argument pointers).
class EmulatedKernels {
public:
  static std::unique_ptr<EmulatedKernels>
  build(const std::vector<KernelInstance> &kernels, std::string &why) {
    static int builds = 0;
    fs::path dir = freshDir("megaslide-dense-emu" + std::to_string(builds++));
    std::string source = kEmulation + emitElementwiseSource(kernels);
    for (const KernelInstance &k : kernels) {
      std::vector<std::string> types = kernelParameterTypes(k);
      source += "extern \"C\" __attribute__((visibility(\"default\"))) void "
                "emu_" +
                k.name() +
                "(unsigned gx, unsigned gy, unsigned gz, void **args) {\n"
                "  emu::launch(gx, gy, gz, " +
                std::to_string(kElementwiseBlockThreads) + ", [&] { " +
                k.name() + "(";
      for (size_t i = 0; i < types.size(); ++i)
        source += (i ? ", " : "") + std::string("*reinterpret_cast<") +
                  types[i] + "*>(args[" + std::to_string(i) + "])";
      source += "); });\n}\n";
    }
    std::ofstream(dir / "dense.emu.cpp") << source;
    fs::path so = dir / "dense.emu.so";
    // Hidden symbols, no GNU-unique ones: each library keeps its own
    // emulator state. The flag is GCC's; other compilers get a second try.
    std::string cmd;
    int rc = 1;
    for (const char *extra : {" -fno-gnu-unique", ""}) {
      cmd = hostCompiler() +
            " -std=c++17 -O1 -fPIC -shared -w -fvisibility=hidden" + extra +
            " -o '" + so.string() + "' '" + (dir / "dense.emu.cpp").string() +
            "' > '" + (dir / "cc.log").string() + "' 2>&1";
      if ((rc = std::system(cmd.c_str())) == 0)
        break;
    }
    if (rc != 0) {
      why = "host compiler failed (" + cmd + "):\n" + readFile(dir / "cc.log");
      return nullptr;
    }
    void *handle = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      why = dlerror();
      return nullptr;
    }
    auto e = std::unique_ptr<EmulatedKernels>(new EmulatedKernels);
    e->handle = handle;
    e->dir = dir;
    return e;
  }
  ~EmulatedKernels() {
    if (handle)
      dlclose(handle);
    fs::remove_all(dir);
  }
  using Entry = void (*)(unsigned, unsigned, unsigned, void **);
  Entry entry(const std::string &name) {
    return reinterpret_cast<Entry>(dlsym(handle, ("emu_" + name).c_str()));
  }

private:
  EmulatedKernels() = default;
  void *handle = nullptr;
  fs::path dir;
};

/// A tensor in its stored dtype.
struct Buffer {
  TensorType type;
  std::vector<uint8_t> bytes;
};

float loadAs(const void *p, DType t, int64_t i) {
  switch (t) {
  case DType::BF16:
    return cpu::bf16ToFloat(static_cast<const uint16_t *>(p)[i]);
  case DType::F16: {
    _Float16 h;
    std::memcpy(&h, static_cast<const uint16_t *>(p) + i, 2);
    return static_cast<float>(h);
  }
  case DType::F32:
    return static_cast<const float *>(p)[i];
  case DType::I32:
    return static_cast<float>(static_cast<const int32_t *>(p)[i]);
  case DType::I64:
    return static_cast<float>(static_cast<const int64_t *>(p)[i]);
  }
  return 0;
}

void storeAs(void *p, DType t, int64_t i, float v) {
  switch (t) {
  case DType::BF16:
    static_cast<uint16_t *>(p)[i] = cpu::floatToBf16(v);
    return;
  case DType::F16: {
    _Float16 h = static_cast<_Float16>(v);
    std::memcpy(static_cast<uint16_t *>(p) + i, &h, 2);
    return;
  }
  case DType::F32:
    static_cast<float *>(p)[i] = v;
    return;
  case DType::I32:
    static_cast<int32_t *>(p)[i] = static_cast<int32_t>(v);
    return;
  case DType::I64:
    static_cast<int64_t *>(p)[i] = static_cast<int64_t>(v);
    return;
  }
}

std::vector<float> widened(const Buffer &b) {
  std::vector<float> out(b.type.numElements());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = loadAs(b.bytes.data(), b.type.dtype, i);
  return out;
}

/// cuBLASLt's contract, naively: D = op(A) op(B) (+ bias per row),
/// column-major, fp32 accumulation.
void naiveGemm(const GemmCall &g, const void *A, const void *B, void *D,
               const void *bias) {
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t i = 0; i < g.m; ++i) {
      double acc = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        float a = loadAs(A, g.abType, g.transA ? p + i * g.lda : i + p * g.lda);
        float b = loadAs(B, g.abType, g.transB ? j + p * g.ldb : p + j * g.ldb);
        acc += double(a) * b;
      }
      if (g.hasBias)
        acc += loadAs(bias, g.dType, i);
      storeAs(D, g.dType, i + j * g.ldd, static_cast<float>(acc));
    }
}

/// Runs a lowered op on host buffers, the kernels emulated.
void runLowered(const LoweredOp &op, EmulatedKernels &emu,
                std::vector<Buffer> &operands, std::vector<Buffer> &results) {
  std::vector<uint8_t> scratch(op.scratchBytes + 512);
  uint8_t *scratchBase =
      scratch.data() +
      (256 - reinterpret_cast<uintptr_t>(scratch.data()) % 256);
  auto resolve = [&](const BufferRef &r) -> void * {
    switch (r.kind) {
    case BufferRef::Operand:
      return operands[r.index].bytes.data();
    case BufferRef::Result:
      return results[r.index].bytes.data();
    case BufferRef::Scratch:
      return scratchBase + r.index;
    }
    return nullptr;
  };
  for (const LoweredStep &s : op.steps) {
    if (auto *l = std::get_if<KernelLaunch>(&s)) {
      std::vector<uint64_t> slots;
      for (const KernelArg &a : l->args) {
        uint64_t slot = 0;
        switch (a.kind) {
        case KernelArg::Buffer: {
          void *p = resolve(a.buffer);
          std::memcpy(&slot, &p, sizeof(p));
          break;
        }
        case KernelArg::Null:
          break;
        case KernelArg::I64:
          std::memcpy(&slot, &a.i, 8);
          break;
        case KernelArg::F32: {
          float f = static_cast<float>(a.f);
          std::memcpy(&slot, &f, 4);
          break;
        }
        case KernelArg::F64:
          std::memcpy(&slot, &a.f, 8);
          break;
        }
        slots.push_back(slot);
      }
      std::vector<void *> args;
      for (uint64_t &slot : slots)
        args.push_back(&slot);
      auto entry = emu.entry(l->kernel.name());
      ASSERT_NE(entry, nullptr) << l->kernel.name();
      entry(l->grid[0], l->grid[1], l->grid[2], args.data());
    } else if (auto *g = std::get_if<GemmCall>(&s)) {
      naiveGemm(*g, resolve(g->a), resolve(g->b), resolve(g->d),
                g->hasBias ? resolve(g->bias) : nullptr);
    } else if (auto *m = std::get_if<MemsetCall>(&s)) {
      std::memset(resolve(m->dst), 0, m->bytes);
    } else if (auto *c = std::get_if<CopyCall>(&s)) {
      std::memmove(resolve(c->dst), resolve(c->src), c->bytes);
    }
  }
}

/// One graph op to check: instruction, operand and result types, and how
/// to fill integer operands.
struct OpCase {
  std::string label;
  exec::Instruction inst;
  std::vector<TensorType> operands, results;
  int64_t idRange = 0; ///< ids operands: values in [0, idRange)
};

TensorType tt(DType d, std::vector<int64_t> shape) { return {d, shape}; }

exec::Instruction
makeInst(const std::string &op,
         std::map<std::string, exec::Attr, std::less<>> attrs = {}) {
  exec::Instruction inst;
  inst.op = op;
  inst.attrs = std::move(attrs);
  return inst;
}

std::vector<OpCase> denseCases() {
  const DType bf = DType::BF16, f32 = DType::F32, f16 = DType::F16;
  std::vector<OpCase> c;
  auto add = [&](std::string label, exec::Instruction inst,
                 std::vector<TensorType> ops, std::vector<TensorType> res,
                 int64_t ids = 0) {
    c.push_back({std::move(label), std::move(inst), std::move(ops),
                 std::move(res), ids});
  };
  using V = std::vector<int64_t>;
  add("cast f32->bf16", makeInst("cast"), {tt(f32, {4, 33})},
      {tt(bf, {4, 33})});
  add("cast bf16->f32", makeInst("cast"), {tt(bf, {4, 33})},
      {tt(f32, {4, 33})});
  add("cast f32->f16", makeInst("cast"), {tt(f32, {70})}, {tt(f16, {70})});
  add("add", makeInst("add"), {tt(bf, {2, 5, 7}), tt(bf, {2, 5, 7})},
      {tt(bf, {2, 5, 7})});
  add("bias_add", makeInst("bias_add"), {tt(bf, {3, 40}), tt(bf, {40})},
      {tt(bf, {3, 40})});
  add("bias_add_grad", makeInst("bias_add_grad"), {tt(bf, {3, 200, 40})},
      {tt(f32, {40})});
  for (const char *op : {"gelu", "silu"})
    add(op, makeInst(op), {tt(bf, {300})}, {tt(bf, {300})});
  for (const char *op : {"gelu_grad", "silu_grad"})
    add(op, makeInst(op), {tt(bf, {300}), tt(bf, {300})}, {tt(bf, {300})});
  add("modulate", makeInst("modulate"),
      {tt(bf, {2, 6, 40}), tt(bf, {2, 40}), tt(bf, {2, 40})},
      {tt(bf, {2, 6, 40})});
  add("modulate_grad", makeInst("modulate_grad"),
      {tt(bf, {2, 70, 40}), tt(bf, {2, 40}), tt(bf, {2, 70, 40})},
      {tt(bf, {2, 70, 40}), tt(f32, {2, 40}), tt(f32, {2, 40})});
  add("gate", makeInst("gate"), {tt(bf, {2, 6, 40}), tt(bf, {2, 40})},
      {tt(bf, {2, 6, 40})});
  add("gate_grad", makeInst("gate_grad"),
      {tt(bf, {2, 6, 40}), tt(bf, {2, 40}), tt(bf, {2, 6, 40})},
      {tt(bf, {2, 6, 40}), tt(f32, {2, 40})});
  add("layer_norm", makeInst("layer_norm", {{"eps", 1e-6}}),
      {tt(bf, {2, 6, 300})}, {tt(bf, {2, 6, 300})});
  add("layer_norm affine", makeInst("layer_norm", {{"eps", 1e-5}}),
      {tt(bf, {2, 3, 64}), tt(bf, {64}), tt(bf, {64})}, {tt(bf, {2, 3, 64})});
  add("layer_norm_grad", makeInst("layer_norm_grad", {{"eps", 1e-6}}),
      {tt(bf, {2, 3, 300}), tt(bf, {2, 3, 300})}, {tt(bf, {2, 3, 300})});
  add("layer_norm_grad affine", makeInst("layer_norm_grad", {{"eps", 1e-6}}),
      {tt(bf, {2, 90, 64}), tt(bf, {2, 90, 64}), tt(bf, {64}), tt(bf, {64})},
      {tt(bf, {2, 90, 64}), tt(f32, {64}), tt(f32, {64})});
  add("rms_norm", makeInst("rms_norm", {{"eps", 1e-6}}),
      {tt(bf, {2, 3, 64}), tt(bf, {64})}, {tt(bf, {2, 3, 64})});
  add("rms_norm_grad", makeInst("rms_norm_grad", {{"eps", 1e-6}}),
      {tt(bf, {2, 90, 64}), tt(bf, {2, 90, 64}), tt(bf, {64})},
      {tt(bf, {2, 90, 64}), tt(f32, {64})});
  add("split", makeInst("split"), {tt(bf, {2, 3, 48})},
      {tt(bf, {2, 3, 24}), tt(bf, {2, 3, 24})});
  add("concat", makeInst("concat"), {tt(bf, {2, 3, 16}), tt(bf, {2, 3, 32})},
      {tt(bf, {2, 3, 48})});
  add("reshape", makeInst("reshape"), {tt(bf, {2, 3, 48})}, {tt(bf, {6, 48})});
  add("zeros", makeInst("zeros"), {}, {tt(bf, {5, 7})});
  add("linear", makeInst("linear"),
      {tt(bf, {2, 5, 24}), tt(bf, {16, 24}), tt(bf, {16})},
      {tt(bf, {2, 5, 16})});
  add("linear no bias f32 out", makeInst("linear"),
      {tt(bf, {2, 5, 24}), tt(bf, {16, 24})}, {tt(f32, {2, 5, 16})});
  add("linear mixed f32 weight", makeInst("linear"),
      {tt(bf, {7, 24}), tt(f32, {16, 24}), tt(f32, {16})}, {tt(bf, {7, 16})});
  add("linear_grad_data", makeInst("linear_grad_data"),
      {tt(bf, {2, 5, 16}), tt(bf, {16, 24})}, {tt(bf, {2, 5, 24})});
  add("linear_grad_params", makeInst("linear_grad_params"),
      {tt(bf, {2, 5, 24}), tt(bf, {2, 5, 16})},
      {tt(bf, {16, 24}), tt(bf, {16})});
  add("patch_embed", makeInst("patch_embed"),
      {tt(bf, {1, 4, 2, 4, 4}), tt(bf, {8, 4, 1, 2, 2}), tt(bf, {8})},
      {tt(bf, {1, 8, 8})});
  add("patch_embed_grad", makeInst("patch_embed_grad"),
      {tt(bf, {1, 4, 2, 4, 4}), tt(bf, {1, 8, 8})},
      {tt(bf, {8, 4, 1, 2, 2}), tt(bf, {8})});
  add("patchify", makeInst("patchify", {{"patch", V{1, 2, 2}}}),
      {tt(bf, {2, 4, 2, 4, 6})}, {tt(bf, {2, 12, 16})});
  add("unpatchify",
      makeInst("unpatchify", {{"grid", V{2, 2, 3}}, {"patch", V{1, 2, 2}}}),
      {tt(bf, {2, 12, 16})}, {tt(bf, {2, 4, 2, 4, 6})});
  add("timestep_embedding",
      makeInst("timestep_embedding", {{"time_scale", 1000.0}}), {tt(f32, {3})},
      {tt(bf, {3, 16})});
  add("embedding", makeInst("embedding"),
      {tt(DType::I64, {3}), tt(bf, {11, 8})}, {tt(bf, {3, 8})}, 11);
  add("embedding_grad", makeInst("embedding_grad"),
      {tt(DType::I32, {5}), tt(bf, {5, 8})}, {tt(f32, {4, 8})}, 4);
  add("rope3d",
      makeInst("rope3d", {{"grid", V{2, 2, 3}}, {"dims", V{8, 4, 4}}}),
      {tt(bf, {1, 12, 2, 16})}, {tt(bf, {1, 12, 2, 16})});
  add("rope3d inverse",
      makeInst("rope3d", {{"grid", V{2, 2, 3}},
                          {"dims", V{8, 4, 4}},
                          {"inverse", int64_t(1)},
                          {"theta", 500.0}}),
      {tt(f32, {2, 12, 1, 16})}, {tt(f32, {2, 12, 1, 16})});
  add("attention", makeInst("attention"),
      {tt(bf, {1, 6, 2, 16}), tt(bf, {1, 5, 2, 16}), tt(bf, {1, 5, 2, 16})},
      {tt(bf, {1, 6, 2, 16})});
  add("attention head dim 40", makeInst("attention", {{"scale", 0.3}}),
      {tt(f32, {2, 3, 1, 40}), tt(f32, {2, 4, 1, 40}), tt(f32, {2, 4, 1, 40})},
      {tt(f32, {2, 3, 1, 40})});
  add("attention_grad", makeInst("attention_grad"),
      {tt(bf, {1, 6, 2, 16}), tt(bf, {1, 5, 2, 16}), tt(bf, {1, 5, 2, 16}),
       tt(bf, {1, 6, 2, 16}), tt(bf, {1, 6, 2, 16})},
      {tt(bf, {1, 6, 2, 16}), tt(bf, {1, 5, 2, 16}), tt(bf, {1, 5, 2, 16})});
  add("flow_interpolate", makeInst("flow_interpolate"),
      {tt(bf, {2, 3, 2, 2, 2}), tt(bf, {2, 3, 2, 2, 2}), tt(f32, {2})},
      {tt(bf, {2, 3, 2, 2, 2})});
  add("flow_matching_loss", makeInst("flow_matching_loss"),
      {tt(bf, {2, 4, 2, 4, 4}), tt(bf, {2, 3, 2, 4, 4}),
       tt(bf, {2, 3, 2, 4, 4})},
      {tt(f32, {})});
  add("flow_matching_loss_grad", makeInst("flow_matching_loss_grad"),
      {tt(bf, {2, 4, 2, 2, 2}), tt(bf, {2, 3, 2, 2, 2}),
       tt(bf, {2, 3, 2, 2, 2})},
      {tt(bf, {2, 4, 2, 2, 2})});
  return c;
}

/// Random operands: normal floats, ids in range, timesteps in [0, 1].
void fillOperands(const OpCase &c, std::mt19937 &rng,
                  std::vector<Buffer> &operands) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (size_t i = 0; i < c.operands.size(); ++i) {
    Buffer b{c.operands[i], std::vector<uint8_t>(c.operands[i].bytes())};
    for (int64_t e = 0; e < b.type.numElements(); ++e) {
      float v = normal(rng);
      if (b.type.dtype == DType::I32 || b.type.dtype == DType::I64)
        v = std::floor(unit(rng) * c.idRange);
      else if (c.inst.op == "timestep_embedding" ||
               (c.inst.op == "flow_interpolate" && i == 2))
        v = unit(rng);
      storeAs(b.bytes.data(), b.type.dtype, e, v);
    }
    operands.push_back(std::move(b));
  }
}

/// One host build of every kernel the tests below launch (the dense cases,
/// the hand-built plan, the compiled tiny plans): null with `why` when it
/// cannot be built. Defined at the end of the file.
EmulatedKernels *sharedEmulation(std::string &why);

class CudaDenseEmulationTest : public ::testing::Test {
protected:
  static void SetUpTestSuite() { emu = sharedEmulation(whyNot); }
  static EmulatedKernels *emu;
  static std::string whyNot;
};
EmulatedKernels *CudaDenseEmulationTest::emu = nullptr;
std::string CudaDenseEmulationTest::whyNot;

TEST_F(CudaDenseEmulationTest, LoweredOpsMatchCpuKernels) {
  if (!emu)
    GTEST_SKIP() << whyNot;
  std::mt19937 rng(7);
  int checked = 0;
  for (const OpCase &c : denseCases()) {
    SCOPED_TRACE(c.label);
    cpu::GraphKernel kernel = cpu::findGraphKernel(c.inst.op);
    if (!kernel) {
      ADD_FAILURE() << "no cpu kernel for " << c.inst.op;
      continue;
    }
    std::vector<Buffer> operands;
    fillOperands(c, rng, operands);
    if (c.inst.op == "attention_grad") {
      // The output operand: the forward of q, k, v (the kernels' delta
      // uses it).
      cpu::GraphKernel fwd = cpu::findGraphKernel("attention");
      std::vector<std::vector<float>> in;
      std::vector<cpu::OpTensor> ts;
      for (int i = 0; i < 3; ++i)
        in.push_back(widened(operands[i]));
      for (int i = 0; i < 3; ++i)
        ts.push_back({operands[i].type, in[i].data()});
      std::vector<float> out(operands[3].type.numElements());
      cpu::OpTensor o{operands[3].type, out.data()};
      llvm::Error err = fwd(makeInst("attention"), ts, o);
      ASSERT_FALSE(!!err) << llvm::toString(std::move(err));
      for (size_t e = 0; e < out.size(); ++e)
        storeAs(operands[3].bytes.data(), operands[3].type.dtype, e, out[e]);
    }

    // The cpu kernel on the widened operands, results rounded to their
    // dtype as the cpu backend stores them.
    std::vector<std::vector<float>> wideOps, wideRes;
    std::vector<cpu::OpTensor> cpuOps, cpuRes;
    wideOps.reserve(operands.size());
    for (Buffer &b : operands) {
      cpu::OpTensor t;
      t.type = b.type;
      if (b.type.dtype == DType::I32)
        t.i32 = reinterpret_cast<int32_t *>(b.bytes.data());
      else if (b.type.dtype == DType::I64)
        t.i64 = reinterpret_cast<int64_t *>(b.bytes.data());
      else {
        wideOps.push_back(widened(b));
        t.f32 = wideOps.back().data();
      }
      cpuOps.push_back(t);
    }
    wideRes.reserve(c.results.size());
    for (const TensorType &t : c.results) {
      wideRes.emplace_back(t.numElements());
      cpuRes.push_back({t, wideRes.back().data()});
    }
    if (llvm::Error e = kernel(c.inst, cpuOps, cpuRes)) {
      ADD_FAILURE() << "cpu kernel: " << llvm::toString(std::move(e));
      continue;
    }

    auto lowered = lowerGraphOp(c.inst, c.operands, c.results);
    ASSERT_TRUE(!!lowered) << llvm::toString(lowered.takeError());
    std::vector<Buffer> results;
    for (const TensorType &t : c.results)
      results.push_back({t, std::vector<uint8_t>(t.bytes(), 0xff)});
    runLowered(*lowered, *emu, operands, results);

    for (size_t r = 0; r < results.size(); ++r) {
      std::vector<float> got = widened(results[r]);
      std::vector<float> want(wideRes[r].size());
      for (size_t e = 0; e < want.size(); ++e) {
        float v = wideRes[r][e];
        uint8_t tmp[8];
        storeAs(tmp, c.results[r].dtype, 0, v);
        want[e] = loadAs(tmp, c.results[r].dtype, 0);
      }
      float scale = 1.0f;
      for (float w : want)
        scale = std::max(scale, std::fabs(w));
      // Two roundings apart at most: bf16 has 8 bits of mantissa; sums of
      // hundreds of bf16-rounded terms (norm and bias gradients) carry a
      // little more.
      bool bf16 =
          c.results[r].dtype == DType::BF16 || c.results[r].dtype == DType::F16;
      float tol = bf16 ? 2e-2f * scale : 2e-4f * scale;
      float worst = 0;
      size_t at = 0;
      for (size_t e = 0; e < want.size(); ++e) {
        float err = std::fabs(got[e] - want[e]);
        if (!(err <= worst)) {
          worst = err;
          at = e;
        }
      }
      EXPECT_LE(worst, tol) << "result " << r << " element " << at << ": got "
                            << got[at] << ", cpu " << want[at];
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(denseCases().size()));
}

TEST(CudaDenseLoweringTest, EveryCpuOpButDsaAndAdamWHasALowering) {
  for (const std::string &op : cpu::graphKernelNames()) {
    if (op.rfind("dsa3d", 0) == 0 || op == "adamw")
      continue;
    EXPECT_TRUE(hasGraphOpLowering(op)) << op;
  }
}

TEST(CudaDenseLoweringTest, LinearIsOneTnGemmWithBiasEpilogue) {
  auto lowered =
      lowerGraphOp(makeInst("linear"),
                   {tt(DType::BF16, {2, 5, 24}), tt(DType::BF16, {16, 24}),
                    tt(DType::BF16, {16})},
                   {tt(DType::BF16, {2, 5, 16})});
  ASSERT_TRUE(!!lowered) << llvm::toString(lowered.takeError());
  ASSERT_EQ(lowered->steps.size(), 1u);
  const GemmCall &g = std::get<GemmCall>(lowered->steps[0]);
  EXPECT_TRUE(g.transA);
  EXPECT_FALSE(g.transB);
  EXPECT_EQ(g.m, 16);
  EXPECT_EQ(g.n, 10);
  EXPECT_EQ(g.k, 24);
  EXPECT_TRUE(g.hasBias);
  EXPECT_EQ(lowered->scratchBytes, 0);
}

TEST(CudaDenseLoweringTest, UnsupportedShapesNameTheOp) {
  auto lowered = lowerGraphOp(makeInst("attention"),
                              {tt(DType::BF16, {1, 4, 1, 512}),
                               tt(DType::BF16, {1, 4, 1, 512}),
                               tt(DType::BF16, {1, 4, 1, 512})},
                              {tt(DType::BF16, {1, 4, 1, 512})});
  ASSERT_FALSE(!!lowered);
  std::string msg = llvm::toString(lowered.takeError());
  EXPECT_NE(msg.find("'attention' on cuda: head dim 512 over 256"),
            std::string::npos)
      << msg;
}

//===----------------------------------------------------------------------===//
// A hand-built training step
//===----------------------------------------------------------------------===//

/// x -> linear(w1, b1) -> gelu -> linear(w2) -> layer_norm = prediction;
/// flow-matching loss against (x, noise); the backward of all of it; the
/// three gradients to the host and AdamW. w2 is fetched into w1's bytes
/// once w1 is dead: the h2d stream must wait for the compute stream (a
/// write after read the plan's events do not cover).
struct HandBuiltPlan {
  exec::ExecPlan plan;
  int64_t fetchW2 = -1, lastReadOfW1 = -1;
};

HandBuiltPlan handBuiltPlan() {
  HandBuiltPlan h;
  exec::ExecPlan &p = h.plan;
  p.model = "hand-built";
  p.batch = 2;
  p.alignment = 256;
  const DType bf = DType::BF16, f32 = DType::F32;
  int64_t offset = 0;
  auto value = [&](TensorType t, exec::Home home, const std::string &name = "",
                   int64_t at = -2) {
    exec::Value v;
    v.type = t;
    v.home = home;
    v.name = name;
    if (home == exec::Home::Device) {
      if (at >= 0) {
        v.offset = at;
      } else {
        v.offset = offset;
        offset += (t.bytes() + 255) / 256 * 256;
      }
    }
    p.values.push_back(v);
    return static_cast<int64_t>(p.values.size() - 1);
  };
  auto param = [&](const std::string &name, std::vector<int64_t> shape) {
    p.params.push_back({name, "master", "blocks", 0, "", {f32, shape}});
    p.params.push_back(
        {name + ".exp_avg", "moment", "blocks", 0, name, {f32, shape}});
    p.params.push_back(
        {name + ".exp_avg_sq", "moment", "blocks", 0, name, {f32, shape}});
  };
  param("w1", {64, 32});
  param("b1", {64});
  param("w2", {32, 64});
  auto inst = [&](const std::string &op, exec::Stream s,
                  std::vector<int64_t> ops, std::vector<int64_t> res) {
    exec::Instruction i;
    i.op = op;
    i.stream = s;
    i.operands = std::move(ops);
    i.results = std::move(res);
    p.instructions.push_back(i);
    return static_cast<int64_t>(p.instructions.size() - 1);
  };
  auto event = [&](exec::Stream from, exec::Stream to) {
    exec::Instruction r;
    r.op = "record";
    r.stream = from;
    r.event = p.numEvents++;
    p.instructions.push_back(r);
    exec::Instruction w;
    w.op = "wait";
    w.stream = to;
    w.event = r.event;
    p.instructions.push_back(w);
  };
  using S = exec::Stream;
  const exec::Home D = exec::Home::Device, In = exec::Home::Input,
                   H = exec::Home::Host;
  TensorType tok{bf, {2, 8, 32}}, hid{bf, {2, 8, 64}};
  int64_t xIn = value(tok, In, "latents"), nIn = value(tok, In, "noise");
  int64_t stepIn = value({DType::I64, {}}, In, "step");
  p.inputs = {xIn, nIn, stepIn};
  int64_t x = value(tok, D), noise = value(tok, D);
  inst("h2d", S::HostToDevice, {xIn}, {x});
  inst("h2d", S::HostToDevice, {nIn}, {noise});
  int64_t w1 = value({bf, {64, 32}}, D), b1 = value({bf, {64}}, D);
  int64_t f = inst("fetch", S::HostToDevice, {}, {w1});
  p.instructions[f].param = "w1";
  f = inst("fetch", S::HostToDevice, {}, {b1});
  p.instructions[f].param = "b1";
  event(S::HostToDevice, S::Compute);
  int64_t h1 = value(hid, D);
  h.lastReadOfW1 = inst("linear", S::Compute, {x, w1, b1}, {h1});
  int64_t a1 = value(hid, D);
  inst("gelu", S::Compute, {h1}, {a1});
  int64_t w2 = value({bf, {32, 64}}, D, "", p.values[w1].offset);
  h.fetchW2 = inst("fetch", S::HostToDevice, {}, {w2});
  p.instructions[h.fetchW2].param = "w2";
  event(S::HostToDevice, S::Compute);
  int64_t h2 = value(tok, D);
  inst("linear", S::Compute, {a1, w2}, {h2});
  int64_t pred = value(tok, D);
  exec::Instruction &ln =
      p.instructions[inst("layer_norm", S::Compute, {h2}, {pred})];
  ln.attrs["eps"] = 1e-6;
  int64_t loss = value({f32, {}}, D);
  inst("flow_matching_loss", S::Compute, {pred, x, noise}, {loss});
  int64_t dpred = value(tok, D);
  inst("flow_matching_loss_grad", S::Compute, {pred, x, noise}, {dpred});
  int64_t dh2 = value(tok, D);
  exec::Instruction &lng =
      p.instructions[inst("layer_norm_grad", S::Compute, {h2, dpred}, {dh2})];
  lng.attrs["eps"] = 1e-6;
  int64_t dw2 = value({bf, {32, 64}}, D);
  inst("linear_grad_params", S::Compute, {a1, dh2}, {dw2});
  int64_t da1 = value(hid, D);
  inst("linear_grad_data", S::Compute, {dh2, w2}, {da1});
  int64_t dh1 = value(hid, D);
  inst("gelu_grad", S::Compute, {h1, da1}, {dh1});
  int64_t dw1 = value({bf, {64, 32}}, D), db1 = value({bf, {64}}, D);
  inst("linear_grad_params", S::Compute, {x, dh1}, {dw1, db1});
  event(S::Compute, S::DeviceToHost);
  int64_t hdw2 = value({bf, {32, 64}}, H), hdw1 = value({bf, {64, 32}}, H),
          hdb1 = value({bf, {64}}, H), hloss = value({f32, {}}, H);
  inst("d2h", S::DeviceToHost, {dw2}, {hdw2});
  inst("d2h", S::DeviceToHost, {dw1}, {hdw1});
  inst("d2h", S::DeviceToHost, {db1}, {hdb1});
  inst("d2h", S::DeviceToHost, {loss}, {hloss});
  event(S::DeviceToHost, S::Host);
  for (auto [name, g] : {std::pair<const char *, int64_t>{"w2", hdw2},
                         {"w1", hdw1},
                         {"b1", hdb1}}) {
    exec::Instruction &a =
        p.instructions[inst("host_adamw", S::Host, {g, stepIn}, {})];
    a.param = name;
    a.attrs["lr"] = 1e-2;
  }
  p.outputs = {hloss};
  p.arenaBytes = offset;
  return h;
}

#define ASSERT_OK(expr)                                                        \
  do {                                                                         \
    llvm::Error err_ = (expr);                                                 \
    ASSERT_FALSE(!!err_) << llvm::toString(std::move(err_));                   \
  } while (0)

TEST(CudaBackendTest, HandBuiltPlanIsValidAndPrepares) {
  HandBuiltPlan h = handBuiltPlan();
  ASSERT_OK(exec::validate(h.plan));
  auto prep = prepareCudaPlan(h.plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  // The fetch of w2 into w1's bytes waits for the linear reading w1.
  const PreparedInstruction &fetch = prep->instructions[h.fetchW2];
  ASSERT_EQ(fetch.waits.size(), 1u);
  EXPECT_EQ(fetch.waits[0].stream, exec::Stream::Compute);
  EXPECT_EQ(fetch.waits[0].instruction, h.lastReadOfW1);
  EXPECT_TRUE(prep->needsDoneEvent[h.lastReadOfW1]);
  // No other instruction needs an extra wait: the plan's events order the
  // rest.
  for (size_t i = 0; i < prep->instructions.size(); ++i) {
    if (static_cast<int64_t>(i) != h.fetchW2) {
      EXPECT_TRUE(prep->instructions[i].waits.empty()) << "instruction " << i;
    }
  }
  EXPECT_FALSE(prep->kernels.empty());
  EXPECT_GE(prep->stagingSlotBytes, 64 * 32 * 2);
  EXPECT_LE(prep->arenaHighWater, h.plan.arenaBytes);
  EXPECT_GT(prep->arenaHighWater, h.plan.arenaBytes - 256);
  // Inputs and the four host values each have their own pinned bytes.
  EXPECT_FALSE(prep->hostPoolShared);
  EXPECT_EQ(prep->hostPoolBytes, 4096 + 4096 + 256 + 256);
}

TEST(CudaBackendTest, SharedHostPoolPacksByLiveness) {
  HandBuiltPlan h = handBuiltPlan();
  CudaOptions options;
  options.hostPoolNoReuseBytes = 0; // force sharing by liveness
  auto prep = prepareCudaPlan(h.plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  EXPECT_TRUE(prep->hostPoolShared);
  // All four host values are live together (the AdamW steps read them
  // after the last d2h): nothing can share, and nothing needs to wait.
  EXPECT_EQ(prep->hostPoolBytes, 4096 + 4096 + 256 + 256);
  for (const PreparedInstruction &pi : prep->instructions)
    for (const Dependency &d : pi.waits)
      EXPECT_NE(d.stream, exec::Stream::Host);
}

TEST(CudaBackendTest, PrepareNamesAnOpWithoutKernel) {
  HandBuiltPlan h = handBuiltPlan();
  h.plan.instructions[h.lastReadOfW1].op = "frobnicate";
  auto prep = prepareCudaPlan(h.plan);
  ASSERT_FALSE(!!prep);
  std::string msg = llvm::toString(prep.takeError());
  EXPECT_NE(msg.find("('frobnicate'): the cuda backend has no kernel for it"),
            std::string::npos)
      << msg;
}

TEST(CudaBackendTest, CreateWithoutGpuSaysWhy) {
  std::string why;
  if (cudaDeviceAvailable(&why))
    GTEST_SKIP() << "a CUDA device is present (covered by CudaBackendGpuTest)";
  HandBuiltPlan h = handBuiltPlan();
  auto backend = CudaBackend::create(h.plan);
  ASSERT_FALSE(!!backend);
  EXPECT_EQ(llvm::toString(backend.takeError()), why);
}

/// Steps both backends `steps` times from the same state and inputs;
/// compares losses and, in the first step, every gradient.
void compareWithCpu(const exec::ExecPlan &plan,
                    const std::function<exec::StepInputs(int)> &inputs,
                    int steps, double lossTol, double gradTol,
                    const CudaOptions &options = {}) {
  auto gpu = CudaBackend::create(plan, options);
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  auto ref = cpu::CpuBackend::create(plan);
  ASSERT_TRUE(!!ref) << llvm::toString(ref.takeError());
  host::HostState gpuState = host::initHostState(plan, 3);
  host::HostState cpuState = host::initHostState(plan, 3);
  for (int s = 0; s < steps; ++s) {
    exec::StepInputs in = inputs(s);
    llvm::StringMap<std::vector<float>> gpuGrads, cpuGrads;
    exec::StepOptions go, co;
    go.trace = co.trace = s == 0;
    go.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
      gpuGrads[n] = g.vec();
    };
    co.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
      cpuGrads[n] = g.vec();
    };
    auto g = (*gpu)->step(in, gpuState, go);
    ASSERT_TRUE(!!g) << llvm::toString(g.takeError());
    auto c = (*ref)->step(in, cpuState, co);
    ASSERT_TRUE(!!c) << llvm::toString(c.takeError());
    EXPECT_NEAR(g->loss, c->loss, lossTol * std::max(1.0f, std::fabs(c->loss)))
        << "step " << s;
    EXPECT_EQ(gpuState.step, cpuState.step);
    if (s == 0) {
      EXPECT_FALSE(g->spans.empty());
      EXPECT_EQ(gpuGrads.size(), cpuGrads.size());
      for (auto &entry : cpuGrads) {
        auto it = gpuGrads.find(entry.getKey());
        ASSERT_NE(it, gpuGrads.end()) << entry.getKey().str();
        const std::vector<float> &want = entry.getValue(), &got = it->second;
        ASSERT_EQ(got.size(), want.size());
        float scale = 1e-3f, worst = 0;
        for (float w : want)
          scale = std::max(scale, std::fabs(w));
        for (size_t i = 0; i < want.size(); ++i)
          worst = std::max(worst, std::fabs(got[i] - want[i]));
        EXPECT_LE(worst, gradTol * scale) << entry.getKey().str();
      }
    }
  }
}

//===----------------------------------------------------------------------===//
// The compiled tiny model's plan
//===----------------------------------------------------------------------===//

/// The tiny model compiled by the megaslide-run next to this binary with
/// `flags` (for no flags, $MEGASLIDE_CUDA_TEST_PLAN when set); null (with
/// `why`) when that does not work.
const exec::ExecPlan *tinyPlan(std::string &why,
                               const std::string &flags = "") {
  struct Cached {
    std::optional<exec::ExecPlan> plan;
    std::string why;
  };
  static std::map<std::string, Cached> cache;
  auto [it, fresh] = cache.try_emplace(flags);
  Cached &c = it->second;
  if (fresh) {
    std::string path;
    const char *env = std::getenv("MEGASLIDE_CUDA_TEST_PLAN");
    if (flags.empty() && env && *env) {
      path = env;
    } else {
      fs::path run =
          fs::read_symlink("/proc/self/exe").parent_path() / "megaslide-run";
      fs::path dir =
          freshDir("megaslide-tiny-plan" + std::to_string(cache.size()));
      path = (dir / "tiny.json").string();
      std::string cmd = "'" + run.string() +
                        "' --model tiny --backend cpu --steps 0 " + flags +
                        " --save-plan '" + path + "' > '" +
                        (dir / "log").string() + "' 2>&1";
      if (!fs::exists(run) || std::system(cmd.c_str()) != 0)
        c.why = "no tiny plan: set MEGASLIDE_CUDA_TEST_PLAN or build " +
                run.string();
    }
    if (c.why.empty()) {
      auto loaded = exec::loadExecPlan(path);
      if (loaded)
        c.plan = std::move(*loaded);
      else
        c.why = llvm::toString(loaded.takeError());
    }
  }
  why = c.why;
  return c.plan ? &*c.plan : nullptr;
}

/// Flags giving the tiny model 3D-DSA self-attention (its 5x8x8 grid is
/// smaller than the default window).
const char *const kTinyDsaFlags =
    "--dsa-window 3,4,4 --dsa-tile 1,2,2 --dsa-radius 1";

class CudaTinyPlanTest : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaTinyPlanTest, PreparesAndCompiles) {
  std::string why;
  const exec::ExecPlan *plan = tinyPlan(why, GetParam());
  if (!plan)
    GTEST_SKIP() << why;
  if (*GetParam()) {
    EXPECT_EQ(plan->kernelModules.size(), 1u);
  }
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  EXPECT_EQ(prep->arenaHighWater, plan->arenaBytes);
  EXPECT_EQ(prep->peakLiveBytes, plan->plannedLiveBytes);
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  CompileResult r =
      compileCuda(prep->elementwiseSource, "megaslide_dense.cu", "sm_90a");
  ASSERT_TRUE(r.ok()) << r.error;
  for (const KernelResources &k : parsePtxasLog(r.log))
    EXPECT_EQ(k.spillStores + k.spillLoads, 0) << k.kernel;
  for (const exec::KernelModule &m : plan->kernelModules) {
    CompileResult d = compileCuda(m.source, m.name + ".cu", "sm_90a");
    EXPECT_TRUE(d.ok() && !d.cubin.empty()) << m.name << ": " << d.error;
  }
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, CudaTinyPlanTest,
                         ::testing::Values("", kTinyDsaFlags));

//===----------------------------------------------------------------------===//
// A fake device: the whole backend without a GPU
//===----------------------------------------------------------------------===//

/// The driver and cuBLASLt as plain host code: memory is host memory,
/// copies are synchronous, kernels run on the host emulation, cuBLASLt
/// GEMMs naively with the semantics its documentation gives the
/// descriptors the backend builds. What this checks of the backend: the
/// issue loop, pools and staging, host worker and AdamW, events, traces,
/// argument marshalling and the GEMM descriptors. What it cannot:
/// asynchrony (every call completes at once) and the real hardware.
namespace fake {

EmulatedKernels *kernels = nullptr;
std::atomic<int64_t> clock{0};

/// The element types of a kernel from its name's suffix (ms_<kind>_<types>).
std::vector<DType> typesOf(llvm::StringRef name, size_t count) {
  llvm::SmallVector<llvm::StringRef> parts;
  name.split(parts, '_');
  std::vector<DType> types;
  for (llvm::StringRef p : llvm::ArrayRef(parts).take_back(count))
    types.push_back(exec::parseDType(p).value_or(DType::F32));
  return types;
}

/// Global attention as host loops with the kernels' argument lists and
/// contracts (lse and delta between the two backward kernels). Emulating a
/// 320-token attention lane by lane would take minutes; the CUDA kernels
/// themselves are checked by CudaDenseEmulationTest on small shapes.
struct HostAttention {
  std::vector<DType> t;
  int kind; // 0 fwd, 1 bwd_dq, 2 bwd_dkv
  void run(void **args) const {
    auto ptr = [&](int i) { return *reinterpret_cast<void **>(args[i]); };
    auto i64 = [&](int i) { return *reinterpret_cast<long long *>(args[i]); };
    int base = kind == 0 ? 5 : 8;
    long long B = i64(base), Nq = i64(base + 1), Nk = i64(base + 2),
              H = i64(base + 3), Dh = i64(base + 4);
    float scale = *reinterpret_cast<float *>(args[base + 5]);
    void *q = ptr(0), *k = ptr(1), *v = ptr(2);
    auto row = [&](long long b, long long n, long long N, long long h) {
      return ((b * N + n) * H + h) * Dh;
    };
    auto dot = [&](void *x, DType tx, long long xr, void *y, DType ty,
                   long long yr) {
      float s = 0;
      for (long long d = 0; d < Dh; ++d)
        s += loadAs(x, tx, xr + d) * loadAs(y, ty, yr + d);
      return s;
    };
    for (long long b = 0; b < B; ++b)
      for (long long h = 0; h < H; ++h) {
        long long outer = kind == 2 ? Nk : Nq;
        for (long long i = 0; i < outer; ++i) {
          if (kind == 0 || kind == 1) {
            long long qr = row(b, i, Nq, h);
            std::vector<float> s(Nk);
            float m = -INFINITY, l = 0;
            for (long long j = 0; j < Nk; ++j) {
              s[j] = scale * dot(q, t[0], qr, k, t[1], row(b, j, Nk, h));
              m = std::max(m, s[j]);
            }
            for (long long j = 0; j < Nk; ++j)
              l += std::exp(s[j] - m);
            float L = m + std::log(l);
            long long w = (b * H + h) * Nq + i;
            if (kind == 0) {
              for (long long d = 0; d < Dh; ++d) {
                float acc = 0;
                for (long long j = 0; j < Nk; ++j)
                  acc += std::exp(s[j] - L) *
                         loadAs(v, t[2], row(b, j, Nk, h) + d);
                storeAs(ptr(3), t[3], qr + d, acc);
              }
              if (float *lse = static_cast<float *>(ptr(4)))
                lse[w] = L;
              continue;
            }
            void *o = ptr(3), *dout = ptr(4);
            float dl = dot(dout, t[4], qr, o, t[3], qr);
            std::vector<float> dq(Dh, 0.0f);
            for (long long j = 0; j < Nk; ++j) {
              long long kr = row(b, j, Nk, h);
              float ds =
                  std::exp(s[j] - L) * (dot(dout, t[4], qr, v, t[2], kr) - dl);
              for (long long d = 0; d < Dh; ++d)
                dq[d] += ds * loadAs(k, t[1], kr + d);
            }
            for (long long d = 0; d < Dh; ++d)
              storeAs(ptr(5), t[5], qr + d, dq[d] * scale);
            static_cast<float *>(ptr(6))[w] = L;
            static_cast<float *>(ptr(7))[w] = dl;
          } else {
            long long kr = row(b, i, Nk, h);
            void *dout = ptr(3);
            const float *lse = static_cast<const float *>(ptr(6)),
                        *delta = static_cast<const float *>(ptr(7));
            std::vector<float> dk(Dh, 0.0f), dv(Dh, 0.0f);
            for (long long j = 0; j < Nq; ++j) {
              long long qr = row(b, j, Nq, h), w = (b * H + h) * Nq + j;
              float p =
                  std::exp(scale * dot(q, t[0], qr, k, t[1], kr) - lse[w]);
              float ds = p * (dot(dout, t[3], qr, v, t[2], kr) - delta[w]);
              for (long long d = 0; d < Dh; ++d) {
                dv[d] += p * loadAs(dout, t[3], qr + d);
                dk[d] += ds * loadAs(q, t[0], qr + d);
              }
            }
            for (long long d = 0; d < Dh; ++d) {
              storeAs(ptr(4), t[4], kr + d, dk[d] * scale);
              storeAs(ptr(5), t[5], kr + d, dv[d]);
            }
          }
        }
      }
  }
};
std::atomic<int64_t> launches{0}, gemms{0};
struct Event {
  std::atomic<int64_t> time{0};
};
/// A generated 3D-DSA kernel (named configName + _fwd/_bwd/_bwd_finalize/
/// _offsets) as the cpu reference with the kernels' argument lists and
/// contracts: the backward adds into the fp32 dK/dV scratch, finalize
/// converts it. Their CUDA versions are checked by DsaKernelEmulationTest
/// and, on a GPU, scripts/dsa_gpu_check.py; this checks how the backend
/// binds them.
struct HostDsa {
  cpu::Dsa3dConfig cfg;
  DType elem = DType::BF16;
  int64_t radius = 0;
  std::string kind;

  static std::optional<HostDsa> parse(const char *name) {
    HostDsa d;
    long long g[3], w[3], t[3], h, hd, r;
    char elem[8] = {}, kind[32] = {};
    if (std::sscanf(name,
                    "dsa3d_g%lldx%lldx%lld_w%lldx%lldx%lld_t%lldx%lldx%lld_h%"
                    "lld_d%lld_%7[a-z0-9]_r%lld_%31s",
                    &g[0], &g[1], &g[2], &w[0], &w[1], &w[2], &t[0], &t[1],
                    &t[2], &h, &hd, elem, &r, kind) != 14)
      return std::nullopt;
    d.cfg.T = g[0];
    d.cfg.Y = g[1];
    d.cfg.X = g[2];
    d.cfg.window = {w[0], w[1], w[2]};
    d.cfg.tile = {t[0], t[1], t[2]};
    d.cfg.heads = h;
    d.cfg.headDim = hd;
    d.elem = std::string(elem) == "f16" ? DType::F16 : DType::BF16;
    d.radius = r;
    d.kind = kind;
    return d;
  }

  void run(unsigned gz, void **args) const {
    auto ptr = [&](int i) { return *reinterpret_cast<void **>(args[i]); };
    cpu::Dsa3dConfig c = cfg;
    c.batch = gz;
    int64_t n = c.batch * c.tokens() * c.heads * c.headDim;
    auto wide = [&](int i) {
      std::vector<float> v(n);
      for (int64_t e = 0; e < n; ++e)
        v[e] = loadAs(ptr(i), elem, e);
      return v;
    };
    auto view = [&](float *p) { return cpu::dsa3dGraphLayout(p, c); };
    auto cview = [&](const float *p) { return cpu::dsa3dGraphLayout(p, c); };
    if (kind == "bwd_finalize") {
      long long count = *reinterpret_cast<long long *>(args[4]);
      for (long long e = 0; e < count; ++e) {
        storeAs(ptr(2), elem, e, static_cast<float *>(ptr(0))[e]);
        storeAs(ptr(3), elem, e, static_cast<float *>(ptr(1))[e]);
      }
      return;
    }
    std::vector<float> q = wide(0), k = wide(1);
    if (kind == "offsets") {
      // Block matching ignores the softmax scale, but dsa3dOffsets requires
      // a valid configuration, scale included (as the cpu backend sets it).
      c.scale = 1.0;
      cpu::dsa3dOffsets(c, cview(q.data()), cview(k.data()), radius,
                        static_cast<int32_t *>(ptr(2)));
      return;
    }
    const int32_t *offsets = static_cast<const int32_t *>(ptr(3));
    std::vector<float> v = wide(2);
    if (kind == "fwd") {
      c.scale = *reinterpret_cast<float *>(args[6]);
      std::vector<float> out(n);
      cpu::dsa3dForward(c, cview(q.data()), cview(k.data()), cview(v.data()),
                        offsets, view(out.data()),
                        static_cast<float *>(ptr(5)));
      for (int64_t e = 0; e < n; ++e)
        storeAs(ptr(4), elem, e, out[e]);
      return;
    }
    // bwd: (q, k, v, offsets, o, dout, lse, dq, dk32, dv32, scale)
    c.scale = *reinterpret_cast<float *>(args[10]);
    std::vector<float> o = wide(4), dout = wide(5), dq(n), dk(n), dv(n);
    cpu::dsa3dBackward(c, cview(q.data()), cview(k.data()), cview(v.data()),
                       offsets, cview(o.data()), cview(dout.data()),
                       static_cast<const float *>(ptr(6)), view(dq.data()),
                       view(dk.data()), view(dv.data()));
    float *dk32 = static_cast<float *>(ptr(8));
    float *dv32 = static_cast<float *>(ptr(9));
    for (int64_t e = 0; e < n; ++e) {
      storeAs(ptr(7), elem, e, dq[e]);
      dk32[e] += dk[e];
      dv32[e] += dv[e];
    }
  }
};

struct Function {
  EmulatedKernels::Entry entry = nullptr;
  std::optional<HostAttention> attention;
  std::optional<HostDsa> dsa;
};

void *allocAligned(size_t n) {
  size_t bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  void *p = std::aligned_alloc(256, bytes);
  if (p)
    std::memset(p, 0xa5, bytes); // not zero: the backend must not rely on it
  return p;
}

CudaDriverApi driver() {
  CudaDriverApi d;
  d.library = "fake";
  d.cuGetErrorString = [](CUresult, const char **s) {
    *s = "fake driver error";
    return CUresult(0);
  };
  d.cuGetErrorName = [](CUresult r, const char **s) {
    *s = r ? "FAKE_ERROR" : "CUDA_SUCCESS";
    return CUresult(0);
  };
  d.cuInit = [](unsigned) { return CUresult(0); };
  d.cuDriverGetVersion = [](int *v) {
    *v = 13000;
    return CUresult(0);
  };
  d.cuDeviceGetCount = [](int *n) {
    *n = 1;
    return CUresult(0);
  };
  d.cuDeviceGet = [](CUdevice *dev, int) {
    *dev = 0;
    return CUresult(0);
  };
  d.cuDeviceGetAttribute = [](int *v, int attr, CUdevice) {
    *v = attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR   ? 9
         : attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? 0
                                                                : 132;
    return CUresult(0);
  };
  d.cuDeviceGetName = [](char *s, int n, CUdevice) {
    std::snprintf(s, n, "fake device");
    return CUresult(0);
  };
  d.cuDevicePrimaryCtxRetain = [](CUcontext *c, CUdevice) {
    *c = reinterpret_cast<CUcontext>(uintptr_t(0x1000));
    return CUresult(0);
  };
  d.cuDevicePrimaryCtxRelease_v2 = [](CUdevice) { return CUresult(0); };
  d.cuCtxSetCurrent = [](CUcontext) { return CUresult(0); };
  d.cuCtxSynchronize = []() { return CUresult(0); };
  d.cuMemGetInfo_v2 = [](size_t *f, size_t *t) {
    *f = *t = size_t(1) << 36;
    return CUresult(0);
  };
  d.cuMemAlloc_v2 = [](CUdeviceptr *p, size_t n) {
    void *q = allocAligned(n);
    *p = reinterpret_cast<CUdeviceptr>(q);
    return CUresult(q ? 0 : 2);
  };
  d.cuMemFree_v2 = [](CUdeviceptr p) {
    std::free(reinterpret_cast<void *>(p));
    return CUresult(0);
  };
  d.cuMemHostAlloc = [](void **p, size_t n, unsigned) {
    *p = allocAligned(n);
    return CUresult(*p ? 0 : 2);
  };
  d.cuMemFreeHost = [](void *p) {
    std::free(p);
    return CUresult(0);
  };
  d.cuMemcpyHtoDAsync_v2 = [](CUdeviceptr dst, const void *src, size_t n,
                              CUstream) {
    std::memcpy(reinterpret_cast<void *>(dst), src, n);
    return CUresult(0);
  };
  d.cuMemcpyDtoHAsync_v2 = [](void *dst, CUdeviceptr src, size_t n, CUstream) {
    std::memcpy(dst, reinterpret_cast<const void *>(src), n);
    return CUresult(0);
  };
  d.cuMemcpyDtoDAsync_v2 = [](CUdeviceptr dst, CUdeviceptr src, size_t n,
                              CUstream) {
    std::memmove(reinterpret_cast<void *>(dst),
                 reinterpret_cast<const void *>(src), n);
    return CUresult(0);
  };
  d.cuMemsetD8Async = [](CUdeviceptr dst, unsigned char v, size_t n, CUstream) {
    std::memset(reinterpret_cast<void *>(dst), v, n);
    return CUresult(0);
  };
  d.cuStreamCreate = [](CUstream *s, unsigned) {
    *s = reinterpret_cast<CUstream>(new char);
    return CUresult(0);
  };
  d.cuStreamDestroy_v2 = [](CUstream s) {
    delete reinterpret_cast<char *>(s);
    return CUresult(0);
  };
  d.cuStreamSynchronize = [](CUstream) { return CUresult(0); };
  d.cuStreamWaitEvent = [](CUstream, CUevent e, unsigned) {
    return CUresult(e ? 0 : 1);
  };
  d.cuEventCreate = [](CUevent *e, unsigned) {
    *e = reinterpret_cast<CUevent>(new Event);
    return CUresult(0);
  };
  d.cuEventDestroy_v2 = [](CUevent e) {
    delete reinterpret_cast<Event *>(e);
    return CUresult(0);
  };
  d.cuEventRecord = [](CUevent e, CUstream) {
    if (!e)
      return CUresult(1);
    reinterpret_cast<Event *>(e)->time = ++clock;
    return CUresult(0);
  };
  d.cuEventSynchronize = [](CUevent e) { return CUresult(e ? 0 : 1); };
  d.cuEventElapsedTime = [](float *ms, CUevent a, CUevent b) {
    *ms = float(reinterpret_cast<Event *>(b)->time -
                reinterpret_cast<Event *>(a)->time) *
          1e-3f;
    return CUresult(0);
  };
  d.cuModuleLoadData = [](CUmodule *m, const void *image) {
    // A cubin is an ELF file.
    if (std::memcmp(image,
                    "\x7f"
                    "ELF",
                    4) != 0)
      return CUresult(200); // CUDA_ERROR_INVALID_IMAGE
    *m = reinterpret_cast<CUmodule>(new char);
    return CUresult(0);
  };
  d.cuModuleUnload = [](CUmodule m) {
    delete reinterpret_cast<char *>(m);
    return CUresult(0);
  };
  d.cuModuleGetFunction = [](CUfunction *f, CUmodule, const char *name) {
    Function fn;
    fn.entry = kernels->entry(name);
    fn.dsa = HostDsa::parse(name);
    if (!fn.entry && !fn.dsa)
      return CUresult(500); // CUDA_ERROR_NOT_FOUND
    llvm::StringRef n(name);
    for (auto [prefix, kind, types] :
         {std::tuple<const char *, int, size_t>{"ms_attention_fwd_", 0, 4},
          {"ms_attention_bwd_dq_", 1, 6},
          {"ms_attention_bwd_dkv_", 2, 6}})
      if (n.starts_with(prefix))
        fn.attention = HostAttention{typesOf(n, types), kind};
    static std::mutex mu;
    static std::vector<std::unique_ptr<Function>> owned;
    std::lock_guard<std::mutex> lock(mu);
    owned.push_back(std::make_unique<Function>(std::move(fn)));
    *f = reinterpret_cast<CUfunction>(owned.back().get());
    return CUresult(0);
  };
  d.cuFuncSetAttribute = [](CUfunction, int, int) { return CUresult(0); };
  d.cuLaunchKernel = [](CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                        unsigned bx, unsigned by, unsigned bz, unsigned smem,
                        CUstream, void **params, void **extra) {
    const Function &fn = *reinterpret_cast<Function *>(f);
    if (!gx || !gy || !gz || !bx || by != 1 || bz != 1 || extra)
      return CUresult(1);
    if (fn.dsa) {
      fn.dsa->run(gz, params);
      ++launches;
      return CUresult(0);
    }
    if (bx != kElementwiseBlockThreads || smem)
      return CUresult(1);
    if (fn.attention)
      fn.attention->run(params);
    else
      fn.entry(gx, gy, gz, params);
    ++launches;
    return CUresult(0);
  };
  return d;
}

struct Desc {
  int32_t transA = 0, transB = 0;
  uint32_t epilogue = 1;
  const void *bias = nullptr;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
constexpr cublasStatus_t kInvalid = 7; // CUBLAS_STATUS_INVALID_VALUE

DType dtypeOf(cudaDataType_t t) {
  return t == CUDA_R_16BF  ? DType::BF16
         : t == CUDA_R_16F ? DType::F16
                           : DType::F32;
}

/// op(A) m x k, op(B) k x n, D m x n, as cuBLASLt reads the layouts.
bool shapesAgree(const Desc &d, const Layout &a, const Layout &b,
                 const Layout &c) {
  uint64_t m = c.rows, n = c.cols, k = d.transA ? a.rows : a.cols;
  return (d.transA ? a.cols : a.rows) == m &&
         (d.transB ? b.cols : b.rows) == k &&
         (d.transB ? b.rows : b.cols) == n && a.type == b.type;
}

CublasLtApi cublasLt() {
  CublasLtApi l;
  l.library = "fake";
  l.cublasLtCreate = [](cublasLtHandle_t *h) {
    *h = reinterpret_cast<cublasLtHandle_t>(new char);
    return cublasStatus_t(0);
  };
  l.cublasLtDestroy = [](cublasLtHandle_t h) {
    delete reinterpret_cast<char *>(h);
    return cublasStatus_t(0);
  };
  l.cublasLtGetVersion = []() { return size_t(130000); };
  l.cublasLtGetStatusName = [](cublasStatus_t) { return "FAKE_STATUS"; };
  l.cublasLtMatmulDescCreate = [](cublasLtMatmulDesc_t *d,
                                  cublasComputeType_t compute,
                                  cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F)
      return kInvalid;
    *d = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulDescDestroy = [](cublasLtMatmulDesc_t d) {
    delete reinterpret_cast<Desc *>(d);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulDescSetAttribute = [](cublasLtMatmulDesc_t dd,
                                        cublasLtMatmulDescAttributes_t attr,
                                        const void *buf, size_t size) {
    Desc &d = *reinterpret_cast<Desc *>(dd);
    if ((attr == CUBLASLT_MATMUL_DESC_TRANSA ||
         attr == CUBLASLT_MATMUL_DESC_TRANSB ||
         attr == CUBLASLT_MATMUL_DESC_EPILOGUE) &&
        size != 4)
      return kInvalid;
    if (attr == CUBLASLT_MATMUL_DESC_TRANSA)
      std::memcpy(&d.transA, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_TRANSB)
      std::memcpy(&d.transB, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_EPILOGUE)
      std::memcpy(&d.epilogue, buf, 4);
    else if (attr == CUBLASLT_MATMUL_DESC_BIAS_POINTER &&
             size == sizeof(void *))
      std::memcpy(&d.bias, buf, sizeof(void *));
    else
      return kInvalid;
    return cublasStatus_t(0);
  };
  l.cublasLtMatrixLayoutCreate = [](cublasLtMatrixLayout_t *out,
                                    cudaDataType_t type, uint64_t rows,
                                    uint64_t cols, int64_t ld) {
    if (ld < static_cast<int64_t>(rows) || ld < 1)
      return kInvalid;
    *out = reinterpret_cast<cublasLtMatrixLayout_t>(
        new Layout{type, rows, cols, ld});
    return cublasStatus_t(0);
  };
  l.cublasLtMatrixLayoutDestroy = [](cublasLtMatrixLayout_t x) {
    delete reinterpret_cast<Layout *>(x);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceCreate = [](cublasLtMatmulPreference_t *p) {
    *p = reinterpret_cast<cublasLtMatmulPreference_t>(new char);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceDestroy = [](cublasLtMatmulPreference_t p) {
    delete reinterpret_cast<char *>(p);
    return cublasStatus_t(0);
  };
  l.cublasLtMatmulPreferenceSetAttribute =
      [](cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t attr,
         const void *buf, size_t size) {
        if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
          return size == 8 ? cublasStatus_t(0) : kInvalid;
        if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
            attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + 3)
          return size == 4 ? cublasStatus_t(0) : kInvalid;
        return kInvalid;
      };
  l.cublasLtMatmulAlgoGetHeuristic =
      [](cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
         cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
         cublasLtMatrixLayout_t dd, cublasLtMatmulPreference_t, int requested,
         cublasLtMatmulHeuristicResult_t *results, int *found) {
        *found = 0;
        if (requested < 1 || c != dd ||
            !shapesAgree(
                *reinterpret_cast<Desc *>(d), *reinterpret_cast<Layout *>(a),
                *reinterpret_cast<Layout *>(b), *reinterpret_cast<Layout *>(c)))
          return cublasStatus_t(0);
        results[0] = {};
        *found = 1;
        return cublasStatus_t(0);
      };
  l.cublasLtMatmul =
      [](cublasLtHandle_t, cublasLtMatmulDesc_t dd, const void *alpha,
         const void *A, cublasLtMatrixLayout_t al, const void *B,
         cublasLtMatrixLayout_t bl, const void *beta, const void *C,
         cublasLtMatrixLayout_t cl, void *D, cublasLtMatrixLayout_t dl,
         const cublasLtMatmulAlgo_t *, void *, size_t, CUstream) {
        const Desc &d = *reinterpret_cast<const Desc *>(dd);
        const Layout &a = *reinterpret_cast<Layout *>(al),
                     &b = *reinterpret_cast<Layout *>(bl),
                     &o = *reinterpret_cast<Layout *>(dl);
        if (*static_cast<const float *>(alpha) != 1.0f ||
            *static_cast<const float *>(beta) != 0.0f || C != D || cl != dl ||
            !shapesAgree(d, a, b, o))
          return kInvalid;
        GemmCall g;
        g.transA = d.transA;
        g.transB = d.transB;
        g.m = o.rows;
        g.n = o.cols;
        g.k = d.transA ? a.rows : a.cols;
        g.lda = a.ld;
        g.ldb = b.ld;
        g.ldd = o.ld;
        g.abType = dtypeOf(a.type);
        g.dType = dtypeOf(o.type);
        g.hasBias = d.epilogue == CUBLASLT_EPILOGUE_BIAS;
        if (g.hasBias && !d.bias)
          return kInvalid;
        naiveGemm(g, A, B, D, d.bias);
        ++gemms;
        return cublasStatus_t(0);
      };
  return l;
}

} // namespace fake

/// Runs `plan` on the fake device against the cpu backend.
void runOnFakeDevice(const exec::ExecPlan &plan,
                     const std::function<exec::StepInputs(int)> &inputs,
                     int steps) {
  std::string why;
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why << " (the backend compiles its kernels first)";
  auto prep = prepareCudaPlan(plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  EmulatedKernels *emu = sharedEmulation(why);
  if (!emu)
    GTEST_SKIP() << why;
  fake::kernels = emu;
  static const CudaDriverApi driver = fake::driver();
  static const CublasLtApi lt = fake::cublasLt();
  CudaOptions options;
  options.driver = &driver;
  options.cublasLt = &lt;
  int64_t launches = fake::launches, gemms = fake::gemms;
  compareWithCpu(plan, inputs, steps, 2e-2, 5e-2, options);
  EXPECT_GT(fake::launches, launches);
  EXPECT_GT(fake::gemms, gemms);
  fake::kernels = nullptr;
}

TEST(CudaBackendFakeDeviceTest, HandBuiltPlanStepsLikeTheCpuBackend) {
  HandBuiltPlan h = handBuiltPlan();
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  runOnFakeDevice(
      h.plan,
      [&](int) {
        exec::StepInputs in;
        for (const char *name : {"latents", "noise"}) {
          std::vector<float> v(2 * 8 * 32);
          for (float &x : v)
            x = normal(rng);
          in[name] = v;
        }
        return in;
      },
      3);
}

class CudaBackendFakeDeviceTinyTest
    : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaBackendFakeDeviceTinyTest, StepsLikeTheCpuBackend) {
  std::string why;
  const exec::ExecPlan *plan = tinyPlan(why, GetParam());
  if (!plan)
    GTEST_SKIP() << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  train::SyntheticData data(*shapes, 5);
  // Two steps (the second runs on AdamW-updated weights) for global
  // attention; one for 3D-DSA, whose binding the first step checks.
  runOnFakeDevice(
      *plan, [&](int) { return llvm::cantFail(data.next()); }, *GetParam() ? 1 : 2);
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, CudaBackendFakeDeviceTinyTest,
                         ::testing::Values("", kTinyDsaFlags));

//===----------------------------------------------------------------------===//
// On a GPU: the cuda backend against the cpu backend
//===----------------------------------------------------------------------===//

TEST(CudaBackendGpuTest, HandBuiltPlanMatchesCpuBackend) {
  std::string why;
  if (!cudaDeviceAvailable(&why))
    GTEST_SKIP() << why;
  HandBuiltPlan h = handBuiltPlan();
  ASSERT_OK(exec::validate(h.plan));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  compareWithCpu(
      h.plan,
      [&](int) {
        exec::StepInputs in;
        for (const char *name : {"latents", "noise"}) {
          std::vector<float> v(2 * 8 * 32);
          for (float &x : v)
            x = normal(rng);
          in[name] = v;
        }
        return in;
      },
      3, 2e-2, 5e-2);
}

/// The compiled tiny model ($MEGASLIDE_CUDA_TEST_PLAN, else compiled here),
/// with global attention and with 3D-DSA (the generated kernels on the
/// GPU): three steps, losses and every gradient against the cpu backend.
class CudaBackendGpuTinyTest : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaBackendGpuTinyTest, MatchesCpuBackend) {
  std::string why;
  if (!cudaDeviceAvailable(&why))
    GTEST_SKIP() << why;
  const exec::ExecPlan *plan = tinyPlan(why, GetParam());
  if (!plan)
    GTEST_SKIP() << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  train::SyntheticData data(*shapes, 5);
  compareWithCpu(
      *plan, [&](int) { return llvm::cantFail(data.next()); }, 3, 3e-2, 1e-1);
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, CudaBackendGpuTinyTest,
                         ::testing::Values("", kTinyDsaFlags));

EmulatedKernels *sharedEmulation(std::string &why) {
  static std::unique_ptr<EmulatedKernels> emu;
  static std::string whyNot;
  static bool built = false;
  if (!built) {
    built = true;
    std::set<KernelInstance> all;
    for (const OpCase &c : denseCases()) {
      auto lowered = lowerGraphOp(c.inst, c.operands, c.results);
      if (!lowered) {
        whyNot = c.label + ": " + llvm::toString(lowered.takeError());
        break;
      }
      for (const KernelInstance &k : kernelsOf(*lowered))
        all.insert(k);
    }
    std::vector<const exec::ExecPlan *> plans;
    HandBuiltPlan h = handBuiltPlan();
    plans.push_back(&h.plan);
    std::string ignored;
    for (const char *flags : {"", kTinyDsaFlags})
      if (const exec::ExecPlan *p = tinyPlan(ignored, flags))
        plans.push_back(p);
    for (const exec::ExecPlan *p : plans)
      if (auto prep = prepareCudaPlan(*p))
        all.insert(prep->kernels.begin(), prep->kernels.end());
      else
        llvm::consumeError(prep.takeError()); // reported by their own tests
    if (whyNot.empty())
      emu = EmulatedKernels::build({all.begin(), all.end()}, whyNot);
  }
  why = whyNot;
  return emu.get();
}

} // namespace
