//===- CudaBackend.cpp - Runs execution plans on an NVIDIA GPU ------------===//
//
// The backend's resources: the device, its memory, streams and events, the
// compiled kernels and every instruction's device commands, all made once
// in create(); issuing a command.
//
//===----------------------------------------------------------------------===//

#include "megaslide/runtime/cuda/CudaBackendImpl.h"

#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/cuda/Nvrtc.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace megaslide::cuda {

namespace {

uint64_t slotOf(double f, bool isFloat) {
  uint64_t slot = 0;
  if (isFloat) {
    float v = static_cast<float>(f);
    std::memcpy(&slot, &v, sizeof(v));
  } else {
    std::memcpy(&slot, &f, sizeof(f));
  }
  return slot;
}

/// Pinned host memory kept from one backend to the next, per device: a
/// run over buckets destroys one bucket's backend before it creates the
/// next (train::Session::useBucket), and pinning costs about as much as
/// writing the bytes once. The blocks belong to their device's primary
/// context, which the cache therefore retains while it holds any. Per
/// device, so that the backends of ranks run as threads in one process
/// (the tests' jobs) neither trade blocks nor switch each other's context.
struct PinnedCache {
  struct Kept {
    CUcontext ctx = nullptr;
    std::vector<std::pair<void *, size_t>> blocks;
  };
  std::mutex mu;
  std::map<std::pair<const CudaDriverApi *, CUdevice>, Kept> kept;

  /// Frees the blocks of `device` and releases its context (under `mu`),
  /// with that context current as the caller's had it.
  void clear(const CudaDriverApi &cu, CUdevice device) {
    auto it = kept.find({&cu, device});
    if (it == kept.end())
      return;
    cu.cuCtxSetCurrent(it->second.ctx);
    for (auto [p, bytes] : it->second.blocks)
      cu.cuMemFreeHost(p);
    cu.cuDevicePrimaryCtxRelease_v2(device);
    kept.erase(it);
  }
};

PinnedCache &pinnedCache() {
  // Never destroyed: the driver may be gone at exit, so blocks still kept
  // then are left to the process's end (and stay reachable for
  // LeakSanitizer, which checks after static destructors).
  static PinnedCache &cache = *new PinnedCache;
  return cache;
}

/// The blocks an earlier backend on this device left, now the caller's
/// (whose context retain keeps them valid).
std::vector<std::pair<void *, size_t>> takePinnedBlocks(const CudaDriverApi &cu,
                                                        CUdevice device) {
  PinnedCache &c = pinnedCache();
  std::lock_guard<std::mutex> lock(c.mu);
  std::vector<std::pair<void *, size_t>> blocks;
  auto it = c.kept.find({&cu, device});
  if (it != c.kept.end())
    blocks.swap(it->second.blocks);
  c.clear(cu, device);
  return blocks;
}

/// Keeps `blocks` for the next backend on this device (its context
/// current).
void keepPinnedBlocks(const CudaDriverApi &cu, CUdevice device,
                      std::vector<std::pair<void *, size_t>> blocks) {
  PinnedCache &c = pinnedCache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.clear(cu, device);
  CUcontext ctx = nullptr;
  if (cu.cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS) {
    for (auto [p, bytes] : blocks)
      cu.cuMemFreeHost(p);
    return;
  }
  c.kept[{&cu, device}] = {ctx, std::move(blocks)};
}

/// MEGASLIDE_CUDA_SYNC: unset, empty or 0, or 1.
llvm::Expected<bool> syncSetting() {
  const char *v = std::getenv("MEGASLIDE_CUDA_SYNC");
  if (!v || !*v || std::string(v) == "0")
    return false;
  if (std::string(v) == "1")
    return true;
  return llvm::createStringError(
      llvm::inconvertibleErrorCode(),
      "MEGASLIDE_CUDA_SYNC must be 0 or 1 (1: synchronise after every "
      "device command and name the one that fails), not '%s'",
      v);
}

} // namespace

