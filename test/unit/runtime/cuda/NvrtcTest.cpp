//===- NvrtcTest.cpp - NVRTC loading, cache, ptxas logs, occupancy --------===//
//
// Runs without a GPU. The compilation tests need NVRTC (the CUDA toolkit's
// libnvrtc) and skip when it cannot be loaded.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/Nvrtc.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <optional>

using namespace megaslide::cuda;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern =
        (fs::temp_directory_path() / "megaslide-nvrtc-XXXXXX").string();
    path = mkdtemp(pattern.data()) ? fs::path(pattern) : fs::path();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Sets an environment variable for the scope, restoring it afterwards.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char *n, const char *value) : name(n) {
    if (const char *v = std::getenv(n))
      old = v;
    if (value)
      setenv(n, value, 1);
    else
      unsetenv(n);
  }
  ~ScopedEnv() {
    if (old)
      setenv(name.c_str(), old->c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

size_t countFiles(const fs::path &dir) {
  size_t n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec);
       !ec && it != fs::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

//===----------------------------------------------------------------------===//
// ptxas -v logs
//===----------------------------------------------------------------------===//

// NVRTC 13.0 for sm_90a (trimmed 3D-DSA kernels), plus a non-inlined device
// function whose properties must not be taken for a kernel's.
constexpr const char *kNvrtcLog =
    "ptxas info    : 188 bytes gmem\n"
    "ptxas info    : Compiling entry function 'dsa_offsets' for 'sm_90a'\n"
    "ptxas info    : Function properties for dsa_offsets\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes "
    "spill loads\n"
    "ptxas info    : Used 40 registers, used 1 barriers, 3520 bytes smem\n"
    "ptxas info    : Compile time = 68.979 ms\n"
    "ptxas info    : Function properties for _Z6helperPf\n"
    "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 8 bytes "
    "spill loads\n"
    "ptxas info    : Compiling entry function 'dsa_bwd' for 'sm_90a'\n"
    "ptxas info    : Function properties for dsa_bwd\n"
    "ptxas         .     16 bytes stack frame, 12 bytes spill stores, 20 "
    "bytes spill loads\n"
    "ptxas info    : Used 255 registers, used 1 barriers\n"
    "ptxas info    : Compile time = 377.839 ms\n";

TEST(PtxasLog, ParsesEveryEntryFunction) {
  std::vector<KernelResources> k = parsePtxasLog(kNvrtcLog);
  ASSERT_EQ(k.size(), 2u);
  EXPECT_EQ(k[0].kernel, "dsa_offsets");
  EXPECT_EQ(k[0].registers, 40);
  EXPECT_EQ(k[0].sharedBytes, 3520);
  EXPECT_EQ(k[0].stackBytes, 0);
  EXPECT_EQ(k[0].spillStores, 0);
  EXPECT_EQ(k[0].spillLoads, 0);
  EXPECT_EQ(k[1].kernel, "dsa_bwd");
  EXPECT_EQ(k[1].registers, 255);
  EXPECT_EQ(k[1].sharedBytes, 0);
  EXPECT_EQ(k[1].stackBytes, 16);
  EXPECT_EQ(k[1].spillStores, 12);
  EXPECT_EQ(k[1].spillLoads, 20);
}

TEST(PtxasLog, ParsesNvccStyleLinesAndMangledNames) {
  // nvcc -Xptxas -v prints the properties before the entry and may omit
  // barriers and smem.
  std::vector<KernelResources> k = parsePtxasLog(
      "ptxas info    : Function properties for _Z4axpyPff\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Compiling entry function '_Z4axpyPff' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z4axpyPff\n"
      "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 8 registers, 360 bytes cmem[0]\n");
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].kernel, "_Z4axpyPff");
  EXPECT_EQ(k[0].registers, 8);
  EXPECT_EQ(k[0].sharedBytes, 0);
  EXPECT_EQ(k[0].stackBytes, 8);
  EXPECT_EQ(k[0].spillStores, 4);
}

