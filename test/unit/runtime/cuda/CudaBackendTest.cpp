//===- CudaBackendTest.cpp - The cuda backend, with and without a GPU -----===//
//
// Without a GPU (what runs here):
//  * the driver and cuBLASLt symbol tables: a clear error without a driver,
//    every symbol resolved from the toolkit's stub libcuda.so and from
//    libcublasLt, our self-declared ABI constants equal to the CUDA
//    headers' (when a host compiler and the headers exist);
//  * every dense kernel compiles with NVRTC to an sm_90a cubin with no
//    register spills (skips without NVRTC); the tensor-core attention
//    kernels of the 105B cross-attention also have HMMA and no atomics in
//    their SASS (skips that part without cuobjdump);
//  * 16-bit attention lowers to the tensor-core kernels, which match the
//    cpu kernels in emulation (cross-attention, tails, head dims 16 to 128,
//    forward lse; AttentionOnTensorCoresMatchesCpuKernels);
//  * every lowered graph op computes what the cpu kernel computes: the
//    generated CUDA C++ is compiled with the host compiler against a small
//    emulation of the CUDA execution model (support/CudaEmulation.h:
//    threads as fibers, warp shuffles and barriers as rendezvous),
//    cuBLASLt GEMMs by a naive
//    column-major GEMM, and compared with cpu::findGraphKernel within bf16
//    rounding (skips without a host compiler);
//  * preparation of a hand-built plan: lowering, pools, cross-stream
//    write-after-read waits; create() says why there is no GPU;
//  * the whole backend on an asynchronous fake device (FakeCuda.h): the
//    hand-built and the saved tiny plans (TestPlans.h; global attention
//    and 3D-DSA) match the cpu backend, the tiny ones under 50 orderings
//    of the streams, with no race, unwritten read or spinning host wait;
//    a plan with a wait deleted is caught; failing driver calls fail the
//    step cleanly and cancel the host updates still queued.
// With a GPU (skipped here): the hand-built plan and the saved tiny plans
// step on the cuda backend and match the cpu backend: losses and
// gradients.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackend.h"
#include "megaslide/runtime/cpu/AdamW.h"
#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/CpuBackend.h"
#include "megaslide/runtime/cpu/Dsa3d.h"
#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/cpu/HalfFloat.h"
#include "megaslide/runtime/cuda/CudaApi.h"
#include "megaslide/runtime/cuda/ElementwiseKernels.h"
#include "megaslide/runtime/cuda/GraphOpLowering.h"
#include "megaslide/runtime/cuda/Nvrtc.h"
#include "megaslide/runtime/plan/Validate.h"
#include "megaslide/runtime/train/SyntheticData.h"

#include "megaslide/Testing/CudaEmulation.h"
#include "megaslide/Testing/FakeCuda.h"
#include "megaslide/Testing/TestPlans.h"

#include "llvm/ADT/StringExtras.h"
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
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include <dlfcn.h>
#include <unistd.h>

using namespace megaslide;
using namespace megaslide::cuda;
using exec::DType;
using exec::TensorType;
namespace fs = std::filesystem;

namespace {

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
  std::printf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %zu %zu\n",
    (int)CUBLAS_COMPUTE_32F, (int)CUDA_R_32F, (int)CUDA_R_16F, (int)CUDA_R_16BF,
    (int)CUBLAS_OP_N, (int)CUBLAS_OP_T, (int)CUBLASLT_MATMUL_DESC_TRANSA,
    (int)CUBLASLT_MATMUL_DESC_TRANSB, (int)CUBLASLT_MATMUL_DESC_EPILOGUE,
    (int)CUBLASLT_MATMUL_DESC_BIAS_POINTER, (int)CUBLASLT_EPILOGUE_BIAS,
    (int)CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
    (int)CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
    (int)CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    (int)CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    (int)CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    (int)CU_EVENT_DISABLE_TIMING, (int)CU_EVENT_BLOCKING_SYNC,
    (int)CU_STREAM_NON_BLOCKING,
    (int)CU_MEMHOSTALLOC_PORTABLE, sizeof(cublasLtMatmulAlgo_t),
    sizeof(cublasLtMatmulHeuristicResult_t));
}
)";
  std::string cmd =
      test::hostCompiler() + " -std=c++17 -I" + include + " -o '" +
      (dir / "abi").string() + "' '" + (dir / "abi.cpp").string() + "' > '" +
      (dir / "cc.log").string() + "' 2>&1 && '" + (dir / "abi").string() +
      "' > '" + (dir / "out.txt").string() + "'";
  if (std::system(cmd.c_str()) != 0)
    GTEST_SKIP() << "cannot build against the CUDA headers:\n"
                 << readFile(dir / "cc.log");
  std::string expected = llvm::formatv(
      "{0} {1} {2} {3} {4} {5} {6} {7} {8} {9} {10} {11} {12} {13} {14} {15} "
      "{16} {17} {18} {19} 64 96\n",
      CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUBLAS_OP_N,
      CUBLAS_OP_T, CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB,
      CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
      CUBLASLT_EPILOGUE_BIAS, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
      CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
      CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_EVENT_DISABLE_TIMING,
      CU_EVENT_BLOCKING_SYNC, CU_STREAM_NON_BLOCKING, CU_MEMHOSTALLOC_PORTABLE);
  EXPECT_EQ(readFile(dir / "out.txt"), expected);
  fs::remove_all(dir);
}

TEST(CudaApiTest, NcclResolvesEverySymbol) {
  auto nccl = loadNccl();
  if (!nccl)
    GTEST_SKIP() << llvm::toString(nccl.takeError());
#define MEGASLIDE_CHECK(name, ret, ...)                                        \
  EXPECT_NE((*nccl)->name, nullptr) << #name;
  MEGASLIDE_NCCL_SYMBOLS(MEGASLIDE_CHECK)
#undef MEGASLIDE_CHECK
  int version = 0;
  ASSERT_EQ((*nccl)->ncclGetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 21800);
  std::string msg = llvm::toString(checkNccl(**nccl, 2, "ncclCommInitRank"));
  EXPECT_EQ(msg.find("ncclCommInitRank: NCCL error 2 ("), 0u) << msg;
  EXPECT_FALSE(checkNccl(**nccl, ncclSuccess, "x"));
}

TEST(CudaApiTest, NcclAbiMatchesItsHeader) {
  static_assert(sizeof(ncclUniqueId) == 128);
  auto nccl = loadNccl();
  if (!nccl)
    GTEST_SKIP() << llvm::toString(nccl.takeError());
  // The header beside the library that was loaded (.../lib/libnccl.so.2:
  // .../include/nccl.h), as the wheel and the toolkit lay them out.
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void *>((*nccl)->ncclGetVersion), &info),
            0);
  fs::path include =
      fs::path(info.dli_fname).parent_path().parent_path() / "include";
  if (!fs::exists(include / "nccl.h"))
    GTEST_SKIP() << "no nccl.h beside " << info.dli_fname;
  fs::path dir = freshDir("megaslide-nccl-abi");
  std::ofstream(dir / "abi.cpp") << R"(
#include <nccl.h>
#include <cstdio>
int main() {
  std::printf("%d %d %d %d %d %d %zu\n", (int)ncclSuccess, (int)ncclInProgress,
    (int)ncclFloat16, (int)ncclFloat32, (int)ncclBfloat16, (int)ncclSum,
    sizeof(ncclUniqueId));
}
)";
  std::string cmd =
      test::hostCompiler() + " -std=c++17 -I'" + include.string() +
      "' -I/usr/local/cuda/include -o '" + (dir / "abi").string() + "' '" +
      (dir / "abi.cpp").string() + "' > '" + (dir / "cc.log").string() +
      "' 2>&1 && '" + (dir / "abi").string() + "' > '" +
      (dir / "out.txt").string() + "'";
  if (std::system(cmd.c_str()) != 0)
    GTEST_SKIP() << "cannot build against nccl.h:\n"
                 << readFile(dir / "cc.log");
  EXPECT_EQ(readFile(dir / "out.txt"),
            llvm::formatv("{0} {1} {2} {3} {4} {5} 128\n", ncclSuccess,
                          ncclInProgress, ncclFloat16, ncclFloat32,
                          ncclBfloat16, ncclSum)
                .str());
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
    EXPECT_GE(occupancySm90(k, kernelBlockThreads(k.kernel)).blocksPerSm, 1)
        << k.kernel;
  }
}

//===----------------------------------------------------------------------===//
// Host emulation of the generated kernels
//===----------------------------------------------------------------------===//