void releasePinnedPools() {
  PinnedCache &c = pinnedCache();
  std::lock_guard<std::mutex> lock(c.mu);
  while (!c.kept.empty()) {
    auto [cu, device] = c.kept.begin()->first;
    c.clear(*cu, device);
  }
}

CudaBackend::Impl::~Impl() {
  worker.shutdown();
  stager.shutdown();
  if (!cu)
    return;
  if (ctx)
    cu->cuCtxSetCurrent(ctx);
  for (CUstream s : streams)
    if (s)
      cu->cuStreamSynchronize(s);
  gemms.destroy();
  for (auto *events :
       {&planEvents, &doneEvents, &startEvents, &endEvents, &copyEvents})
    for (CUevent e : *events)
      if (e)
        cu->cuEventDestroy_v2(e);
  for (CUevent e : idleEvents)
    if (e)
      cu->cuEventDestroy_v2(e);
  for (CUevent e : {baseEvent, lossEvent})
    if (e)
      cu->cuEventDestroy_v2(e);
  collectives.reset(); // its stream is idle: every step synchronises it
  if (elementwiseModule)
    cu->cuModuleUnload(elementwiseModule);
  for (CUmodule m : dsaModules)
    if (m)
      cu->cuModuleUnload(m);
  for (CUdeviceptr p : {arena, scratch, dsaScratch, gemmWorkspace})
    if (p)
      cu->cuMemFree_v2(p);
  // Nothing is in flight (the streams are synchronised above): the pinned
  // blocks can serve the next backend.
  if (!pinnedBlocks.empty())
    keepPinnedBlocks(*cu, info.device, std::move(pinnedBlocks));
  for (CUstream s : streams)
    if (s)
      cu->cuStreamDestroy_v2(s);
  if (ctx)
    cu->cuDevicePrimaryCtxRelease_v2(info.device);
}