TEST(PtxasLog, EmptyOrErrorLogHasNoKernels) {
  EXPECT_TRUE(parsePtxasLog("").empty());
  EXPECT_TRUE(
      parsePtxasLog("k.cu(3): error: identifier \"x\" is undefined\n").empty());
}

//===----------------------------------------------------------------------===//
// Occupancy (sm_90)
//===----------------------------------------------------------------------===//

KernelResources kernel(int registers, int sharedBytes = 0) {
  KernelResources k;
  k.kernel = "k";
  k.registers = registers;
  k.sharedBytes = sharedBytes;
  return k;
}

TEST(Occupancy, RegistersAndSharedMemoryOfTheDsaForward) {
  // 128 registers x 256 threads: 4 warps per sub-partition, 16 per SM.
  // 104996 + 1024 reserved bytes -> 2 blocks in 228 KB.
  Occupancy o = occupancySm90(kernel(128), 256, 104996);
  EXPECT_EQ(o.blocksPerSm, 2);
  EXPECT_EQ(o.warpsPerSm, 16);
  EXPECT_DOUBLE_EQ(o.fraction, 0.25);
  EXPECT_EQ(o.limiter, "registers and shared memory");
}

TEST(Occupancy, RegisterAllocationGranularity) {
  // 33 registers -> 1056 per warp, allocated as 1280: 12 warps per
  // sub-partition, 48 per SM, 6 blocks of 8 warps.
  Occupancy o = occupancySm90(kernel(33), 256);
  EXPECT_EQ(o.blocksPerSm, 6);
  EXPECT_EQ(o.warpsPerSm, 48);
  EXPECT_EQ(o.limiter, "registers");
  // 209 registers -> 6912 per warp: 2 warps per sub-partition, 1 block.
  EXPECT_EQ(occupancySm90(kernel(209), 256, 177700).blocksPerSm, 1);
}

TEST(Occupancy, ThreadAndBlockLimits) {
  Occupancy full = occupancySm90(kernel(32), 256);
  EXPECT_EQ(full.blocksPerSm, 8);
  EXPECT_DOUBLE_EQ(full.fraction, 1.0);
  EXPECT_EQ(full.limiter, "registers and threads");
  Occupancy tiny = occupancySm90(kernel(20), 32);
  EXPECT_EQ(tiny.blocksPerSm, 32);
  EXPECT_EQ(tiny.warpsPerSm, 32);
  EXPECT_EQ(tiny.limiter, "blocks");
}

TEST(Occupancy, SharedMemoryLimit) {
  // (227 KB + 1 KB reserved) fills the SM.
  Occupancy o = occupancySm90(kernel(64, 1024), 128, 227 * 1024 - 1024);
  EXPECT_EQ(o.blocksPerSm, 1);
  EXPECT_EQ(o.limiter, "shared memory");
  EXPECT_EQ(occupancySm90(kernel(32), 128, 60 * 1024).blocksPerSm, 3);
}

TEST(Occupancy, KernelsThatCannotLaunch) {
  EXPECT_EQ(occupancySm90(kernel(256), 32).blocksPerSm, 0);
  EXPECT_EQ(occupancySm90(kernel(128), 1024).blocksPerSm, 0); // 128K regs
  Occupancy smem = occupancySm90(kernel(32), 128, 227 * 1024 + 1);
  EXPECT_EQ(smem.blocksPerSm, 0);
  EXPECT_NE(smem.limiter.find("cannot launch"), std::string::npos);
  EXPECT_EQ(occupancySm90(kernel(32), 2048).blocksPerSm, 0);
}

//===----------------------------------------------------------------------===//
// Cache key and files
//===----------------------------------------------------------------------===//

/// A source like every generated kernel: no #include.
constexpr const char *kHeaderFree =
    "extern \"C\" __global__ void k(float *p) { p[0] = 1.0f; }\n";

TEST(KernelCache, Fnv1aMatchesReferenceVectors) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
}

