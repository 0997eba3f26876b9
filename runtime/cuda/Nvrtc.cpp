//===- Nvrtc.cpp - Run-time CUDA C++ compilation with NVRTC ---------------===//
//
// NVRTC entry points come from a symbol table filled by dlopen/dlsym (after
// IREE's cuda_dynamic_symbol_table), so nothing here needs the CUDA headers
// or library at build time; the few prototypes are declared below with the
// types NVRTC's C ABI uses.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/Nvrtc.h"

#include "megaslide/runtime/cuda/Libraries.h"

#include "megaslide/runtime/support/AtomicFile.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <dlfcn.h>

namespace fs = std::filesystem;

namespace megaslide::cuda {

//===----------------------------------------------------------------------===//
// NVRTC symbol table
//===----------------------------------------------------------------------===//

namespace {

// NVRTC's C ABI (nvrtc.h): an enum result, an opaque program handle.
using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram *;
constexpr nvrtcResult kNvrtcSuccess = 0;

// X(name, return type, parameter types...)
#define MEGASLIDE_NVRTC_SYMBOLS(X)                                             \
  X(nvrtcGetErrorString, const char *, nvrtcResult)                            \
  X(nvrtcVersion, nvrtcResult, int *, int *)                                   \
  X(nvrtcCreateProgram, nvrtcResult, nvrtcProgram *, const char *,             \
    const char *, int, const char *const *, const char *const *)               \
  X(nvrtcDestroyProgram, nvrtcResult, nvrtcProgram *)                          \
  X(nvrtcCompileProgram, nvrtcResult, nvrtcProgram, int, const char *const *)  \
  X(nvrtcGetProgramLogSize, nvrtcResult, nvrtcProgram, size_t *)               \
  X(nvrtcGetProgramLog, nvrtcResult, nvrtcProgram, char *)                     \
  X(nvrtcGetPTXSize, nvrtcResult, nvrtcProgram, size_t *)                      \
  X(nvrtcGetPTX, nvrtcResult, nvrtcProgram, char *)                            \
  X(nvrtcGetCUBINSize, nvrtcResult, nvrtcProgram, size_t *)                    \
  X(nvrtcGetCUBIN, nvrtcResult, nvrtcProgram, char *)

struct NvrtcSymbols {
#define MEGASLIDE_DECLARE(name, ret, ...) ret (*name)(__VA_ARGS__) = nullptr;
  MEGASLIDE_NVRTC_SYMBOLS(MEGASLIDE_DECLARE)
#undef MEGASLIDE_DECLARE
  void *handle = nullptr;
  std::string error; ///< why loading failed; empty when loaded
  int major = 0, minor = 0;
};

/// Library names tried in order: $MEGASLIDE_NVRTC_LIBRARY alone if set;
/// else where the cuda backend looks for its libraries
/// (cudaLibraryCandidates: the loader's path, the toolkit, pip wheels).
std::vector<std::string> nvrtcCandidates() {
  if (const char *lib = std::getenv("MEGASLIDE_NVRTC_LIBRARY"); lib && *lib)
    return {lib};
  return cudaLibraryCandidates(
      {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"});
}

const NvrtcSymbols &nvrtc() {
  static NvrtcSymbols symbols = [] {
    NvrtcSymbols s;
    std::string tried;
    for (const std::string &name : nvrtcCandidates()) {
      s.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (s.handle)
        break;
      tried += "\n  " + name;
      if (const char *e = dlerror())
        tried += std::string(" (") + e + ")";
    }
    if (!s.handle) {
      s.error =
          "NVRTC (the CUDA run-time compiler) was not found; tried:" + tried +
          "\ninstall the CUDA toolkit, or point CUDA_HOME, "
          "LD_LIBRARY_PATH or MEGASLIDE_NVRTC_LIBRARY at it";
      return s;
    }
#define MEGASLIDE_RESOLVE(name, ret, ...)                                      \
  s.name = reinterpret_cast<ret (*)(__VA_ARGS__)>(dlsym(s.handle, #name));     \
  if (!s.name && s.error.empty())                                              \
    s.error = "NVRTC library lacks the symbol " #name;
    MEGASLIDE_NVRTC_SYMBOLS(MEGASLIDE_RESOLVE)
#undef MEGASLIDE_RESOLVE
    if (s.error.empty() && s.nvrtcVersion(&s.major, &s.minor) != kNvrtcSuccess)
      s.error = "nvrtcVersion failed";
    return s;
  }();
  return symbols;
}

std::string resultString(nvrtcResult r) {
  const char *s =
      nvrtc().nvrtcGetErrorString ? nvrtc().nvrtcGetErrorString(r) : nullptr;
  return s ? s : "NVRTC error " + std::to_string(r);
}

} // namespace

bool nvrtcAvailable(std::string *whyNot) {
  const NvrtcSymbols &s = nvrtc();
  if (whyNot)
    *whyNot = s.error;
  return s.error.empty();
}

std::string nvrtcVersionString() {
  if (!nvrtcAvailable())
    return "";
  return std::to_string(nvrtc().major) + "." + std::to_string(nvrtc().minor);
}

bool includesHeaders(const std::string &source) {
  std::istringstream lines(source);
  std::string line;
  while (std::getline(lines, line)) {
    size_t at = line.find_first_not_of(" \t");
    if (at == std::string::npos || line[at] != '#')
      continue;
    at = line.find_first_not_of(" \t", at + 1);
    if (at != std::string::npos && line.compare(at, 7, "include") == 0)
      return true;
  }
  return false;
}

std::vector<std::string> defaultCompileOptions(const std::string &arch,
                                               const std::string &source) {
  std::vector<std::string> options = {"--gpu-architecture=" + arch,
                                      "--std=c++17", "--ptxas-options=-v"};
  // The options are part of the cache key: a header-free source (every
  // generated kernel) must not name the CUDA folder, which differs between
  // the machine that fills the cache and the GPU node that reads it.
  if (!includesHeaders(source))
    return options;
  std::string home;
  if (const char *h = std::getenv("CUDA_HOME"); h && *h)
    home = h;
  else
    home = "/usr/local/cuda";
  std::error_code ec;
  if (fs::is_directory(home + "/include", ec))
    options.push_back("--include-path=" + home + "/include");
  return options;
}

//===----------------------------------------------------------------------===//
// Cache
//===----------------------------------------------------------------------===//

uint64_t fnv1a64(const std::string &data, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string cacheKey(const std::string &source, const std::string &arch,
                     const std::vector<std::string> &options,
                     const std::string &nvrtcVersion) {
  // Length framing: ("ab", "c") and ("a", "bc") must differ.
  std::string framed;
  auto add = [&](const std::string &field) {
    framed += std::to_string(field.size());
    framed += ':';
    framed += field;
  };
  add("megaslide-kernel-cache-v1");
  add(source);
  add(arch);
  add(std::to_string(options.size()));
  for (const std::string &o : options)
    add(o);
  add(nvrtcVersion);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(fnv1a64(framed)));
  return hex;
}

std::string kernelCacheDir() {
  if (const char *dir = std::getenv("MEGASLIDE_KERNEL_CACHE"); dir && *dir) {
    std::string d = dir;
    if (d == "off" || d == "0" || d == "none")
      return "";
    return d;
  }
  if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/megaslide/kernels";
  if (const char *home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/megaslide/kernels";
  return "";
}

namespace {

// A cache entry is one file: a header line "MSKC1 <cubin> <ptx> <log>"
// giving the byte sizes, then the three blobs.
constexpr const char *kCacheMagic = "MSKC1";

std::string serialize(const CompileResult &r) {
  std::string out =
      std::string(kCacheMagic) + " " + std::to_string(r.cubin.size()) + " " +
      std::to_string(r.ptx.size()) + " " + std::to_string(r.log.size()) + "\n";
  return out + r.cubin + r.ptx + r.log;
}

bool deserialize(const std::string &data, CompileResult &r) {
  size_t eol = data.find('\n');
  if (eol == std::string::npos)
    return false;
  std::istringstream header(data.substr(0, eol));
  std::string magic;
  size_t cubin = 0, ptx = 0, log = 0;
  if (!(header >> magic >> cubin >> ptx >> log) || magic != kCacheMagic ||
      data.size() != eol + 1 + cubin + ptx + log)
    return false;
  r.cubin = data.substr(eol + 1, cubin);
  r.ptx = data.substr(eol + 1 + cubin, ptx);
  r.log = data.substr(eol + 1 + cubin + ptx, log);
  return true;
}

bool readFile(const std::string &path, std::string &out) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

} // namespace

//===----------------------------------------------------------------------===//
// Compilation
//===----------------------------------------------------------------------===//

CompileResult compileCuda(const std::string &source, const std::string &name,
                          const std::string &arch,
                          const std::vector<std::string> &extraOptions) {
  CompileResult result;
  std::string why;
  if (!nvrtcAvailable(&why)) {
    result.error = why;
    return result;
  }
  const NvrtcSymbols &api = nvrtc();
  std::vector<std::string> options = defaultCompileOptions(arch, source);
  options.insert(options.end(), extraOptions.begin(), extraOptions.end());
  const bool wantCubin = arch.rfind("sm_", 0) == 0;

  std::string cacheDir = kernelCacheDir();
  std::string cachePath;
  if (!cacheDir.empty()) {
    cachePath = cacheDir + "/" +
                cacheKey(source, arch, options, nvrtcVersionString()) + ".mskc";
    std::string data;
    if (readFile(cachePath, data) && deserialize(data, result) &&
        (!wantCubin || !result.cubin.empty())) {
      result.fromCache = true;
      return result;
    }
    result = CompileResult();
  }

  nvrtcProgram program = nullptr;
  if (nvrtcResult r = api.nvrtcCreateProgram(&program, source.c_str(),
                                             name.c_str(), 0, nullptr, nullptr);
      r != kNvrtcSuccess) {
    result.error = "nvrtcCreateProgram failed: " + resultString(r);
    return result;
  }
  std::vector<const char *> argv;
  for (const std::string &o : options)
    argv.push_back(o.c_str());
  nvrtcResult compiled = api.nvrtcCompileProgram(
      program, static_cast<int>(argv.size()), argv.data());

  size_t size = 0;
  if (api.nvrtcGetProgramLogSize(program, &size) == kNvrtcSuccess && size > 1) {
    result.log.resize(size);
    api.nvrtcGetProgramLog(program, result.log.data());
    result.log.resize(size - 1); // drop the terminating NUL
  }
  if (compiled != kNvrtcSuccess) {
    result.error = result.log.empty() ? "NVRTC compilation of " + name +
                                            " failed: " + resultString(compiled)
                                      : result.log;
    api.nvrtcDestroyProgram(&program);
    return result;
  }
  if (api.nvrtcGetPTXSize(program, &size) == kNvrtcSuccess && size > 1) {
    result.ptx.resize(size);
    api.nvrtcGetPTX(program, result.ptx.data());
    result.ptx.resize(size - 1);
  }
  if (wantCubin) {
    // compute_XX targets give PTX only and a cubin size of 0.
    if (api.nvrtcGetCUBINSize(program, &size) == kNvrtcSuccess && size > 0) {
      result.cubin.resize(size);
      api.nvrtcGetCUBIN(program, result.cubin.data());
    } else {
      result.error = "NVRTC produced no cubin for " + arch + " (" + name + ")";
    }
  }
  api.nvrtcDestroyProgram(&program);

  if (result.ok() && !cachePath.empty()) {
    // A cache that cannot be written only costs a recompilation later.
    std::error_code ec;
    fs::create_directories(cacheDir, ec);
    llvm::consumeError(
        megaslide::writeFileAtomically(cachePath, serialize(result)));
  }
  return result;
}

//===----------------------------------------------------------------------===//
// ptxas log and occupancy
//===----------------------------------------------------------------------===//

namespace {

/// The integer right before `unit` in `line` (e.g. "12 bytes spill stores"
/// with unit "bytes spill stores" gives 12), or -1.
int numberBefore(const std::string &line, const std::string &unit) {
  size_t at = line.find(unit);
  if (at == std::string::npos)
    return -1;
  size_t end = line.find_last_not_of(' ', at == 0 ? 0 : at - 1);
  if (end == std::string::npos || !std::isdigit(line[end]))
    return -1;
  size_t begin = end;
  while (begin > 0 && std::isdigit(line[begin - 1]))
    --begin;
  return std::atoi(line.substr(begin, end - begin + 1).c_str());
}

/// The text between the first pair of single quotes after `after`.
std::string quotedAfter(const std::string &line, const std::string &after) {
  size_t at = line.find(after);
  if (at == std::string::npos)
    return "";
  size_t open = line.find('\'', at);
  size_t close = open == std::string::npos ? open : line.find('\'', open + 1);
  if (close == std::string::npos)
    return "";
  return line.substr(open + 1, close - open - 1);
}

} // namespace

std::vector<KernelResources> parsePtxasLog(const std::string &log) {
  std::vector<KernelResources> kernels;
  // "Function properties for X" may name a non-inlined device function;
  // its stack/spill line then belongs to X, not to the current kernel.
  std::string propertiesOf;
  KernelResources *current = nullptr;
  auto find = [&](const std::string &name) -> KernelResources * {
    for (KernelResources &k : kernels)
      if (k.kernel == name)
        return &k;
    return nullptr;
  };
  std::istringstream lines(log);
  std::string line;
  while (std::getline(lines, line)) {
    // nvcc prints the stack/spill line without the "ptxas" prefix.
    if (line.find("ptxas") == std::string::npos &&
        line.find("bytes stack frame") == std::string::npos)
      continue;
    if (std::string name = quotedAfter(line, "Compiling entry function");
        !name.empty()) {
      current = find(name);
      if (!current) {
        kernels.push_back(KernelResources{name});
        current = &kernels.back();
      }
      continue;
    }
    if (size_t at = line.find("Function properties for ");
        at != std::string::npos) {
      propertiesOf = line.substr(at + std::strlen("Function properties for "));
      propertiesOf.erase(propertiesOf.find_last_not_of(" \r") + 1);
      continue;
    }
    if (line.find("bytes stack frame") != std::string::npos) {
      if (KernelResources *k = find(propertiesOf)) {
        k->stackBytes = std::max(0, numberBefore(line, "bytes stack frame"));
        k->spillStores = std::max(0, numberBefore(line, "bytes spill stores"));
        k->spillLoads = std::max(0, numberBefore(line, "bytes spill loads"));
      }
      continue;
    }
    if (current && line.find("Used ") != std::string::npos &&
        line.find(" registers") != std::string::npos) {
      current->registers = std::max(0, numberBefore(line, "registers"));
      current->sharedBytes = std::max(0, numberBefore(line, "bytes smem"));
    }
  }
  return kernels;
}

Occupancy occupancySm90(const KernelResources &kernel, int threadsPerBlock,
                        int dynamicSharedBytes) {
  constexpr int kRegsPerSm = 65536, kRegsPerBlock = 65536, kSubPartitions = 4;
  constexpr int kRegGranularity = 256, kMaxRegsPerThread = 255;
  constexpr int kSmemPerSm = 228 * 1024, kSmemPerBlock = 227 * 1024;
  constexpr int kSmemReservedPerBlock = 1024, kSmemGranularity = 128;
  constexpr int kMaxWarpsPerSm = 64, kMaxBlocksPerSm = 32;
  auto roundUp = [](int v, int m) { return (v + m - 1) / m * m; };

  Occupancy occ;
  if (threadsPerBlock <= 0 || threadsPerBlock > 1024) {
    occ.limiter = "cannot launch: " + std::to_string(threadsPerBlock) +
                  " threads per block (1 to 1024)";
    return occ;
  }
  const int warps = (threadsPerBlock + 31) / 32;
  const int regsPerWarp =
      roundUp(std::max(kernel.registers, 1) * 32, kRegGranularity);
  if (kernel.registers > kMaxRegsPerThread ||
      regsPerWarp * roundUp(warps, kSubPartitions) > kRegsPerBlock) {
    occ.limiter = "cannot launch: " + std::to_string(kernel.registers) +
                  " registers x " + std::to_string(threadsPerBlock) +
                  " threads exceed the register file";
    return occ;
  }
  const int smem = kernel.sharedBytes + dynamicSharedBytes;
  if (smem > kSmemPerBlock) {
    occ.limiter = "cannot launch: " + std::to_string(smem) +
                  " bytes of shared memory exceed 227 KB per block";
    return occ;
  }
  // Registers are allocated per SM sub-partition (cuda_occupancy.h).
  const int byRegs =
      (kRegsPerSm / kSubPartitions / regsPerWarp) * kSubPartitions / warps;
  const int bySmem =
      kSmemPerSm / roundUp(smem + kSmemReservedPerBlock, kSmemGranularity);
  const int byThreads = kMaxWarpsPerSm / warps;
  occ.blocksPerSm = std::min({byRegs, bySmem, byThreads, kMaxBlocksPerSm});
  // Name every limit that binds ("registers and threads").
  for (auto [limit, what] : {std::pair<int, const char *>{byRegs, "registers"},
                             {bySmem, "shared memory"},
                             {byThreads, "threads"},
                             {kMaxBlocksPerSm, "blocks"}})
    if (limit == occ.blocksPerSm)
      occ.limiter += (occ.limiter.empty() ? "" : " and ") + std::string(what);
  occ.warpsPerSm = occ.blocksPerSm * warps;
  occ.fraction = double(occ.warpsPerSm) / kMaxWarpsPerSm;
  return occ;
}

} // namespace megaslide::cuda