llvm::Error CudaBackend::Impl::init() {
  if (options.driver) {
    cu = options.driver;
  } else {
    llvm::Expected<const CudaDriverApi *> driver = loadCudaDriver();
    if (!driver)
      return driver.takeError();
    cu = *driver;
  }
  int ordinal = options.device;
  if (ordinal < 0 && !options.job)
    ordinal = 0;
  if (ordinal < 0) {
    // One GPU per rank of the node.
    int count = 0, local = options.job ? options.job->world().localRank : 0;
    if (cu->cuInit(0) == CUDA_SUCCESS &&
        cu->cuDeviceGetCount(&count) == CUDA_SUCCESS && count > 0)
      ordinal = count == 1 ? 0 : local;
    if (count > 1 && local >= count)
      return llvm::createStringError(llvm::formatv(
          "this rank is local rank {0} of {1} on its node, which has {2} "
          "CUDA devices: launch at most one rank per GPU (or give each rank "
          "one: CUDA_VISIBLE_DEVICES, srun --gpus-per-task 1)",
          local, options.job->world().localSize, count));
  }
  llvm::Expected<CudaDeviceInfo> device = initCudaDevice(*cu, ordinal);
  if (!device)
    return device.takeError();
  info = *device;
  if (options.cublasLt) {
    lt = options.cublasLt;
  } else {
    llvm::Expected<const CublasLtApi *> blas = loadCublasLt();
    if (!blas)
      return blas.takeError();
    lt = *blas;
  }
  std::string whyNot;
  if (!nvrtcAvailable(&whyNot))
    return llvm::createStringError(llvm::inconvertibleErrorCode(), whyNot);
  arch = options.arch;
  if (arch.empty())
    arch = "sm_" + std::to_string(info.ccMajor) + std::to_string(info.ccMinor) +
           (info.ccMajor == 9 && info.ccMinor == 0 ? "a" : "");

  if (auto e = check(cu->cuDevicePrimaryCtxRetain(&ctx, info.device),
                     "cuDevicePrimaryCtxRetain"))
    return e;
  if (auto e = check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent"))
    return e;
  // Modules and the cuBLASLt handle first, so that the free memory
  // measured below is what the arena can have.
  std::vector<std::map<std::string, CUfunction>> dsaFns;
  std::map<std::string, CUfunction> dense;
  if (auto e = compileKernels(dsaFns, dense))
    return e;
  auto alloc = [&](CUdeviceptr &p, int64_t bytes, const char *what) {
    return check(cu->cuMemAlloc_v2(&p, std::max<int64_t>(bytes, 256)),
                 llvm::Twine("cuMemAlloc (") + what + ", " +
                     llvm::Twine(bytes) + " bytes)");
  };
  if (auto e = alloc(gemmWorkspace, options.gemmWorkspaceBytes,
                     "cuBLASLt workspace"))
    return e;
  if (auto e = gemms.init(*lt, gemmWorkspace, options.gemmWorkspaceBytes))
    return e;
  if (auto e = check(cu->cuMemGetInfo_v2(&info.freeBytes, &info.totalBytes),
                     "cuMemGetInfo"))
    return e;

  // Runtime budget guard. First the plan against the budget the planner
  // checked it against (msched.budget_check, carried in the header): an
  // arena beyond it is not what was planned for this device.
  if (plan.arenaBudgetBytes && plan.arenaBytes > *plan.arenaBudgetBytes)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "the plan's device arena is %lld bytes but the plan was checked "
        "against an arena budget of %lld bytes (its arena_budget_bytes: "
        "--gpu-mem less --gpu-reserve); recompile the plan",
        static_cast<long long>(plan.arenaBytes),
        static_cast<long long>(*plan.arenaBudgetBytes));
  // Then everything the step needs on the device, up front, with the free
  // memory in the message, and a margin for what takes device memory
  // later: local memory, which the driver reserves for every thread the
  // device holds at once when a launch needs more than it has (counted at
  // 1 KiB a thread, the default stack limit; our kernels do not spill,
  // cuBLASLt's may use a stack), and the code of kernels loaded on their
  // first use (cuBLASLt's, under CUDA_MODULE_LOADING=LAZY, the default
  // since CUDA 12.2).
  constexpr int64_t kLocalBytesPerThread = 1024;
  constexpr int64_t kLazyCodeBytes = int64_t(64) << 20;
  int64_t residentThreads =
      int64_t(info.multiprocessors) * info.maxThreadsPerMultiprocessor;
  int64_t margin = kLocalBytesPerThread * residentThreads + kLazyCodeBytes;
  int64_t deviceBytes = std::max<int64_t>(plan.arenaBytes, 256) +
                        alignTo(prep.scratchBytes, 256) + prep.dsaFallbackBytes;
  if (static_cast<uint64_t>(deviceBytes + margin) > info.freeBytes)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "the plan needs %lld bytes of device memory (arena %lld, scratch "
        "%lld) and the cuda backend keeps a margin of %lld bytes (1 KiB of "
        "local memory for each of the %lld threads the device holds at "
        "once, 64 MiB for code loaded on first use), but %s has %zu bytes "
        "free once the kernels, cuBLASLt and its workspace (%lld bytes) are "
        "loaded",
        static_cast<long long>(deviceBytes),
        static_cast<long long>(plan.arenaBytes),
        static_cast<long long>(prep.scratchBytes + prep.dsaFallbackBytes),
        static_cast<long long>(margin), static_cast<long long>(residentThreads),
        info.name.c_str(), info.freeBytes,
        static_cast<long long>(options.gemmWorkspaceBytes));
  if (auto e = alloc(arena, plan.arenaBytes, "arena"))
    return e;
  if (auto e = alloc(scratch, prep.scratchBytes, "kernel scratch"))
    return e;
  if (prep.dsaFallbackBytes)
    if (auto e = alloc(dsaScratch, prep.dsaFallbackBytes, "3D-DSA scratch"))
      return e;
  if (auto e = allocatePinned())
    return e;

  for (CUstream &s : streams)
    if (auto e = check(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING),
                       "cuStreamCreate"))
      return e;
  // Host threads wait on events: blocking, not spinning (syncStream).
  auto event = [&](CUevent &e, unsigned flags) {
    return check(cu->cuEventCreate(&e, flags | CU_EVENT_BLOCKING_SYNC),
                 "cuEventCreate");
  };
  if (auto e = event(baseEvent, CU_EVENT_DEFAULT))
    return e;
  if (auto e = event(lossEvent, CU_EVENT_DISABLE_TIMING))
    return e;
  for (CUevent &ev : idleEvents)
    if (auto e = event(ev, CU_EVENT_DISABLE_TIMING))
      return e;
  // Zeroed once, like the cpu backend's arena: a step never reads bytes
  // it did not write, but garbage would make such a bug nondeterministic.
  if (auto e = check(
          cu->cuMemsetD8Async(arena, 0, std::max<int64_t>(plan.arenaBytes, 256),
                              streams[0]),
          "cuMemsetD8Async (arena)"))
    return e;
  if (auto e = syncStream(0, "zeroing the arena"))
    return e;
  size_t n = plan.instructions.size();
  planEvents.resize(plan.numEvents);
  for (CUevent &ev : planEvents)
    if (auto e = event(ev, CU_EVENT_DISABLE_TIMING))
      return e;
  doneEvents.resize(n);
  startEvents.resize(n);
  endEvents.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (prep.needsDoneEvent[i])
      if (auto e = event(doneEvents[i], CU_EVENT_DISABLE_TIMING))
        return e;
    const exec::Instruction &inst = plan.instructions[i];
    if (isGpuStream(inst.stream) && inst.op != exec::OpCode::Record &&
        inst.op != exec::OpCode::Wait) {
      if (auto e = event(startEvents[i], CU_EVENT_DEFAULT))
        return e;
      if (auto e = event(endEvents[i], CU_EVENT_DEFAULT))
        return e;
    }
  }
  copyEvents.resize(prep.fetches.size());
  for (CUevent &ev : copyEvents)
    if (auto e = event(ev, CU_EVENT_DISABLE_TIMING))
      return e;

  if (auto e = buildCommands(dsaFns, dense))
    return e;

  CUcontext context = ctx;
  const CudaDriverApi *api = cu;
  worker.start([api, context] { api->cuCtxSetCurrent(context); });
  stager.start([api, context] { api->cuCtxSetCurrent(context); },
               static_cast<uint8_t *>(staging), prep.stagingBytes,
               [this](int64_t k) -> std::string {
                 CUresult r = cu->cuEventSynchronize(copyEvents[k]);
                 if (r == CUDA_SUCCESS)
                   return {};
                 return "cuEventSynchronize (staging, fetch #" +
                        std::to_string(prep.fetches[k]) +
                        "): " + cuResultString(*cu, r);
               });
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::allocatePinned() {
  struct Pool {
    void **p;
    int64_t bytes;
    const char *what;
  };
  std::vector<Pool> pools = {{&hostPool, prep.hostPoolBytes, "host values"},
                             {&staging, prep.stagingBytes, "weight staging"},
                             {&inputPool, prep.inputPoolBytes, "step inputs"},
                             {&lossStage, 8, "loss"}};
  for (Pool &pool : pools)
    pool.bytes = std::max<int64_t>(pool.bytes, 256);
  // The largest pool first takes the smallest kept block that holds it.
  llvm::stable_sort(
      pools, [](const Pool &a, const Pool &b) { return a.bytes > b.bytes; });
  std::vector<std::pair<void *, size_t>> kept =
      takePinnedBlocks(*cu, info.device);
  llvm::sort(kept, [](auto &a, auto &b) { return a.second < b.second; });
  std::vector<Pool> missing;
  int64_t keptBytes = 0;
  for (const Pool &pool : pools) {
    auto it = llvm::find_if(kept, [&](auto &b) {
      return b.second >= static_cast<size_t>(pool.bytes);
    });
    if (it == kept.end()) {
      missing.push_back(pool);
      continue;
    }
    *pool.p = it->first;
    keptBytes += it->second;
    pinnedBlocks.push_back(*it);
    kept.erase(it);
  }
  // Too small for this plan: pinned again at the size it needs.
  for (auto [p, bytes] : kept)
    cu->cuMemFreeHost(p);
  using Clock = std::chrono::steady_clock;
  Clock::time_point start = Clock::now();
  int64_t pinnedBytes = 0;
  for (const Pool &pool : missing) {
    if (auto e = check(
            cu->cuMemHostAlloc(pool.p, pool.bytes, CU_MEMHOSTALLOC_PORTABLE),
            llvm::Twine("cuMemHostAlloc (") + pool.what + ", " +
                llvm::Twine(pool.bytes) + " bytes)"))
      return e;
    pinnedBlocks.push_back({*pool.p, static_cast<size_t>(pool.bytes)});
    pinnedBytes += pool.bytes;
  }
  // Pinning takes seconds for tens of GB; what the run paid is said once
  // per backend that paid it (scripts read this line).
  if (pinnedBytes)
    std::fprintf(
        stderr,
        "megaslide: cuda backend: pinned %lld bytes of host memory in %.3f "
        "s (%lld bytes kept from the previous backend)\n",
        static_cast<long long>(pinnedBytes),
        std::chrono::duration<double>(Clock::now() - start).count(),
        static_cast<long long>(keptBytes));
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::compileKernels(
    std::vector<std::map<std::string, CUfunction>> &dsaFns,
    std::map<std::string, CUfunction> &dense) {
  auto load = [&](const std::string &source, const std::string &name,
                  CUmodule &module) -> llvm::Error {
    CompileResult r = compileCuda(source, name, arch);
    if (!r.ok())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "NVRTC cannot compile " + name + " for " +
                                         arch + ":\n" + r.error);
    if (r.cubin.empty())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "NVRTC gave no cubin for " + name +
                                         " (architecture " + arch + ")");
    return check(cu->cuModuleLoadData(&module, r.cubin.data()),
                 "cuModuleLoadData (" + name + ")");
  };
  if (!prep.kernels.empty()) {
    if (auto e = load(prep.elementwiseSource, "megaslide_dense.cu",
                      elementwiseModule))
      return e;
    for (const KernelInstance &k : prep.kernels) {
      CUfunction f = nullptr;
      if (auto e = check(
              cu->cuModuleGetFunction(&f, elementwiseModule, k.name().c_str()),
              "cuModuleGetFunction (" + k.name() + ")"))
        return e;
      dense[k.name()] = f;
    }
  }
  dsaModules.resize(prep.dsaModules.size());
  dsaFns.resize(prep.dsaModules.size());
  for (size_t m = 0; m < prep.dsaModules.size(); ++m) {
    // Only modules an instruction uses are compiled.
    bool used =
        llvm::any_of(prep.instructions, [&](const PreparedInstruction &p) {
          return p.dsaModule == static_cast<int64_t>(m);
        });
    if (!used)
      continue;
    const exec::KernelModule &km = plan.kernelModules[m];
    if (auto e = load(km.source, km.name + ".cu", dsaModules[m]))
      return e;
    for (auto &[kind, spec] : prep.dsaModules[m].kernels) {
      CUfunction f = nullptr;
      if (auto e = check(
              cu->cuModuleGetFunction(&f, dsaModules[m], spec.name.c_str()),
              "cuModuleGetFunction (" + spec.name + ")"))
        return e;
      if (spec.dynamicSharedBytes > 48 * 1024)
        if (auto e =
                check(cu->cuFuncSetAttribute(
                          f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                          static_cast<int>(spec.dynamicSharedBytes)),
                      "cuFuncSetAttribute (" + spec.name + ")"))
          return e;
      dsaFns[m][kind] = f;
    }
  }
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::buildCommands(
    const std::vector<std::map<std::string, CUfunction>> &dsaFns,
    const std::map<std::string, CUfunction> &dense) {
  commands.resize(plan.instructions.size());
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    const PreparedInstruction &pi = prep.instructions[i];
    std::vector<DeviceCmd> &out = commands[i];
    if (pi.lowered) {
      auto resolve = [&](const BufferRef &r) -> CUdeviceptr {
        CUdeviceptr offset = static_cast<CUdeviceptr>(r.offset);
        switch (r.kind) {
        case BufferRef::Operand:
          return deviceAddress(inst.operands[r.index]) + offset;
        case BufferRef::Result:
          return deviceAddress(inst.results[r.index]) + offset;
        case BufferRef::Scratch:
          return scratch + r.index + offset;
        }
        return 0;
      };
      for (const LoweredStep &s : pi.lowered->steps) {
        if (auto *l = std::get_if<KernelLaunch>(&s)) {
          LaunchCmd c;
          c.name = l->kernel.name();
          c.function = dense.at(c.name);
          c.grid = l->grid;
          c.block = kernelBlockThreads(c.name);
          std::vector<std::string> types = kernelParameterTypes(l->kernel);
          if (types.size() != l->args.size())
            return instError(i, inst,
                             "kernel " + c.name + " takes " +
                                 llvm::Twine(types.size()) +
                                 " arguments, the lowering gives " +
                                 llvm::Twine(l->args.size()));
          for (auto [arg, type] : llvm::zip(l->args, types)) {
            switch (arg.kind) {
            case KernelArg::Buffer:
              c.args.push_back(resolve(arg.buffer));
              break;
            case KernelArg::Null:
              c.args.push_back(0);
              break;
            case KernelArg::I64:
              c.args.push_back(static_cast<uint64_t>(arg.i));
              break;
            case KernelArg::F32:
              c.args.push_back(slotOf(arg.f, true));
              break;
            case KernelArg::F64:
              c.args.push_back(slotOf(arg.f, false));
              break;
            }
          }
          out.push_back(std::move(c));
        } else if (auto *g = std::get_if<GemmCall>(&s)) {
          llvm::Expected<size_t> gemm =
              gemms.add(*g, resolve(g->a), resolve(g->b), resolve(g->d),
                        g->hasBias ? resolve(g->bias) : 0);
          if (!gemm)
            return instError(i, inst, llvm::toString(gemm.takeError()));
          out.push_back(GemmCmd{*gemm});
        } else if (auto *m = std::get_if<MemsetCall>(&s)) {
          out.push_back(
              MemsetCmd{resolve(m->dst), static_cast<size_t>(m->bytes)});
        } else if (auto *c = std::get_if<CopyCall>(&s)) {
          out.push_back(CopyCmd{resolve(c->src), resolve(c->dst),
                                static_cast<size_t>(c->bytes)});
        }
      }
      continue;
    }
    if (pi.dsaModule < 0)
      continue;
    const DsaModuleSpec &spec = prep.dsaModules[pi.dsaModule];
    const auto &fns = dsaFns[pi.dsaModule];
    const exec::TensorType &q = plan.values[inst.operands[0]].type;
    int64_t batch = q.shape[0];
    double scale =
        inst.floatAttr("scale").value_or(1.0 / std::sqrt(double(q.shape[3])));
    auto launch = [&](const char *kind, std::vector<uint64_t> args) {
      const DsaKernelSpec &k = spec.kernels.at(kind);
      LaunchCmd c;
      c.name = k.name;
      c.function = fns.at(kind);
      c.grid = {static_cast<uint32_t>(k.grid[0]),
                static_cast<uint32_t>(k.grid[1]), static_cast<uint32_t>(batch)};
      c.block = static_cast<uint32_t>(k.threads);
      c.sharedBytes = static_cast<uint32_t>(k.dynamicSharedBytes);
      c.args = std::move(args);
      out.push_back(std::move(c));
    };
    auto op = [&](size_t k) { return deviceAddress(inst.operands[k]); };
    auto res = [&](size_t k) { return deviceAddress(inst.results[k]); };
    if (inst.op == exec::OpCode::Dsa3dOffsets) {
      launch("offsets", {op(0), op(1), res(0)});
    } else if (inst.op == exec::OpCode::Dsa3d) {
      launch("forward",
             {op(0), op(1), op(2), op(3), res(0), res(1), slotOf(scale, true)});
    } else {
      // (q, k, v, offsets, o, lse, dout) -> (dq, dk, dv). The backward
      // writes dQ and Delta; the dK/dV kernel, owning key tiles, reads
      // Delta and writes dK and dV once (no accumulators, no memset).
      CUdeviceptr delta =
          pi.deltaOffset >= 0 ? arena + pi.deltaOffset : dsaScratch;
      launch("backward", {op(0), op(1), op(2), op(3), op(4), op(6), op(5),
                          res(0), delta, slotOf(scale, true)});
      launch("backward_keys", {op(0), op(1), op(2), op(3), op(6), op(5), delta,
                               res(1), res(2), slotOf(scale, true)});
    }
  }
  return llvm::Error::success();
}