TEST(KernelCache, KeyIsStableAndCoversEveryInput) {
  const std::vector<std::string> opts = {"--std=c++17", "-lineinfo"};
  std::string key = cacheKey("__global__ void k() {}", "sm_90a", opts, "13.0");
  EXPECT_EQ(key.size(), 16u);
  // Fixed across runs, builds and machines: cached files stay valid.
  EXPECT_EQ(key, "868ecdd60f076448");
  EXPECT_EQ(key, cacheKey("__global__ void k() {}", "sm_90a", opts, "13.0"));
  EXPECT_NE(key, cacheKey("__global__ void k() { }", "sm_90a", opts, "13.0"));
  EXPECT_NE(key, cacheKey("__global__ void k() {}", "sm_80", opts, "13.0"));
  EXPECT_NE(key, cacheKey("__global__ void k() {}", "sm_90a", {"--std=c++17"},
                          "13.0"));
  EXPECT_NE(key, cacheKey("__global__ void k() {}", "sm_90a", opts, "13.1"));
  // Fields are length-framed: text moved between them changes the key.
  EXPECT_NE(cacheKey("ab", "c", {}, "13.0"), cacheKey("a", "bc", {}, "13.0"));
  EXPECT_NE(cacheKey("s", "a", {"x", "y"}, "v"),
            cacheKey("s", "a", {"xy"}, "v"));
}

/// Two CUDA installations, each with an include folder: $CUDA_HOME differs
/// between the machine that fills a kernel cache and the GPU node.
struct TwoCudaHomes {
  TempDir a, b;
  TwoCudaHomes() {
    fs::create_directories(a.path / "include");
    fs::create_directories(b.path / "include");
  }
};

TEST(KernelCache, HeaderFreeOptionsIgnoreWhereCudaIs) {
  TwoCudaHomes homes;
  std::vector<std::string> a, b;
  {
    ScopedEnv home("CUDA_HOME", homes.a.path.c_str());
    a = defaultCompileOptions("sm_90a");
  }
  {
    ScopedEnv home("CUDA_HOME", homes.b.path.c_str());
    b = defaultCompileOptions("sm_90a");
  }
  EXPECT_EQ(a, b);
  EXPECT_EQ(cacheKey(kHeaderFree, "sm_90a", a, "13.0"),
            cacheKey(kHeaderFree, "sm_90a", b, "13.0"));
}

TEST(KernelCache, IncludeFolderOnlyForSourcesWithHeaders) {
  EXPECT_FALSE(includesHeaders(kHeaderFree));
  EXPECT_FALSE(includesHeaders("// no #include here\n__global__ void k() {}"));
  EXPECT_TRUE(includesHeaders("#include <cuda_bf16.h>\n"));
  EXPECT_TRUE(includesHeaders("int x;\n  #  include \"h.h\"\n"));
  TwoCudaHomes homes;
  ScopedEnv home("CUDA_HOME", homes.a.path.c_str());
  std::vector<std::string> o =
      defaultCompileOptions("sm_90a", "#include <cuda_bf16.h>\n");
  ASSERT_EQ(o.size(), 4u);
  EXPECT_EQ(o[3], "--include-path=" + (homes.a.path / "include").string());
  EXPECT_EQ(defaultCompileOptions("sm_90a", kHeaderFree).size(), 3u);
}

TEST(KernelCache, DirectoryFromEnvironment) {
  ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
  ScopedEnv home("HOME", "/home/u");
  {
    ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", "/tmp/kc");
    EXPECT_EQ(kernelCacheDir(), "/tmp/kc");
  }
  {
    ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", "off");
    EXPECT_EQ(kernelCacheDir(), "");
  }
  ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", nullptr);
  EXPECT_EQ(kernelCacheDir(), "/xdg/megaslide/kernels");
  ScopedEnv noXdg("XDG_CACHE_HOME", nullptr);
  EXPECT_EQ(kernelCacheDir(), "/home/u/.cache/megaslide/kernels");
}

//===----------------------------------------------------------------------===//
// Compilation (needs NVRTC, not a GPU)
//===----------------------------------------------------------------------===//