/// What the dense kernels take from inline PTX in their CUDA build, put
/// after the CUDA execution model (support/CudaEmulation.h).
constexpr const char *kDenseEmulation = R"emu(
#define MS_HOST_EMULATION 1
inline float msHalfToFloat(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short msFloatToHalf(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }

// The tensor-core attention kernels' primitives
// (runtime/cuda/device/Attention.cuh), after
// test/unit/lib/Target/Cuda/DsaKernelsTest.cpp's: mma.sync as a warp
// rendezvous computing the 16x16x8 product in fp32 from the lanes'
// fragments, ldmatrix from the 32 lanes' row pointers, cp.async as a copy.
inline unsigned short emuBf16(float f) {
  unsigned u = __float_as_uint(f);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float emuFromBf16(unsigned short h) { return __uint_as_float(unsigned(h) << 16); }
inline unsigned msPackBf16x2(float lo, float hi) { return emuBf16(lo) | unsigned(emuBf16(hi)) << 16; }
inline unsigned msPackF16x2(float lo, float hi) { return msFloatToHalf(lo) | unsigned(msFloatToHalf(hi)) << 16; }

inline void msMmaBf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { emu::mma16816<emuFromBf16>(c, a, b0, b1); }
inline void msMmaF16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) { emu::mma16816<msHalfToFloat>(c, a, b0, b1); }
inline void msLdsm4(unsigned r[4], const void *p) { emu::ldsm<false>(r, p); }
inline void msLdsm4T(unsigned r[4], const void *p) { emu::ldsm<true>(r, p); }
inline void msCpAsync16(void *dst, const void *src, int bytes) { emu::cpAsync16(dst, src, bytes); }
inline void msCpAsync4(void *dst, const void *src) { emu::cpAsync(dst, src, 4, 4); }
inline void msCpAsyncCommit() {}
template <int Pending> inline void msCpAsyncWait() {}
inline float msExp2(float x) { return std::exp2(x); }
)emu";