llvm::Error CudaBackend::Impl::issue(const DeviceCmd &cmd, CUstream stream) {
  if (auto *l = std::get_if<LaunchCmd>(&cmd)) {
    std::vector<void *> params(l->args.size());
    for (size_t i = 0; i < params.size(); ++i)
      params[i] = const_cast<uint64_t *>(&l->args[i]);
    return check(cu->cuLaunchKernel(l->function, l->grid[0], l->grid[1],
                                    l->grid[2], l->block, 1, 1, l->sharedBytes,
                                    stream, params.data(), nullptr),
                 "cuLaunchKernel (" + l->name + ")");
  }
  if (auto *g = std::get_if<GemmCmd>(&cmd)) {
    llvm::Error e = gemms.run(g->index, stream);
    if (!e)
      return e;
    // cuBLASLt reports an earlier kernel's fault (a sticky error) only as a
    // failed call: the stream says what it was, and that the process must
    // restart, as every other call that meets it does.
    CUresult r = cu->cuStreamSynchronize(stream);
    if (!isStickyCudaError(r))
      return e;
    return check(r, llvm::toString(std::move(e)) + "; the stream");
  }
  if (auto *m = std::get_if<MemsetCmd>(&cmd))
    return check(cu->cuMemsetD8Async(m->dst, 0, m->bytes, stream),
                 "cuMemsetD8Async");
  const CopyCmd &c = std::get<CopyCmd>(cmd);
  if (c.src == c.dst || c.bytes == 0)
    return llvm::Error::success();
  return check(cu->cuMemcpyDtoDAsync_v2(c.dst, c.src, c.bytes, stream),
               "cuMemcpyDtoDAsync");
}