constexpr const char *kAxpy = R"(
extern "C" __global__ void axpy(float a, const float *x, float *y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    y[i] += a * x[i];
}
)";

#define REQUIRE_NVRTC()                                                        \
  do {                                                                         \
    std::string why;                                                           \
    if (!nvrtcAvailable(&why))                                                 \
      GTEST_SKIP() << why;                                                     \
  } while (0)

TEST(Nvrtc, CompilesATrivialKernelToAnSm90aCubin) {
  REQUIRE_NVRTC();
  TempDir dir;
  ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", dir.path.c_str());
  CompileResult r = compileCuda(kAxpy, "axpy.cu", "sm_90a");
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_FALSE(r.fromCache);
  EXPECT_GT(r.cubin.size(), 0u);
  EXPECT_EQ(r.cubin.substr(0, 4), "\x7f"
                                  "ELF");
  std::vector<KernelResources> k = parsePtxasLog(r.log);
  ASSERT_EQ(k.size(), 1u) << r.log;
  EXPECT_EQ(k[0].kernel, "axpy");
  EXPECT_GT(k[0].registers, 0);
  EXPECT_EQ(k[0].spillStores + k[0].spillLoads, 0);
  EXPECT_FALSE(nvrtcVersionString().empty());

  // The second compilation is served from the cache, log included.
  EXPECT_EQ(countFiles(dir.path), 1u);
  CompileResult again = compileCuda(kAxpy, "axpy.cu", "sm_90a");
  ASSERT_TRUE(again.ok()) << again.error;
  EXPECT_TRUE(again.fromCache);
  EXPECT_EQ(again.cubin, r.cubin);
  EXPECT_EQ(again.log, r.log);
}

TEST(Nvrtc, HeaderFreeSourceHitsTheCacheWhereverCudaIs) {
  REQUIRE_NVRTC();
  TempDir dir;
  TwoCudaHomes homes;
  ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", dir.path.c_str());
  {
    ScopedEnv home("CUDA_HOME", homes.a.path.c_str());
    CompileResult r = compileCuda(kAxpy, "axpy.cu", "sm_90a");
    ASSERT_TRUE(r.ok()) << r.error;
  }
  ScopedEnv home("CUDA_HOME", homes.b.path.c_str());
  CompileResult again = compileCuda(kAxpy, "axpy.cu", "sm_90a");
  ASSERT_TRUE(again.ok()) << again.error;
  EXPECT_TRUE(again.fromCache);
  EXPECT_EQ(countFiles(dir.path), 1u);
}

TEST(Nvrtc, ComputeArchGivesPtxOnly) {
  REQUIRE_NVRTC();
  ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", "off");
  CompileResult r = compileCuda(kAxpy, "axpy.cu", "compute_90a");
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_TRUE(r.cubin.empty());
  EXPECT_NE(r.ptx.find(".entry axpy"), std::string::npos);
}

TEST(Nvrtc, BrokenSourceReturnsTheLogVerbatim) {
  REQUIRE_NVRTC();
  TempDir dir;
  ScopedEnv cache("MEGASLIDE_KERNEL_CACHE", dir.path.c_str());
  CompileResult r = compileCuda(
      "extern \"C\" __global__ void k(float *p) { p[0] = undeclared_x; }\n",
      "broken.cu", "sm_90a");
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.error, r.log);
  EXPECT_NE(r.error.find("broken.cu(1): error: identifier \"undeclared_x\" "
                         "is undefined"),
            std::string::npos)
      << r.error;
  EXPECT_TRUE(r.cubin.empty());
  EXPECT_EQ(countFiles(dir.path), 0u); // failures are not cached
}

TEST(Nvrtc, DefaultOptionsTargetTheArchitecture) {
  std::vector<std::string> o = defaultCompileOptions("sm_90a");
  ASSERT_GE(o.size(), 3u);
  EXPECT_EQ(o[0], "--gpu-architecture=sm_90a");
  EXPECT_EQ(o[1], "--std=c++17");
  EXPECT_EQ(o[2], "--ptxas-options=-v");
}

} // namespace