/// The generated kernels built for the host, with one C entry point per
/// instance: emu_<name>(grid x, y, z, argument pointers). They declare
/// their shared memory statically, so they launch with no dynamic shared
/// memory (FakeCuda refuses any).
class EmulatedKernels {
public:
  static std::unique_ptr<EmulatedKernels>
  build(const std::vector<KernelInstance> &kernels, std::string &why) {
    static int builds = 0;
    fs::path dir = freshDir("megaslide-dense-emu" + std::to_string(builds++));
    std::string source = std::string(test::kCudaEmulationPrelude) +
                         kDenseEmulation + emitElementwiseSource(kernels);
    for (const KernelInstance &k : kernels) {
      std::vector<std::string> types = kernelParameterTypes(k);
      source += "extern \"C\" __attribute__((visibility(\"default\"))) void "
                "emu_" +
                k.name() +
                "(unsigned gx, unsigned gy, unsigned gz, void **args) {\n"
                "  emu::launch(\"" +
                k.name() + "\", {gx, gy, gz}, " +
                std::to_string(kernelBlockThreads(k.name())) + ", 0, [&] { " +
                k.name() + "(";
      for (size_t i = 0; i < types.size(); ++i)
        source += (i ? ", " : "") + std::string("*reinterpret_cast<") +
                  types[i] + "*>(args[" + std::to_string(i) + "])";
      source += "); });\n}\n";
    }
    void *handle = test::buildHostLibrary(source, dir, "dense", why);
    if (!handle)
      return nullptr;
    auto e = std::unique_ptr<EmulatedKernels>(new EmulatedKernels);
    e->handle = handle;
    e->dir = dir;
    for (const KernelInstance &k : kernels)
      e->params[k.name()] = kernelParameterTypes(k).size();
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
  /// The fake device's view of kernel `name`.
  fake::HostKernel hostKernel(const std::string &name) {
    auto it = params.find(name);
    return it == params.end() ? fake::HostKernel{}
                              : fake::HostKernel{entry(name), it->second};
  }

private:
  EmulatedKernels() = default;
  void *handle = nullptr;
  fs::path dir;
  std::map<std::string, size_t> params;
};

/// A tensor in its stored dtype.
struct Buffer {
  TensorType type;
  std::vector<uint8_t> bytes;
};

using fake::loadAs;
using fake::naiveGemm;
using fake::storeAs;

std::vector<float> widened(const Buffer &b) {
  std::vector<float> out(b.type.numElements());
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = loadAs(b.bytes.data(), b.type.dtype, i);
  return out;
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
      return operands[r.index].bytes.data() + r.offset;
    case BufferRef::Result:
      return results[r.index].bytes.data() + r.offset;
    case BufferRef::Scratch:
      return scratchBase + r.index + r.offset;
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
  inst.op = exec::parseOpCode(op).value();
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
  // Wan's image embedder: the erf GELU (kernels gelu_exact[_grad]).
  add("gelu exact", makeInst("gelu", {{"exact", int64_t(1)}}), {tt(f32, {300})},
      {tt(f32, {300})});
  add("gelu_grad exact", makeInst("gelu_grad", {{"exact", int64_t(1)}}),
      {tt(f32, {300}), tt(f32, {300})}, {tt(f32, {300})});
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
  add("split unequal", makeInst("split"), {tt(bf, {2, 3, 48})},
      {tt(bf, {2, 3, 7}), tt(bf, {2, 3, 41})});
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
  // The 105B preset's positions (21 latent frames, 80 patch columns) and
  // head dim: the fp32 angles against the cpu kernel's double ones.
  add("rope3d 105B positions",
      makeInst("rope3d", {{"grid", V{21, 1, 80}}, {"dims", V{44, 42, 42}}}),
      {tt(f32, {1, 1680, 1, 128})}, {tt(f32, {1, 1680, 1, 128})});
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
  // Weighted (per-sample fp32 weights): the loss and the unweighted one.
  add("flow_matching_loss weighted", makeInst("flow_matching_loss"),
      {tt(bf, {2, 4, 2, 4, 4}), tt(bf, {2, 3, 2, 4, 4}),
       tt(bf, {2, 3, 2, 4, 4}), tt(f32, {2})},
      {tt(f32, {}), tt(f32, {})});
  add("flow_matching_loss_grad weighted", makeInst("flow_matching_loss_grad"),
      {tt(bf, {2, 4, 2, 2, 2}), tt(bf, {2, 3, 2, 2, 2}),
       tt(bf, {2, 3, 2, 2, 2}), tt(f32, {2})},
      {tt(bf, {2, 4, 2, 2, 2})});
  return c;
}

/// Random operands: normal floats, ids in range, timesteps in [0, 1], loss
/// weights in [0.5, 4) (far from 1, so an ignored weight shows).
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
      else if (c.inst.op == exec::OpCode::TimestepEmbedding ||
               (c.inst.op == exec::OpCode::FlowInterpolate && i == 2))
        v = unit(rng);
      else if ((c.inst.op == exec::OpCode::FlowMatchingLoss ||
                c.inst.op == exec::OpCode::FlowMatchingLossGrad) &&
               i == 3)
        v = 0.5f + 3.5f * unit(rng);
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
      ADD_FAILURE() << "no cpu kernel for " << exec::opName(c.inst.op);
      continue;
    }
    std::vector<Buffer> operands;
    fillOperands(c, rng, operands);
    if (c.inst.op == exec::OpCode::AttentionGrad) {
      // The output operand: the forward of q, k, v (the kernels' delta
      // uses it).
      cpu::GraphKernel fwd = cpu::findGraphKernel(exec::OpCode::Attention);
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

//===----------------------------------------------------------------------===//
// Global attention on tensor cores (runtime/cuda/device/Attention.cuh)
//===----------------------------------------------------------------------===//

/// A global-attention shape the tensor-core kernels must handle: cross-
/// attention (Nq != Nk), tails (neither a multiple of 64), several heads,
/// batch 2, head dims 16, 64 and 128 and a padded 72 (DiT-XL/2), bf16 and
/// f16 inputs, 16-bit and f32 outputs.
struct AttentionTcCase {
  int64_t B, Nq, Nk, H, Dh;
  DType in, out;
};

std::vector<AttentionTcCase> attentionTcCases() {
  const DType bf = DType::BF16, f16 = DType::F16, f32 = DType::F32;
  return {{2, 80, 24, 3, 16, bf, bf},
          {2, 80, 24, 2, 64, bf, f32},
          {2, 70, 100, 2, 128, bf, bf},
          {1, 65, 33, 2, 64, f16, f16},
          {2, 40, 70, 2, 72, bf, bf}};
}

/// attention and attention_grad of a case, with the operand and result
/// types lowerGraphOp gets.
std::pair<OpCase, OpCase> attentionTcOps(const AttentionTcCase &c) {
  TensorType q = tt(c.in, {c.B, c.Nq, c.H, c.Dh});
  TensorType kv = tt(c.in, {c.B, c.Nk, c.H, c.Dh});
  TensorType o = tt(c.out, {c.B, c.Nq, c.H, c.Dh});
  TensorType dkv = tt(c.out, {c.B, c.Nk, c.H, c.Dh});
  OpCase fwd{"attention", makeInst("attention"), {q, kv, kv}, {o}};
  OpCase bwd{"attention_grad",
             makeInst("attention_grad"),
             {q, kv, kv, tt(c.in, q.shape), q},
             {o, dkv, dkv}};
  return {fwd, bwd};
}

TEST(CudaDenseLoweringTest, AttentionPicksTensorCoresFor16BitInputs) {
  auto kinds = [](const exec::Instruction &inst, std::vector<TensorType> ops,
                  std::vector<TensorType> res) {
    auto lowered = lowerGraphOp(inst, ops, res);
    EXPECT_TRUE(!!lowered);
    std::vector<std::string> out;
    if (lowered)
      for (const KernelInstance &k : kernelsOf(*lowered))
        out.push_back(k.kind);
    else
      llvm::consumeError(lowered.takeError());
    return out;
  };
  const DType bf = DType::BF16, f32 = DType::F32;
  using S = std::vector<std::string>;
  TensorType q = tt(bf, {1, 75600, 96, 128}), kv = tt(bf, {1, 512, 96, 128});
  EXPECT_EQ(kinds(makeInst("attention"), {q, kv, kv}, {q}),
            S{"attention_fwd_tc128"});
  EXPECT_EQ(kinds(makeInst("attention_grad"), {q, kv, kv, q, q}, {q, kv, kv}),
            (S{"attention_bwd_dq_tc128", "attention_bwd_dkv_tc128"}));
  // fp32 inputs, a head dim that is not a multiple of 8 or over 128,
  // mixed input types: the scalar kernels.
  TensorType q32 = tt(f32, {1, 6, 2, 64});
  EXPECT_EQ(kinds(makeInst("attention"), {q32, q32, q32}, {q32}),
            S{"attention_fwd"});
  TensorType q36 = tt(bf, {1, 6, 2, 36}), q256 = tt(bf, {1, 6, 2, 256});
  EXPECT_EQ(kinds(makeInst("attention"), {q36, q36, q36}, {q36}),
            S{"attention_fwd"});
  // DiT-XL/2's head dim 72: zero-padded to 80 inside the kernel.
  TensorType q72 = tt(bf, {1, 6, 2, 72});
  EXPECT_EQ(kinds(makeInst("attention"), {q72, q72, q72}, {q72}),
            S{"attention_fwd_tc72"});
  EXPECT_EQ(kinds(makeInst("attention"), {q256, q256, q256}, {q256}),
            S{"attention_fwd"});
  TensorType q64 = tt(bf, {1, 6, 2, 64});
  EXPECT_EQ(kinds(makeInst("attention"), {q64, q32, q64}, {q64}),
            S{"attention_fwd"});
  // One CTA per 64 rows of one (head, sample), 128 threads.
  auto lowered = lowerGraphOp(makeInst("attention"), {q, kv, kv}, {q});
  ASSERT_TRUE(!!lowered);
  const auto &l = std::get<KernelLaunch>(lowered->steps[0]);
  EXPECT_EQ(l.grid, (std::array<uint32_t, 3>{1182, 96, 1}));
  EXPECT_EQ(kernelBlockThreads(l.kernel.name()), 128u);
  EXPECT_EQ(kernelBlockThreads("ms_attention_fwd_bf16_bf16_bf16_bf16"), 256u);
}

TEST_F(CudaDenseEmulationTest, AttentionOnTensorCoresMatchesCpuKernels) {
  if (!emu)
    GTEST_SKIP() << whyNot;
  std::mt19937 rng(11);
  for (const AttentionTcCase &c : attentionTcCases()) {
    SCOPED_TRACE(llvm::formatv("B {0} Nq {1} Nk {2} H {3} Dh {4} {5}->{6}", c.B,
                               c.Nq, c.Nk, c.H, c.Dh, exec::dtypeName(c.in),
                               exec::dtypeName(c.out))
                     .str());
    auto [fwd, bwd] = attentionTcOps(c);
    // Inputs rounded to their 16-bit type; the references (cpu kernels in
    // fp32, lse in fp64) read the same rounded values.
    std::vector<Buffer> ops;
    fillOperands(bwd, rng, ops); // q, k, v, o (overwritten), dout
    std::vector<std::vector<float>> wide;
    for (const Buffer &b : ops)
      wide.push_back(widened(b));
    auto cpuRun = [&](const OpCase &op, std::vector<int> in, size_t nres) {
      std::vector<cpu::OpTensor> ts;
      for (int i : in)
        ts.push_back({ops[i].type, wide[i].data()});
      std::vector<std::vector<float>> out;
      for (size_t r = 0; r < nres; ++r)
        out.emplace_back(op.results[r].numElements());
      std::vector<cpu::OpTensor> rs;
      for (size_t r = 0; r < nres; ++r)
        rs.push_back({op.results[r], out[r].data()});
      llvm::Error err = cpu::findGraphKernel(op.inst.op)(op.inst, ts, rs);
      EXPECT_FALSE(!!err) << llvm::toString(std::move(err));
      return out;
    };
    // The forward on tensor cores, with the lse the plans leave null.
    auto lowered = lowerGraphOp(fwd.inst, fwd.operands, fwd.results);
    ASSERT_TRUE(!!lowered) << llvm::toString(lowered.takeError());
    ASSERT_EQ(lowered->steps.size(), 1u);
    auto &launch = std::get<KernelLaunch>(lowered->steps[0]);
    ASSERT_EQ(launch.kernel.kind, "attention_fwd_tc" + std::to_string(c.Dh));
    launch.args[4] = KernelArg::buf(BufferRef::result(1));
    TensorType lseType = tt(DType::F32, {c.B, c.H, c.Nq});
    std::vector<Buffer> fwdOps(ops.begin(), ops.begin() + 3);
    std::vector<Buffer> fwdRes = {
        {fwd.results[0], std::vector<uint8_t>(fwd.results[0].bytes(), 0xff)},
        {lseType, std::vector<uint8_t>(lseType.bytes(), 0xff)}};
    runLowered(*lowered, *emu, fwdOps, fwdRes);

    // The backward's o operand: the cpu forward, rounded to its type.
    std::vector<float> oRef = cpuRun(fwd, {0, 1, 2}, 1)[0];
    for (size_t e = 0; e < oRef.size(); ++e)
      storeAs(ops[3].bytes.data(), ops[3].type.dtype, e, oRef[e]);
    wide[3] = widened(ops[3]);
    std::vector<std::vector<float>> gradRef = cpuRun(bwd, {0, 1, 2, 3, 4}, 3);
    auto blowered = lowerGraphOp(bwd.inst, bwd.operands, bwd.results);
    ASSERT_TRUE(!!blowered) << llvm::toString(blowered.takeError());
    ASSERT_EQ(kernelsOf(*blowered).size(), 2u);
    EXPECT_EQ(kernelsOf(*blowered)[0].kind,
              "attention_bwd_dq_tc" + std::to_string(c.Dh));
    std::vector<Buffer> bwdRes;
    for (const TensorType &t : bwd.results)
      bwdRes.push_back({t, std::vector<uint8_t>(t.bytes(), 0xff)});
    runLowered(*blowered, *emu, ops, bwdRes);

    // lse in fp64 from the rounded inputs.
    std::vector<double> lseRef(c.B * c.H * c.Nq);
    double scale = 1.0 / std::sqrt(double(c.Dh));
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.Nq; ++i) {
          std::vector<double> s(c.Nk);
          double m = -INFINITY, l = 0;
          for (int64_t j = 0; j < c.Nk; ++j) {
            double d = 0;
            for (int64_t x = 0; x < c.Dh; ++x)
              d += double(wide[0][((b * c.Nq + i) * c.H + h) * c.Dh + x]) *
                   wide[1][((b * c.Nk + j) * c.H + h) * c.Dh + x];
            s[j] = d * scale;
            m = std::max(m, s[j]);
          }
          for (double x : s)
            l += std::exp(x - m);
          lseRef[(b * c.H + h) * c.Nq + i] = m + std::log(l);
        }

    // MS_ATT_TC_VERBOSE=1 prints the worst errors next to the tolerances.
    // Tolerances, relative to max(1, max |reference|): a 16-bit output is
    // one rounding (2^-8 for bf16) from the fp32 reference; on top, the
    // kernels round P (forward) and dS (dQ, dK) to the input type before
    // their second product, an error of 2^-9 relative per term that
    // averages over the keys (measured below 4e-3 for these shapes). lse
    // is fp32 from fp32 sums of 16-bit products: 1e-5 absolute on values
    // of order 1 to 5 (measured 6e-7).
    auto compare = [&](const char *what, const std::vector<float> &got,
                       const std::vector<float> &want, DType stored) {
      float ref = 1.0f;
      for (float w : want)
        ref = std::max(ref, std::fabs(w));
      float tol = (stored == DType::F32 ? 6e-3f : 1.5e-2f) * ref;
      float worst = 0;
      size_t at = 0;
      for (size_t e = 0; e < want.size(); ++e) {
        float err = std::fabs(got[e] - want[e]);
        if (!(err <= worst)) {
          worst = err;
          at = e;
        }
      }
      if (std::getenv("MS_ATT_TC_VERBOSE"))
        std::printf("%s worst %g tol %g ref %g\n", what, worst, tol, ref);
      EXPECT_LE(worst, tol) << what << " element " << at << ": got " << got[at]
                            << ", cpu " << want[at];
    };
    compare("O", widened(fwdRes[0]), oRef, c.out);
    std::vector<float> lseGot = widened(fwdRes[1]);
    double lseWorst = 0;
    for (size_t e = 0; e < lseRef.size(); ++e) {
      ASSERT_TRUE(std::isfinite(lseGot[e])) << "lse element " << e;
      lseWorst = std::max(lseWorst, std::fabs(lseGot[e] - lseRef[e]));
    }
    if (std::getenv("MS_ATT_TC_VERBOSE"))
      std::printf("lse worst %g\n", lseWorst);
    EXPECT_LE(lseWorst, 1e-5) << "lse";
    const char *names[] = {"dQ", "dK", "dV"};
    for (int r = 0; r < 3; ++r)
      compare(names[r], widened(bwdRes[r]), gradRef[r], c.out);
  }
}