llvm::Error CudaBackend::Impl::issueCommands(size_t i, int s) {
  const exec::Instruction &inst = plan.instructions[i];
  for (const DeviceCmd &cmd : commands[i]) {
    if (auto e = issue(cmd, streams[s]))
      return instError(i, inst, llvm::toString(std::move(e)));
    if (!syncEach)
      continue;
    if (auto e = syncStream(s, "MEGASLIDE_CUDA_SYNC=1")) {
      std::string what;
      if (auto *l = std::get_if<LaunchCmd>(&cmd))
        what = "kernel " + l->name;
      else if (std::holds_alternative<GemmCmd>(cmd))
        what = "its cuBLASLt GEMM";
      else if (std::holds_alternative<MemsetCmd>(cmd))
        what = "its memset";
      else
        what = "its device-to-device copy";
      return instError(
          i, inst,
          what + " failed on the GPU: " + llvm::toString(std::move(e)));
    }
  }
  return llvm::Error::success();
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl)
    : impl(std::move(impl)), runner(std::make_unique<exec::StepRunner>(
                                 this->impl->plan, *this->impl)) {}
CudaBackend::~CudaBackend() = default;

const CudaDeviceInfo &CudaBackend::deviceInfo() const { return impl->info; }
std::shared_ptr<DeviceCollectives> CudaBackend::deviceCollectives() const {
  return impl->collectives;
}
const PreparedPlan &CudaBackend::prepared() const { return impl->prep; }