/// cuobjdump: $MEGASLIDE_CUOBJDUMP, on PATH, or in the nvidia-cuda-cuobjdump
/// wheel of python3 (as test/lit.cfg.py finds it); empty when absent.
std::string findCuobjdump() {
  if (const char *env = std::getenv("MEGASLIDE_CUOBJDUMP"))
    return env;
  auto run = [](const std::string &cmd) {
    std::string out;
    if (FILE *p = popen(cmd.c_str(), "r")) {
      char buf[512];
      while (fgets(buf, sizeof buf, p))
        out += buf;
      pclose(p);
    }
    return llvm::StringRef(out).trim().str();
  };
  std::string path = run("command -v cuobjdump 2>/dev/null");
  if (path.empty())
    path = run("python3 -c \"import glob, os, nvidia; print(next(iter(sorted("
               "p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "
               "'*', 'bin', 'cuobjdump')))), ''))\" 2>/dev/null");
  return !path.empty() && fs::exists(path) ? path : "";
}

TEST(CudaKernelsTest, AttentionOnTensorCoresCompilesToMmaWithoutSpills) {
  std::string why;
  if (!nvrtcAvailable(&why))
    GTEST_SKIP() << why;
  // The kernels of the 105B plan's cross-attention (75,600 video tokens x
  // 512 text keys, 96 heads x 128) and the same at head dim 64; shapes are
  // kernel arguments, so these are the cubins that shape runs.
  std::set<KernelInstance> set;
  const DType bf = DType::BF16;
  for (int64_t Dh : {64, 128}) {
    TensorType q = tt(bf, {1, 75600, 96, Dh}), kv = tt(bf, {1, 512, 96, Dh});
    for (auto [op, ops, res] :
         {std::tuple<const char *, std::vector<TensorType>,
                     std::vector<TensorType>>{"attention", {q, kv, kv}, {q}},
          {"attention_grad", {q, kv, kv, q, q}, {q, kv, kv}}}) {
      auto lowered = lowerGraphOp(makeInst(op), ops, res);
      ASSERT_TRUE(!!lowered) << llvm::toString(lowered.takeError());
      for (const KernelInstance &k : kernelsOf(*lowered))
        set.insert(k);
    }
  }
  std::vector<KernelInstance> kernels(set.begin(), set.end());
  ASSERT_EQ(kernels.size(), 6u);
  CompileResult r = compileCuda(emitElementwiseSource(kernels),
                                "megaslide_attention_tc.cu", "sm_90a");
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_GT(r.cubin.size(), 0u);
  std::vector<KernelResources> res = parsePtxasLog(r.log);
  ASSERT_EQ(res.size(), kernels.size()) << r.log;
  for (const KernelResources &k : res) {
    Occupancy occ = occupancySm90(k, kAttentionTcBlockThreads);
    // The figures docs/Runtime.md ("Attention on tensor cores") quotes.
    std::printf("%s: %d registers, %d bytes smem, %d spill stores, %d spill "
                "loads, %d blocks (%d warps) per SM, limited by %s\n",
                k.kernel.c_str(), k.registers, k.sharedBytes, k.spillStores,
                k.spillLoads, occ.blocksPerSm, occ.warpsPerSm,
                occ.limiter.c_str());
    EXPECT_EQ(k.spillStores, 0) << k.kernel;
    EXPECT_EQ(k.spillLoads, 0) << k.kernel;
    EXPECT_EQ(k.stackBytes, 0) << k.kernel;
    EXPECT_LE(k.sharedBytes, 48 * 1024) << k.kernel; // static: no opt-in
    EXPECT_GE(occ.blocksPerSm, 2) << k.kernel;
  }

  // The dK/dV kernels stage each chunk's lse and delta with 4-byte
  // cp.async in the rows' commit group, not with loads the CTA waits for:
  // no fp32 global load (lse and delta are their only fp32 inputs).
  size_t dkv = 0;
  for (size_t at = r.ptx.find(".entry ms_attention_bwd_dkv_");
       at != std::string::npos;
       at = r.ptx.find(".entry ms_attention_bwd_dkv_", at + 1)) {
    std::string body = r.ptx.substr(at, r.ptx.find(".entry ", at + 1) - at);
    SCOPED_TRACE(body.substr(0, body.find('(')));
    auto count = [&](const char *what) {
      size_t n = 0;
      for (size_t i = body.find(what); i != std::string::npos;
           i = body.find(what, i + 1))
        ++n;
      return n;
    };
    ++dkv;
    EXPECT_GE(count("cp.async.ca.shared.global"), 2u);
    EXPECT_EQ(count("cp.async.ca.shared.global"), count("], 4;"));
    EXPECT_EQ(count("ld.global.nc.f32") + count("ld.global.f32"), 0u);
  }
  EXPECT_EQ(dkv, 2u);

  // The SASS: HMMA on bf16 with fp32 accumulation, ldmatrix (LDSM) and
  // cp.async (LDGSTS) everywhere; no global or shared atomics or
  // reductions (RED, ATOM) in any kernel, the backward ones included.
  std::string cuobjdump = findCuobjdump();
  if (cuobjdump.empty())
    GTEST_SKIP() << "cuobjdump not found (pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm, scripts/requirements-test.txt)";
  fs::path dir = freshDir("megaslide-attention-sass");
  {
    std::ofstream out(dir / "attention.cubin", std::ios::binary);
    out.write(r.cubin.data(), r.cubin.size());
  }
  std::string cmd = "'" + cuobjdump + "' -sass '" +
                    (dir / "attention.cubin").string() + "' 2>&1";
  std::string sass;
  if (FILE *p = popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0)
      sass.append(buf, n);
    pclose(p);
  }
  fs::remove_all(dir);
  // Per function: "Function : <name>" up to the next one.
  std::map<std::string, std::string> bodies;
  llvm::StringRef rest(sass);
  while (true) {
    size_t at = rest.find("Function : ");
    if (at == llvm::StringRef::npos)
      break;
    rest = rest.drop_front(at + 11);
    llvm::StringRef name = rest.take_until([](char ch) { return ch == '\n'; });
    size_t next = rest.find("Function : ");
    bodies[name.trim().str()] = rest.take_front(next).str();
  }
  ASSERT_EQ(bodies.size(), kernels.size()) << sass.substr(0, 2000);
  for (const auto &[name, body] : bodies) {
    SCOPED_TRACE(name);
    EXPECT_NE(body.find("HMMA.16816.F32.BF16"), std::string::npos);
    EXPECT_NE(body.find("LDSM.16.M88.4"), std::string::npos);
    EXPECT_NE(body.find("LDGSTS.E.BYPASS.128"), std::string::npos);
    for (const char *atomic : {" RED", " REDG", " ATOM", " ATOMG", " ATOMS"})
      EXPECT_EQ(body.find(atomic), std::string::npos) << atomic;
  }
}

TEST(CudaDenseLoweringTest, EveryGraphOpButDsaHasALowering) {
  // The 3D-DSA ops run the plan's generated modules instead.
  using exec::OpCode;
  for (OpCode op : exec::kAllOpCodes) {
    bool dsa = op == OpCode::Dsa3d || op == OpCode::Dsa3dGrad ||
               op == OpCode::Dsa3dOffsets;
    EXPECT_EQ(hasGraphOpLowering(op), !exec::isScheduleOp(op) && !dsa)
        << exec::opName(op);
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
    i.op = exec::parseOpCode(op).value();
    i.stream = s;
    i.operands = std::move(ops);
    i.results = std::move(res);
    p.instructions.push_back(i);
    return static_cast<int64_t>(p.instructions.size() - 1);
  };
  auto event = [&](exec::Stream from, exec::Stream to) {
    exec::Instruction r;
    r.op = exec::OpCode::Record;
    r.stream = from;
    r.event = p.numEvents++;
    p.instructions.push_back(r);
    exec::Instruction w;
    w.op = exec::OpCode::Wait;
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
  // Three fetches (w1, b1, w2) of at most 4 KiB, none in a layer: room
  // for two.
  EXPECT_EQ(prep->fetches.size(), 3u);
  EXPECT_NE(std::find(prep->fetches.begin(), prep->fetches.end(), h.fetchW2),
            prep->fetches.end());
  EXPECT_EQ(prep->stagingBytes, 2 * 4096);
  EXPECT_LE(prep->arenaHighWater, h.plan.arenaBytes);
  EXPECT_GT(prep->arenaHighWater, h.plan.arenaBytes - 256);
  // Inputs and the four host values each have their own pinned bytes.
  EXPECT_FALSE(prep->hostPoolShared);
  EXPECT_EQ(prep->hostPoolBytes, 4096 + 4096 + 256 + 256);
}

TEST(CudaBackendTest, SharedHostPoolPutsGradientsInTheRing) {
  HandBuiltPlan h = handBuiltPlan();
  CudaOptions options;
  options.hostPoolNoReuseBytes = 0; // force sharing
  auto prep = prepareCudaPlan(h.plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  EXPECT_TRUE(prep->hostPoolShared);
  // The three gradients (no layer: one group) fill one ring slot; the
  // loss follows the ring. Nothing shares, and nothing needs to wait.
  EXPECT_EQ(prep->gradientRingSlots, 1);
  EXPECT_EQ(prep->gradientRingSlotBytes, 4096 + 4096 + 256);
  EXPECT_EQ(prep->hostPoolBytes, 4096 + 4096 + 256 + 256);
  for (const PreparedInstruction &pi : prep->instructions)
    for (const Dependency &d : pi.waits)
      EXPECT_NE(d.stream, exec::Stream::Host);
}

TEST(CudaBackendTest, CreateWithoutDeviceSaysWhy) {
  std::string why;
  if (cudaDeviceAvailable(&why))
    GTEST_SKIP() << "a CUDA device is present (covered by CudaBackendGpuTest)";
  HandBuiltPlan h = handBuiltPlan();
  auto backend = CudaBackend::create(h.plan);
  ASSERT_FALSE(!!backend);
  EXPECT_EQ(llvm::toString(backend.takeError()), why);
}

using Gradients = llvm::StringMap<std::vector<float>>;

/// Every gradient of `want` in `got`, within `tol` of the largest
/// magnitude of each tensor.
void expectGradientsNear(const Gradients &got, const Gradients &want,
                         double tol) {
  EXPECT_EQ(got.size(), want.size());
  for (auto &entry : want) {
    auto it = got.find(entry.getKey());
    ASSERT_NE(it, got.end()) << entry.getKey().str();
    const std::vector<float> &w = entry.getValue(), &g = it->second;
    ASSERT_EQ(g.size(), w.size());
    float scale = 1e-3f, worst = 0;
    for (float x : w)
      scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < w.size(); ++i)
      worst = std::max(worst, std::fabs(g[i] - w[i]));
    EXPECT_LE(worst, tol * scale) << entry.getKey().str();
  }
}

/// Runs around each step of the cuda backend.
struct StepHooks {
  std::function<void(int)> before, after;
};

/// Steps both backends `steps` times from the same state and inputs;
/// compares losses and, in the first step, every gradient.
void compareWithCpu(const exec::ExecPlan &plan,
                    const std::function<exec::StepInputs(int)> &inputs,
                    int steps, double lossTol, double gradTol,
                    const CudaOptions &options = {},
                    const StepHooks &hooks = {}) {
  auto gpu = CudaBackend::create(plan, options);
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  auto ref = cpu::CpuBackend::create(plan);
  ASSERT_TRUE(!!ref) << llvm::toString(ref.takeError());
  host::HostState gpuState = host::initHostState(plan, 3);
  host::HostState cpuState = host::initHostState(plan, 3);
  for (int s = 0; s < steps; ++s) {
    exec::StepInputs in = inputs(s);
    Gradients gpuGrads, cpuGrads;
    exec::StepOptions go, co;
    go.trace = co.trace = s == 0;
    go.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
      gpuGrads[n] = g.vec();
    };
    co.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
      cpuGrads[n] = g.vec();
    };
    if (hooks.before)
      hooks.before(s);
    auto g = (*gpu)->step(in, gpuState, go);
    if (hooks.after)
      hooks.after(s);
    ASSERT_TRUE(!!g) << llvm::toString(g.takeError());
    auto c = (*ref)->step(in, cpuState, co);
    ASSERT_TRUE(!!c) << llvm::toString(c.takeError());
    EXPECT_NEAR(g->loss, c->loss, lossTol * std::max(1.0f, std::fabs(c->loss)))
        << "step " << s;
    EXPECT_EQ(gpuState.step, cpuState.step);
    if (s == 0) {
      EXPECT_FALSE(g->spans.empty());
      expectGradientsNear(gpuGrads, cpuGrads, gradTol);
    }
  }
}

//===----------------------------------------------------------------------===//
// The compiled tiny model's plan
//===----------------------------------------------------------------------===//

/// The saved tiny plans (TestPlans.h): global attention and 3D-DSA
/// self-attention (its 5x8x8 grid is smaller than the default window, so
/// the plan is compiled with --dsa-window 3,4,4 --dsa-tile 1,2,2
/// --dsa-radius 1).
const char *const kTinyPlans[] = {"tiny", "tiny-dsa"};

class CudaTinyPlanTest : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaTinyPlanTest, PreparesAndCompiles) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan(GetParam(), why);
  ASSERT_TRUE(plan) << why;
  if (std::string(GetParam()) == "tiny-dsa") {
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
                         ::testing::ValuesIn(kTinyPlans));

//===----------------------------------------------------------------------===//
// A fake device: the whole backend without a GPU (FakeCuda.h)
//===----------------------------------------------------------------------===//

/// Prepares the fake device for `plan`, the dense kernels on the shared
/// host build; false with `why` where it cannot run (no NVRTC: the backend
/// compiles its kernels first; no host compiler).
bool setUpFakeDevice(const exec::ExecPlan &plan, const PreparedPlan &prep,
                     std::string &why, const fake::Options &options = {}) {
  if (!nvrtcAvailable(&why)) {
    why += " (the backend compiles its kernels first)";
    return false;
  }
  EmulatedKernels *emu = sharedEmulation(why);
  if (!emu)
    return false;
  fake::setUp(
      plan, prep,
      [emu](const std::string &name) { return emu->hostKernel(name); },
      options);
  return true;
}

/// What the fake device found in the step that just ended: nothing.
void expectNoFakeDeviceErrors(const std::string &context) {
  std::vector<std::string> errors = fake::endStep();
  EXPECT_TRUE(errors.empty()) << context << ":\n" << llvm::join(errors, "\n");
}