llvm::Expected<std::unique_ptr<CudaBackend>>
CudaBackend::create(const exec::ExecPlan &plan, const CudaOptions &options) {
  // The host AdamW runs on the CPU kernels' ISA and worker pool.
  if (const char *error = cpu::cpuSettingsError())
    return llvm::createStringError(error);
  llvm::Expected<bool> sync = syncSetting();
  // A job's plan runs on each rank of that job: what every rank knows
  // alike is checked before any of them waits for the others.
  int64_t ranks = plan.jobRanks();
  int size = options.job ? options.job->size() : 1;
  if (ranks != size)
    return llvm::createStringError(llvm::formatv(
        "the plan is for a job of {0} rank(s) and this process is {1}: "
        "{2}",
        ranks,
        size > 1 ? llvm::formatv("rank {0} of a job of {1}",
                                 options.job->rank(), size)
                       .str()
                 : std::string("not a rank of a job"),
        size > 1 ? "plan the step for the job (megaslide-run does, with the "
                   "launcher's world; a saved plan: megaslide-plan "
                   "--gpus-per-node, --nodes)"
                 : "launch one process per GPU (mpirun -np N, srun -n N; "
                   "docs/Distributed.md)"));
  auto impl = std::make_unique<Impl>(plan, options);
  llvm::Error failed = llvm::Error::success();
  if (sync)
    impl->syncEach = *sync;
  else
    failed = sync.takeError();
  if (!failed) {
    llvm::Expected<PreparedPlan> prep = prepareCudaPlan(plan, options);
    if (prep)
      impl->prep = std::move(*prep);
    else
      failed = prep.takeError();
  }
  if (!failed)
    failed = impl->init();
  if (ranks > 1) {
    if (failed) {
      // The others are making the communicator: they learn that this
      // rank failed (DeviceCollectives::create), instead of waiting.
      if (!options.collectives)
        if (auto sent = options.job->allGather(""); !sent)
          llvm::consumeError(sent.takeError());
      return std::move(failed);
    }
    failed = impl->joinJob();
  }
  if (failed)
    return std::move(failed);
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

llvm::Error CudaBackend::Impl::joinJob() {
  jobRank = options.job->rank();
  jobSize = options.job->size();
  if ((collectives = options.collectives)) {
    if (collectives->rank() != jobRank || collectives->size() != jobSize)
      return llvm::createStringError(llvm::formatv(
          "the device collectives given are rank {0} of {1}, this backend "
          "rank {2} of {3}",
          collectives->rank(), collectives->size(), jobRank, jobSize));
    return llvm::Error::success();
  }
  const NcclApi *nccl = options.nccl;
  llvm::Error failed = llvm::Error::success();
  if (!nccl) {
    llvm::Expected<const NcclApi *> loaded = loadNccl();
    if (loaded)
      nccl = *loaded;
    else
      failed = loaded.takeError();
  }
  if (failed) {
    if (auto sent = options.job->allGather(""); !sent)
      llvm::consumeError(sent.takeError());
    return failed;
  }
  llvm::Expected<std::unique_ptr<DeviceCollectives>> made =
      DeviceCollectives::create(*cu, *nccl, *options.job, info.device);
  if (!made)
    return made.takeError();
  collectives = std::move(*made);
  return llvm::Error::success();
}

bool cudaDeviceAvailable(std::string *whyNot) {
  llvm::Expected<const CudaDriverApi *> driver = loadCudaDriver();
  if (!driver) {
    std::string why = llvm::toString(driver.takeError());
    if (whyNot)
      *whyNot = why;
    return false;
  }
  llvm::Expected<CudaDeviceInfo> device = initCudaDevice(**driver, 0);
  if (!device) {
    std::string why = llvm::toString(device.takeError());
    if (whyNot)
      *whyNot = why;
    return false;
  }
  return true;
}

} // namespace megaslide::cuda