/// Runs `plan` on the fake device against the cpu backend, the delays of
/// step s seeded with s.
void runOnFakeDevice(const exec::ExecPlan &plan,
                     const std::function<exec::StepInputs(int)> &inputs,
                     int steps, CudaOptions options = fake::backendOptions()) {
  auto prep = prepareCudaPlan(plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  std::string why;
  if (!setUpFakeDevice(plan, *prep, why))
    GTEST_SKIP() << why;
  StepHooks hooks{
      [](int s) { fake::beginStep(s); },
      [](int s) { expectNoFakeDeviceErrors("step " + std::to_string(s)); }};
  compareWithCpu(plan, inputs, steps, 2e-2, 5e-2, options, hooks);
  fake::Stats stats = fake::stats();
  EXPECT_GT(stats.launches, 0);
  EXPECT_GT(stats.gemms, 0);
  EXPECT_EQ(stats.spinningWaits, 0) << "host waits that spin a core on a GPU";
}

/// The hand-built plan's inputs, from a fixed seed.
std::function<exec::StepInputs(int)> handBuiltInputs() {
  auto rng = std::make_shared<std::mt19937>(13);
  return [rng](int) {
    std::normal_distribution<float> normal;
    exec::StepInputs in;
    for (const char *name : {"latents", "noise"}) {
      std::vector<float> v(2 * 8 * 32);
      for (float &x : v)
        x = normal(*rng);
      in[name] = v;
    }
    return in;
  };
}

TEST(CudaBackendFakeDeviceTest, HandBuiltPlanStepsLikeTheCpuBackend) {
  HandBuiltPlan h = handBuiltPlan();
  runOnFakeDevice(h.plan, handBuiltInputs(), 3);
}

// Tests that the cpu backend hands out the prediction flow_matching_loss
// reads (Trainer.predict): its shape, values whose loss is the step's, and
// a state a step without updates leaves as it was.
TEST(CpuBackendPrediction, IsWhatTheLossReads) {
  HandBuiltPlan h = handBuiltPlan();
  auto cpuBackend = cpu::CpuBackend::create(h.plan);
  ASSERT_TRUE(!!cpuBackend) << llvm::toString(cpuBackend.takeError());
  host::HostState state = host::initHostState(h.plan, 3);
  host::HostState before = host::initHostState(h.plan, 3);
  exec::StepInputs in = handBuiltInputs()(0);
  std::vector<int64_t> shape;
  std::vector<float> prediction;
  int calls = 0;
  exec::StepOptions options;
  options.applyUpdates = false;
  options.onPrediction = [&](llvm::ArrayRef<int64_t> s,
                             llvm::ArrayRef<float> p) {
    ++calls;
    shape.assign(s.begin(), s.end());
    prediction.assign(p.begin(), p.end());
  };
  auto result = (*cpuBackend)->step(in, state, options);
  ASSERT_TRUE(!!result) << llvm::toString(result.takeError());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(shape, (std::vector<int64_t>{2, 8, 32}));
  ASSERT_EQ(prediction.size(), 2u * 8 * 32);
  // The loss of the bf16 plan is over bf16-rounded operands, as here.
  auto bf16 = [](float x) { return cpu::bf16ToFloat(cpu::floatToBf16(x)); };
  double sum = 0;
  for (size_t i = 0; i < prediction.size(); ++i) {
    EXPECT_EQ(prediction[i], bf16(prediction[i])) << i; // widened bf16
    double r = double(prediction[i]) -
               (double(bf16(in["noise"][i])) - double(bf16(in["latents"][i])));
    sum += r * r;
  }
  EXPECT_NEAR(sum / prediction.size(), result->loss, 1e-6 * result->loss);
  EXPECT_EQ(state.step, before.step);
  for (size_t i = 0; i < state.tensors.size(); ++i)
    EXPECT_EQ(state.tensors[i].data, before.tensors[i].data)
        << state.tensors[i].param->name;
}

// Tests that the cuda backend refuses a step that asks for the prediction
// rather than ignoring the request.
TEST(CudaBackendFakeDeviceTest, RefusesToReturnThePrediction) {
  HandBuiltPlan h = handBuiltPlan();
  CudaOptions options = fake::backendOptions();
  auto prep = prepareCudaPlan(h.plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  std::string why;
  if (!setUpFakeDevice(h.plan, *prep, why))
    GTEST_SKIP() << why;
  auto gpu = CudaBackend::create(h.plan, options);
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  host::HostState state = host::initHostState(h.plan, 3);
  exec::StepOptions step;
  step.applyUpdates = false;
  step.onPrediction = [](llvm::ArrayRef<int64_t>, llvm::ArrayRef<float>) {};
  fake::beginStep(0);
  auto result = (*gpu)->step(handBuiltInputs()(0), state, step);
  ASSERT_FALSE(!!result);
  EXPECT_NE(llvm::toString(result.takeError())
                .find("the cuda backend does not return the model's "
                      "prediction; use the cpu backend"),
            std::string::npos);
  (void)fake::endStep();
}

/// A staging ring with room for one fetch: the staging thread casts b1
/// only once w1's copy has completed, into the bytes w1 was copied from,
/// and w2 after b1's
/// (the fake device fails a copy whose pinned source the host overwrote
/// while it was in flight).
TEST(CudaBackendFakeDeviceTest, StagingRingOfOneFetchWaitsForEachCopy) {
  HandBuiltPlan h = handBuiltPlan();
  CudaOptions options = fake::backendOptions();
  options.stagingBytes = 1;
  auto prep = prepareCudaPlan(h.plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  ASSERT_EQ(prep->fetches.size(), 3u);
  EXPECT_EQ(prep->stagingBytes, 4096); // raised to the largest fetch
  runOnFakeDevice(h.plan, handBuiltInputs(), 3, options);
}

/// The fake device's own semantics, on raw driver calls: a read on one
/// stream of bytes another stream writes needs a wait for an event
/// recorded after the write; the wait orders only up to the record current
/// at the call.
TEST(CudaBackendFakeDeviceTest, FakeDeviceFindsMissingWaits) {
  HandBuiltPlan h = handBuiltPlan();
  auto prep = prepareCudaPlan(h.plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  const CudaDriverApi &cu = fake::driver();
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0   ? "waits for the write"
                 : variant == 1 ? "no wait"
                                : "waits for an earlier record");
    fake::setUp(h.plan, *prep,
                [](const std::string &) { return fake::HostKernel{}; });
    CUdeviceptr arena = 0;
    void *host = nullptr;
    CUstream a = nullptr, b = nullptr;
    CUevent e = nullptr;
    ASSERT_EQ(cu.cuMemAlloc_v2(&arena, h.plan.arenaBytes), 0);
    ASSERT_EQ(cu.cuMemHostAlloc(&host, 256, 0), 0);
    ASSERT_EQ(cu.cuStreamCreate(&a, CU_STREAM_NON_BLOCKING), 0);
    ASSERT_EQ(cu.cuStreamCreate(&b, CU_STREAM_NON_BLOCKING), 0);
    ASSERT_EQ(cu.cuEventCreate(&e, CU_EVENT_BLOCKING_SYNC), 0);
    fake::beginStep(1);
    if (variant == 2) {
      ASSERT_EQ(cu.cuEventRecord(e, a), 0);
    }
    ASSERT_EQ(cu.cuMemsetD8Async(arena, 7, 256, a), 0);
    if (variant == 0) {
      ASSERT_EQ(cu.cuEventRecord(e, a), 0);
    }
    if (variant != 1) {
      ASSERT_EQ(cu.cuStreamWaitEvent(b, e, 0), 0);
    }
    if (variant == 2) {
      ASSERT_EQ(cu.cuEventRecord(e, a), 0); // too late for b's wait
    }
    ASSERT_EQ(cu.cuMemcpyDtoHAsync_v2(host, arena, 256, b), 0);
    ASSERT_EQ(cu.cuStreamSynchronize(a), 0);
    ASSERT_EQ(cu.cuStreamSynchronize(b), 0);
    std::vector<std::string> errors = fake::endStep();
    if (variant == 0) {
      EXPECT_TRUE(errors.empty()) << llvm::join(errors, "\n");
      EXPECT_EQ(static_cast<uint8_t *>(host)[255], 7);
    } else {
      ASSERT_FALSE(errors.empty());
      EXPECT_NE(errors[0].find("cuMemcpyDtoHAsync on stream #2 (the backend's "
                               "own) reads the arena bytes [0, 256) that "
                               "cuMemsetD8Async on stream #1"),
                std::string::npos)
          << errors[0];
      EXPECT_NE(errors[0].find("(a missing wait)"), std::string::npos);
    }
    cu.cuEventDestroy_v2(e);
    cu.cuStreamDestroy_v2(a);
    cu.cuStreamDestroy_v2(b);
    cu.cuMemFreeHost(host);
    cu.cuMemFree_v2(arena);
  }
}

/// A failing cuEventSynchronize, each of a step's in turn: the step fails
/// naming it, leaves nothing in flight, and the state is either untouched
/// or marked incomplete; the next step works.
TEST(CudaBackendFakeDeviceTest, FailingEventSynchronizeFailsTheStep) {
  HandBuiltPlan h = handBuiltPlan();
  auto prep = prepareCudaPlan(h.plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  std::string why;
  if (!setUpFakeDevice(h.plan, *prep, why))
    GTEST_SKIP() << why;
  exec::StepInputs in = handBuiltInputs()(0);
  // How many a step makes, after those of create().
  int64_t atCreate = 0, perStep = 0;
  {
    auto gpu = CudaBackend::create(h.plan, fake::backendOptions());
    ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
    atCreate = fake::stats().calls["cuEventSynchronize"];
    host::HostState state = host::initHostState(h.plan, 3);
    fake::beginStep(0);
    ASSERT_TRUE(!!(*gpu)->step(in, state, {}));
    perStep = fake::stats().calls["cuEventSynchronize"] - atCreate;
  }
  ASSERT_GT(perStep, 3);
  for (int64_t n = 1; n <= perStep; ++n) {
    SCOPED_TRACE("call " + std::to_string(n) + " of the step fails");
    fake::Options options;
    options.fault = fake::Fault{"cuEventSynchronize", atCreate + n};
    ASSERT_TRUE(setUpFakeDevice(h.plan, *prep, why, options));
    auto gpu = CudaBackend::create(h.plan, fake::backendOptions());
    ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
    host::HostState initial = host::initHostState(h.plan, 3), state = initial;
    fake::beginStep(n);
    auto r = (*gpu)->step(in, state, {});
    expectNoFakeDeviceErrors("the failed step");
    ASSERT_FALSE(!!r);
    std::string msg = llvm::toString(r.takeError());
    EXPECT_NE(msg.find("cuEventSynchronize"), std::string::npos) << msg;
    EXPECT_NE(msg.find("FAKE_ERROR"), std::string::npos) << msg;
    bool untouched = true;
    for (size_t t = 0; t < initial.tensors.size(); ++t)
      untouched &= state.tensors[t].data == initial.tensors[t].data;
    EXPECT_TRUE(untouched || state.incomplete) << msg;
    EXPECT_EQ(state.step, 0);
    host::HostState fresh = host::initHostState(h.plan, 3);
    fake::beginStep(n + 1000);
    auto again = (*gpu)->step(in, fresh, {});
    EXPECT_TRUE(!!again) << llvm::toString(again.takeError());
    expectNoFakeDeviceErrors("the next step");
  }
}

TEST(CudaBackendFakeDeviceTest, FailingMemGetInfoIsAnError) {
  HandBuiltPlan h = handBuiltPlan();
  auto prep = prepareCudaPlan(h.plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  std::string why;
  fake::Options options;
  options.fault = fake::Fault{"cuMemGetInfo_v2", 1};
  if (!setUpFakeDevice(h.plan, *prep, why, options))
    GTEST_SKIP() << why;
  auto gpu = CudaBackend::create(h.plan, fake::backendOptions());
  ASSERT_FALSE(!!gpu);
  std::string msg = llvm::toString(gpu.takeError());
  EXPECT_EQ(msg.find("cuMemGetInfo: FAKE_ERROR"), 0u) << msg;
}

class CudaBackendFakeDeviceTinyTest
    : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaBackendFakeDeviceTinyTest, StepsLikeTheCpuBackend) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan(GetParam(), why);
  ASSERT_TRUE(plan) << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  train::SyntheticData data(*shapes, 5);
  // Two steps (the second runs on AdamW-updated weights) for global
  // attention; one for 3D-DSA, whose binding the first step checks.
  runOnFakeDevice(
      *plan, [&](int) { return llvm::cantFail(data.next()); },
      std::string(GetParam()) == "tiny-dsa" ? 1 : 2);
}

/// Orderings of the streams the fake device's delays give with this many
/// seeds.
constexpr int kFakeDeviceSeeds = 50;

/// The first step of a tiny plan under kFakeDeviceSeeds seeds of the fake
/// device's delays, each from the same state: every time the cpu backend's
/// loss and gradients, and nothing the device's checks find. The dense
/// kernels run as the cpu reference (their CUDA versions are the test
/// above's): the orderings are what this is about.
TEST_P(CudaBackendFakeDeviceTinyTest, EveryOrderingStepsLikeTheCpuBackend) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan(GetParam(), why);
  ASSERT_TRUE(plan) << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  fake::Options options;
  options.referenceKernels = true;
  if (!setUpFakeDevice(*plan, *prep, why, options))
    GTEST_SKIP() << why;

  Gradients want;
  exec::StepOptions co;
  co.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
    want[n] = g.vec();
  };
  auto ref = cpu::CpuBackend::create(*plan);
  ASSERT_TRUE(!!ref) << llvm::toString(ref.takeError());
  host::HostState cpuState = host::initHostState(*plan, 3);
  auto c = (*ref)->step(in, cpuState, co);
  ASSERT_TRUE(!!c) << llvm::toString(c.takeError());

  auto gpu = CudaBackend::create(*plan, fake::backendOptions());
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  for (int seed = 0; seed < kFakeDeviceSeeds; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Gradients got;
    exec::StepOptions go;
    go.onGradient = [&](llvm::StringRef n, llvm::ArrayRef<float> g) {
      got[n] = g.vec();
    };
    host::HostState state = host::initHostState(*plan, 3);
    fake::beginStep(seed);
    auto g = (*gpu)->step(in, state, go);
    expectNoFakeDeviceErrors("seed " + std::to_string(seed));
    ASSERT_TRUE(!!g) << llvm::toString(g.takeError());
    EXPECT_NEAR(g->loss, c->loss, 2e-2 * std::max(1.0f, std::fabs(c->loss)));
    expectGradientsNear(got, want, 5e-2);
    if (HasFailure())
      break;
  }
  EXPECT_EQ(fake::stats().spinningWaits, 0)
      << "host waits that spin a core on a GPU";
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, CudaBackendFakeDeviceTinyTest,
                         ::testing::ValuesIn(kTinyPlans));

/// Pinned host values shared as on a large model (the gradient ring): the
/// issuing thread runs ahead of a host optimizer that has not finished its
/// first update by every gradient copy that reuses no bytes a pending
/// update reads, two layers' worth with the default two buffers. Packed by
/// liveness (before the ring), the second gradient copy reused the first's
/// bytes and the issuing thread stopped there, one gradient ahead.
TEST(CudaBackendFakeDeviceTest, GradientCopiesRunAheadOfTheHostOptimizer) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  CudaOptions options = fake::backendOptions();
  options.hostPoolNoReuseBytes = 0;
  auto prep = prepareCudaPlan(*plan, options);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  ASSERT_TRUE(prep->hostPoolShared);
  EXPECT_EQ(prep->gradientRingSlots, plan->gradientBuffers);

  // The device-to-host copies the issuing thread makes before the first
  // gradient copy that waits for a host update, and the layers of the
  // gradients among them.
  int64_t copiesAhead = 0, gradientsAhead = 0;
  std::set<std::optional<int64_t>> layersAhead;
  for (auto [i, inst] : llvm::enumerate(plan->instructions)) {
    if (static_cast<int64_t>(i) == prep->lossDef &&
        plan->values[prep->lossValue].home == exec::Home::Device)
      ++copiesAhead; // the loss, to its pinned stage
    if (inst.op != exec::OpCode::DeviceToHost)
      continue;
    if (llvm::any_of(prep->instructions[i].waits, [](const Dependency &d) {
          return d.stream == exec::Stream::Host;
        }))
      break;
    ++copiesAhead;
    for (const exec::Instruction &u : plan->instructions)
      if (u.op == exec::OpCode::HostAdamW && u.operands[0] == inst.results[0]) {
        ++gradientsAhead;
        layersAhead.insert(inst.layer);
      }
  }
  EXPECT_GE(static_cast<int64_t>(layersAhead.size()), plan->gradientBuffers);
  EXPECT_GT(gradientsAhead, 2);

  fake::Options fakeOptions;
  fakeOptions.referenceKernels = true;
  if (!setUpFakeDevice(*plan, *prep, why, fakeOptions))
    GTEST_SKIP() << why;
  auto gpu = CudaBackend::create(*plan, options);
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  host::HostState state = host::initHostState(*plan, 3);

  // The first update holds the host stream until the issuing thread has
  // made every copy it can make without it; the deadline only ends a run
  // that would otherwise hang where the thread cannot get that far.
  auto copies = [] { return fake::stats().calls["cuMemcpyDtoHAsync_v2"]; };
  int64_t reached = -1;
  exec::StepOptions go;
  go.onGradient = [&](llvm::StringRef, llvm::ArrayRef<float>) {
    if (reached >= 0)
      return;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (copies() < copiesAhead &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    reached = copies();
  };
  fake::beginStep(0);
  auto g = (*gpu)->step(in, state, go);
  expectNoFakeDeviceErrors("step 0");
  ASSERT_TRUE(!!g) << llvm::toString(g.takeError());
  EXPECT_GE(reached, copiesAhead)
      << "the issuing thread stopped after " << reached
      << " device-to-host copies while the first host update was pending; "
      << "the gradient ring allows " << copiesAhead;
}

/// The tiny plan without the first wait that orders a fetched weight
/// before a kernel reading it: exec::validate refuses the plan, and the
/// fake device, given it anyway, finds the race.
TEST(CudaBackendFakeDeviceTest, DeletedWaitIsCaught) {
  std::string why;
  const exec::ExecPlan *tiny = savedTestPlan("tiny", why);
  ASSERT_TRUE(tiny) << why;
  // Waits of the compute stream for an event the h2d stream records after
  // a fetch; the first whose deletion leaves a read unordered (others are
  // implied by later waits).
  exec::ExecPlan plan;
  std::string invalid;
  for (size_t i = 0; i < tiny->instructions.size() && invalid.empty(); ++i) {
    const exec::Instruction &w = tiny->instructions[i];
    if (w.op != exec::OpCode::Wait || w.stream != exec::Stream::Compute)
      continue;
    bool afterFetch = false;
    for (size_t r = 1; r < i; ++r) {
      const exec::Instruction &rec = tiny->instructions[r];
      afterFetch |= rec.op == exec::OpCode::Record && rec.event == w.event &&
                    rec.stream == exec::Stream::HostToDevice &&
                    tiny->instructions[r - 1].op == exec::OpCode::Fetch;
    }
    if (!afterFetch)
      continue;
    plan = *tiny;
    plan.instructions.erase(plan.instructions.begin() + i);
    if (llvm::Error e = exec::validate(plan))
      invalid = llvm::toString(std::move(e));
  }
  ASSERT_FALSE(invalid.empty()) << "no wait orders a fetched weight";
  // "instruction #N ('op') on stream compute reads %V, written by
  // instruction #M on stream h2d, without waiting for an event ..."
  int reader = -1;
  ASSERT_EQ(std::sscanf(invalid.c_str(), "%*[^#]#%d", &reader), 1) << invalid;
  EXPECT_NE(invalid.find("on stream h2d, without waiting for an event"),
            std::string::npos)
      << invalid;

  auto prep = prepareCudaPlan(plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  fake::Options options;
  options.referenceKernels = true;
  if (!setUpFakeDevice(plan, *prep, why, options))
    GTEST_SKIP() << why;
  auto shapes = train::InputShapes::of(plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  auto gpu = CudaBackend::create(plan, fake::backendOptions());
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  host::HostState state = host::initHostState(plan, 3);
  fake::beginStep(0);
  auto r = (*gpu)->step(in, state, {});
  llvm::consumeError(r.takeError());
  std::vector<std::string> errors = fake::endStep();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].find("instruction #" + std::to_string(reader) + " ("), 0u)
      << errors[0];
  EXPECT_NE(errors[0].find("(a missing wait)"), std::string::npos) << errors[0];
}

/// The issue loop failing while host_adamw tasks are queued: none of them
/// may apply (the first gradient's task is held in onGradient until the
/// failure). The step fails once, naming the call; the state is marked
/// incomplete exactly when an update was applied.
TEST(CudaBackendFakeDeviceTest, IssueErrorCancelsQueuedUpdates) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  int64_t launches = 0;
  for (const PreparedInstruction &pi : prep->instructions)
    if (pi.lowered)
      for (const LoweredStep &s : pi.lowered->steps)
        launches += std::holds_alternative<KernelLaunch>(s);
  fake::Options options;
  options.referenceKernels = true;
  options.fault = fake::Fault{"cuLaunchKernel", launches}; // the step's last
  if (!setUpFakeDevice(*plan, *prep, why, options))
    GTEST_SKIP() << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  auto gpu = CudaBackend::create(*plan, fake::backendOptions());
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  host::HostState initial = host::initHostState(*plan, 3), state = initial;
  exec::StepOptions go;
  std::atomic<int> gradients{0};
  go.onGradient = [&](llvm::StringRef, llvm::ArrayRef<float>) {
    if (gradients++ == 0)
      fake::waitForFault(std::chrono::seconds(60));
  };
  fake::beginStep(0);
  auto r = (*gpu)->step(in, state, go);
  expectNoFakeDeviceErrors("the failed step");
  ASSERT_FALSE(!!r);
  std::string msg = llvm::toString(r.takeError());
  EXPECT_NE(msg.find("cuLaunchKernel"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("FAKE_ERROR"), msg.rfind("FAKE_ERROR")) << msg;
  // At most the update held in onGradient: a master and its moments.
  int changed = 0;
  for (size_t t = 0; t < initial.tensors.size(); ++t)
    changed += state.tensors[t].data != initial.tensors[t].data;
  EXPECT_LE(changed, 3) << "updates applied after the failure";
  EXPECT_LE(gradients, 1);
  EXPECT_EQ(state.incomplete, changed > 0);
  EXPECT_EQ(state.step, 0);
}

/// The deferred update's side of a step (docs/Training.md): no update, each
/// gradient handed over in its planned dtype with the cpu backend's values,
/// and every fetch announced on the staging thread before its cast.
TEST(CudaBackendFakeDeviceTest,
     DeferredStepRetainsGradientsAndAnnouncesFetches) {
  std::string why;
  const exec::ExecPlan *plan = savedTestPlan("tiny", why);
  ASSERT_TRUE(plan) << why;
  auto prep = prepareCudaPlan(*plan);
  ASSERT_TRUE(!!prep) << llvm::toString(prep.takeError());
  fake::Options fakeOptions;
  fakeOptions.referenceKernels = true;
  if (!setUpFakeDevice(*plan, *prep, why, fakeOptions))
    GTEST_SKIP() << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  exec::StepInputs in = llvm::cantFail(train::SyntheticData(*shapes, 5).next());
  auto gpu = CudaBackend::create(*plan, fake::backendOptions());
  ASSERT_TRUE(!!gpu) << llvm::toString(gpu.takeError());
  host::HostState initial = host::initHostState(*plan, 3), state = initial;

  std::mutex mu;
  std::map<std::string, std::vector<float>> retained;
  std::vector<std::string> announced;
  std::set<std::thread::id> announcers;
  exec::StepOptions deferred;
  deferred.applyUpdates = false;
  deferred.retainGradient = [&](const exec::Instruction &inst,
                                const exec::HostGradient &g) {
    std::vector<float> wide(g.count);
    cpu::widen(g.data, g.dtype, g.count, wide.data());
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(g.dtype, plan->values[inst.operands[0]].type.dtype);
    EXPECT_TRUE(retained.emplace(inst.param, std::move(wide)).second)
        << inst.param << " handed over twice";
  };
  deferred.beforeFetch = [&](llvm::StringRef param) {
    std::lock_guard<std::mutex> lock(mu);
    announced.push_back(param.str());
    announcers.insert(std::this_thread::get_id());
  };
  fake::beginStep(0);
  auto r = (*gpu)->step(in, state, deferred);
  expectNoFakeDeviceErrors("the deferred step");
  ASSERT_TRUE(!!r) << llvm::toString(r.takeError());

  std::vector<std::string> fetched;
  size_t updates = 0;
  for (const exec::Instruction &inst : plan->instructions) {
    if (inst.op == exec::OpCode::Fetch)
      fetched.push_back(inst.param);
    updates += inst.op == exec::OpCode::HostAdamW;
  }
  EXPECT_EQ(announced, fetched) << "every fetch, in plan order";
  EXPECT_EQ(announcers.count(std::this_thread::get_id()), 0u)
      << "announced on the issuing thread, not the staging thread";
  EXPECT_EQ(retained.size(), updates);
  for (size_t t = 0; t < initial.tensors.size(); ++t)
    EXPECT_EQ(state.tensors[t].data, initial.tensors[t].data)
        << initial.tensors[t].param->name << " was updated";
  EXPECT_EQ(state.step, 0);
  EXPECT_FALSE(state.incomplete);

  // The same gradients as the cpu backend's (the kernels' tolerance).
  auto cpuBackend = cpu::CpuBackend::create(*plan);
  ASSERT_TRUE(!!cpuBackend) << llvm::toString(cpuBackend.takeError());
  std::map<std::string, std::vector<float>> reference;
  exec::StepOptions gradientsOnly;
  gradientsOnly.applyUpdates = false;
  gradientsOnly.onGradient = [&](llvm::StringRef name,
                                 llvm::ArrayRef<float> g) {
    reference[name.str()] = g.vec();
  };
  host::HostState cpuState = initial;
  ASSERT_TRUE(!!(*cpuBackend)->step(in, cpuState, gradientsOnly));
  for (const auto &[name, g] : reference) {
    ASSERT_TRUE(retained.count(name)) << name;
    float scale = 0, worst = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      scale = std::max(scale, std::fabs(g[i]));
      worst = std::max(worst, std::fabs(g[i] - retained[name][i]));
    }
    EXPECT_LE(worst, 5e-2f * scale + 1e-6f) << name;
  }
}

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

/// The saved tiny plans (TestPlans.h), with global attention and with
/// 3D-DSA (the generated kernels on the GPU): three steps, losses and every
/// gradient against the cpu backend.
class CudaBackendGpuTinyTest : public ::testing::TestWithParam<const char *> {};

TEST_P(CudaBackendGpuTinyTest, MatchesCpuBackend) {
  std::string why;
  if (!cudaDeviceAvailable(&why))
    GTEST_SKIP() << why;
  const exec::ExecPlan *plan = savedTestPlan(GetParam(), why);
  ASSERT_TRUE(plan) << why;
  auto shapes = train::InputShapes::of(*plan);
  ASSERT_TRUE(!!shapes) << llvm::toString(shapes.takeError());
  train::SyntheticData data(*shapes, 5);
  compareWithCpu(
      *plan, [&](int) { return llvm::cantFail(data.next()); }, 3, 3e-2, 1e-1);
}

INSTANTIATE_TEST_SUITE_P(GlobalAndDsaAttention, CudaBackendGpuTinyTest,
                         ::testing::ValuesIn(kTinyPlans));

EmulatedKernels *sharedEmulation(std::string &why) {
  static std::unique_ptr<EmulatedKernels> emu;
  static std::string whyNot;
  static bool built = false;
  if (!built) {
    built = true;
    std::set<KernelInstance> all;
    std::vector<OpCase> cases = denseCases();
    for (const AttentionTcCase &a : attentionTcCases()) {
      auto [fwd, bwd] = attentionTcOps(a);
      cases.push_back(fwd);
      cases.push_back(bwd);
    }
    for (const OpCase &c : cases) {
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
    for (const char *name : kTinyPlans)
      if (const exec::ExecPlan *p = savedTestPlan(name, ignored))
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
