//===- CudaBackend.cpp - Executes execution plans on an NVIDIA GPU --------===//

#include "cuda/CudaBackend.h"

#include "cpu/AdamW.h"
#include "cpu/CpuBackend.h"
#include "cpu/Finite.h"
#include "cuda/Gemm.h"
#include "cuda/HostWorker.h"
#include "cuda/Nvrtc.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <variant>

namespace megaslide::cuda {

using exec::DType;
using exec::Home;
using exec::Stream;

//===----------------------------------------------------------------------===//
// Host helpers
//===----------------------------------------------------------------------===//

namespace {

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

/// Runs body(begin, end) over [0, n) on up to 8 threads for large n.
void parallelChunks(int64_t n,
                    const std::function<void(int64_t, int64_t)> &body) {
  int64_t threads = std::min<int64_t>(
      {8, std::max<unsigned>(1, std::thread::hardware_concurrency()),
       std::max<int64_t>(1, n >> 20)});
  if (threads <= 1) {
    body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b < e)
      pool.emplace_back(body, b, e);
  }
  for (std::thread &t : pool)
    t.join();
}

/// fp32 -> the plan's dtype (bf16 rounds to nearest even, as the cpu backend).
void narrow(const float *src, DType dtype, int64_t n, void *dst) {
  parallelChunks(n, [&](int64_t b, int64_t e) {
    switch (dtype) {
    case DType::BF16: {
      uint16_t *d = static_cast<uint16_t *>(dst);
      for (int64_t i = b; i < e; ++i)
        d[i] = cpu::floatToBf16(src[i]);
      return;
    }
    case DType::F16: {
      uint16_t *d = static_cast<uint16_t *>(dst);
      for (int64_t i = b; i < e; ++i)
        d[i] = cpu::floatToHalf(src[i]);
      return;
    }
    case DType::F32:
      std::memcpy(static_cast<float *>(dst) + b, src + b, (e - b) * 4);
      return;
    case DType::I32: {
      int32_t *d = static_cast<int32_t *>(dst);
      for (int64_t i = b; i < e; ++i)
        d[i] = static_cast<int32_t>(src[i]);
      return;
    }
    case DType::I64: {
      int64_t *d = static_cast<int64_t *>(dst);
      for (int64_t i = b; i < e; ++i)
        d[i] = static_cast<int64_t>(src[i]);
      return;
    }
    }
  });
}

void widen(const void *src, DType dtype, int64_t n, float *dst) {
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype) {
    case DType::BF16:
      dst[i] = cpu::bf16ToFloat(static_cast<const uint16_t *>(src)[i]);
      break;
    case DType::F16:
      dst[i] = cpu::halfToFloat(static_cast<const uint16_t *>(src)[i]);
      break;
    case DType::F32:
      dst[i] = static_cast<const float *>(src)[i];
      break;
    case DType::I32:
      dst[i] = static_cast<float>(static_cast<const int32_t *>(src)[i]);
      break;
    case DType::I64:
      dst[i] = static_cast<float>(static_cast<const int64_t *>(src)[i]);
      break;
    }
  }
}

/// A kernel launch with its arguments, each in an 8-byte slot (a float
/// sits in the slot's first bytes, as cuLaunchKernel reads it).
struct LaunchCmd {
  CUfunction function = nullptr;
  std::array<uint32_t, 3> grid{1, 1, 1};
  uint32_t block = 1, sharedBytes = 0;
  std::vector<uint64_t> args;
  std::string name;
};
struct GemmCmd {
  size_t index = 0;
};
struct MemsetCmd {
  CUdeviceptr dst = 0;
  size_t bytes = 0;
};
struct CopyCmd {
  CUdeviceptr src = 0, dst = 0;
  size_t bytes = 0;
};
using DeviceCmd = std::variant<LaunchCmd, GemmCmd, MemsetCmd, CopyCmd>;

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

} // namespace

//===----------------------------------------------------------------------===//
// The backend
//===----------------------------------------------------------------------===//

struct CudaBackend::Impl {
  const exec::ExecPlan &plan;
  CudaOptions options;
  PreparedPlan prep;
  const CudaDriverApi *cu = nullptr;
  const CublasLtApi *lt = nullptr;
  CudaDeviceInfo info;
  CUcontext ctx = nullptr;
  std::string arch;

  CUdeviceptr arena = 0, scratch = 0, dsaScratch = 0, gemmWorkspace = 0;
  void *inputPool = nullptr, *hostPool = nullptr, *staging = nullptr;
  void *lossStage = nullptr; ///< pinned: the loss, read by the first update
  CUstream streams[3] = {nullptr, nullptr, nullptr};
  /// Recorded at the end of a stream's work to wait for it (syncStream).
  CUevent idleEvents[3] = {nullptr, nullptr, nullptr};
  CUevent baseEvent = nullptr, lossEvent = nullptr;
  std::vector<CUevent> planEvents, doneEvents, startEvents, endEvents,
      slotEvents;
  std::vector<bool> slotUsed;
  CUmodule elementwiseModule = nullptr;
  std::vector<CUmodule> dsaModules;
  GemmPlans gemms;
  std::vector<std::vector<DeviceCmd>> commands; ///< per instruction
  HostWorker worker;
  std::mutex errorMu;
  std::string workerError;

  Impl(const exec::ExecPlan &plan, const CudaOptions &options)
      : plan(plan), options(options) {}
  ~Impl();

  llvm::Error check(CUresult r, const llvm::Twine &what) const {
    return checkCu(*cu, r, what);
  }
  llvm::Error init();
  llvm::Error
  compileKernels(std::vector<std::map<std::string, CUfunction>> &dsaFns,
                 std::map<std::string, CUfunction> &dense);
  llvm::Error
  buildCommands(const std::vector<std::map<std::string, CUfunction>> &dsaFns,
                const std::map<std::string, CUfunction> &dense);
  llvm::Error issue(const DeviceCmd &cmd, CUstream stream);

  CUdeviceptr deviceAddress(int64_t id) const {
    return arena + static_cast<CUdeviceptr>(deviceOffset(plan, id));
  }
  uint8_t *hostAddress(int64_t id) const {
    const exec::Value &v = plan.values[id];
    uint8_t *base =
        static_cast<uint8_t *>(v.home == Home::Input ? inputPool : hostPool);
    return base + prep.hostOffset[id];
  }
  CUstream streamOf(Stream s) const {
    return streams[std::min(static_cast<int>(s), 2)];
  }
  /// Records `event` on streams[s] and waits until the stream has run all
  /// it was given. Through an event: with the context's default
  /// scheduling, cuStreamSynchronize spins a core while the GPU works, and
  /// the host AdamW needs the cores.
  llvm::Error syncStream(int s, const llvm::Twine &what,
                         CUevent event = nullptr) {
    event = event ? event : idleEvents[s];
    llvm::Error e = check(cu->cuEventRecord(event, streams[s]),
                          "cuEventRecord (" + what + ")");
    if (!e)
      e = check(cu->cuEventSynchronize(event),
                "cuEventSynchronize (" + what + ")");
    // Even so, nothing may stay in flight: pinned buffers are reused.
    if (e)
      cu->cuStreamSynchronize(streams[s]);
    return e;
  }
  void setWorkerError(const std::string &e) {
    std::lock_guard<std::mutex> lock(errorMu);
    if (workerError.empty())
      workerError = e;
  }
  bool workerFailed() {
    std::lock_guard<std::mutex> lock(errorMu);
    return !workerError.empty();
  }
};

CudaBackend::Impl::~Impl() {
  worker.shutdown();
  if (!cu)
    return;
  if (ctx)
    cu->cuCtxSetCurrent(ctx);
  for (CUstream s : streams)
    if (s)
      cu->cuStreamSynchronize(s);
  gemms.destroy();
  for (auto *events :
       {&planEvents, &doneEvents, &startEvents, &endEvents, &slotEvents})
    for (CUevent e : *events)
      if (e)
        cu->cuEventDestroy_v2(e);
  for (CUevent e :
       {baseEvent, lossEvent, idleEvents[0], idleEvents[1], idleEvents[2]})
    if (e)
      cu->cuEventDestroy_v2(e);
  if (elementwiseModule)
    cu->cuModuleUnload(elementwiseModule);
  for (CUmodule m : dsaModules)
    if (m)
      cu->cuModuleUnload(m);
  for (CUdeviceptr p : {arena, scratch, dsaScratch, gemmWorkspace})
    if (p)
      cu->cuMemFree_v2(p);
  for (void *p : {inputPool, hostPool, staging, lossStage})
    if (p)
      cu->cuMemFreeHost(p);
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
  llvm::Expected<CudaDeviceInfo> device = initCudaDevice(*cu, options.device);
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
  if (auto e = check(cu->cuMemGetInfo_v2(&info.freeBytes, &info.totalBytes),
                     "cuMemGetInfo"))
    return e;

  // Runtime budget guard: everything the step needs on the device, up
  // front, with the free memory in the message.
  int64_t deviceBytes = std::max<int64_t>(plan.arenaBytes, 256) +
                        alignUp(prep.scratchBytes, 256) +
                        prep.dsaFallbackBytes + options.gemmWorkspaceBytes;
  if (static_cast<uint64_t>(deviceBytes) > info.freeBytes)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "the plan needs %lld bytes of device memory (arena %lld, scratch "
        "%lld, cuBLASLt workspace %lld) but %s has %zu bytes free",
        static_cast<long long>(deviceBytes),
        static_cast<long long>(plan.arenaBytes),
        static_cast<long long>(prep.scratchBytes + prep.dsaFallbackBytes),
        static_cast<long long>(options.gemmWorkspaceBytes), info.name.c_str(),
        info.freeBytes);
  auto alloc = [&](CUdeviceptr &p, int64_t bytes, const char *what) {
    return check(cu->cuMemAlloc_v2(&p, std::max<int64_t>(bytes, 256)),
                 llvm::Twine("cuMemAlloc (") + what + ", " +
                     llvm::Twine(bytes) + " bytes)");
  };
  if (auto e = alloc(arena, plan.arenaBytes, "arena"))
    return e;
  if (auto e = alloc(scratch, prep.scratchBytes, "kernel scratch"))
    return e;
  if (prep.dsaFallbackBytes)
    if (auto e = alloc(dsaScratch, prep.dsaFallbackBytes, "3D-DSA scratch"))
      return e;
  if (auto e = alloc(gemmWorkspace, options.gemmWorkspaceBytes,
                     "cuBLASLt workspace"))
    return e;
  auto pinned = [&](void *&p, int64_t bytes, const char *what) {
    return check(cu->cuMemHostAlloc(&p, std::max<int64_t>(bytes, 256),
                                    CU_MEMHOSTALLOC_PORTABLE),
                 llvm::Twine("cuMemHostAlloc (") + what + ", " +
                     llvm::Twine(bytes) + " bytes)");
  };
  int slots = std::max(options.stagingSlots, 1);
  if (auto e = pinned(inputPool, prep.inputPoolBytes, "step inputs"))
    return e;
  if (auto e = pinned(hostPool, prep.hostPoolBytes, "host values"))
    return e;
  int64_t slotBytes =
      alignUp(std::max<int64_t>(prep.stagingSlotBytes, 1), 4096);
  if (auto e = pinned(staging, slotBytes * slots, "weight staging"))
    return e;
  if (auto e = pinned(lossStage, 8, "loss"))
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
    if (isGpuStream(inst.stream) && inst.op != "record" && inst.op != "wait") {
      if (auto e = event(startEvents[i], CU_EVENT_DEFAULT))
        return e;
      if (auto e = event(endEvents[i], CU_EVENT_DEFAULT))
        return e;
    }
  }
  slotEvents.resize(slots);
  slotUsed.assign(slots, false);
  for (CUevent &ev : slotEvents)
    if (auto e = event(ev, CU_EVENT_DISABLE_TIMING))
      return e;

  std::vector<std::map<std::string, CUfunction>> dsaFns;
  std::map<std::string, CUfunction> dense;
  if (auto e = compileKernels(dsaFns, dense))
    return e;
  if (auto e = gemms.init(*lt, gemmWorkspace, options.gemmWorkspaceBytes))
    return e;
  if (auto e = buildCommands(dsaFns, dense))
    return e;

  CUcontext context = ctx;
  const CudaDriverApi *api = cu;
  worker.start([api, context] { api->cuCtxSetCurrent(context); });
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
        switch (r.kind) {
        case BufferRef::Operand:
          return deviceAddress(inst.operands[r.index]);
        case BufferRef::Result:
          return deviceAddress(inst.results[r.index]);
        case BufferRef::Scratch:
          return scratch + r.index;
        }
        return 0;
      };
      for (const LoweredStep &s : pi.lowered->steps) {
        if (auto *l = std::get_if<KernelLaunch>(&s)) {
          LaunchCmd c;
          c.name = l->kernel.name();
          c.function = dense.at(c.name);
          c.grid = l->grid;
          c.block = kElementwiseBlockThreads;
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
      if (llvm::StringRef(kind) == "backward_finalize")
        c.grid = {static_cast<uint32_t>(k.grid[0] * batch), 1, 1};
      c.block = static_cast<uint32_t>(k.threads);
      c.sharedBytes = static_cast<uint32_t>(k.dynamicSharedBytes);
      c.args = std::move(args);
      out.push_back(std::move(c));
    };
    auto op = [&](size_t k) { return deviceAddress(inst.operands[k]); };
    auto res = [&](size_t k) { return deviceAddress(inst.results[k]); };
    if (inst.op == "dsa3d_offsets") {
      launch("offsets", {op(0), op(1), res(0)});
    } else if (inst.op == "dsa3d") {
      launch("forward",
             {op(0), op(1), op(2), op(3), res(0), res(1), slotOf(scale, true)});
    } else {
      // (q, k, v, offsets, o, lse, dout) -> (dq, dk, dv)
      int64_t count = q.numElements();
      CUdeviceptr dk32 =
          pi.dk32Offset >= 0 ? arena + pi.dk32Offset : dsaScratch;
      CUdeviceptr dv32 = pi.dv32Offset >= 0
                             ? arena + pi.dv32Offset
                             : dsaScratch + alignUp(count * 4, 256);
      out.push_back(MemsetCmd{dk32, static_cast<size_t>(count * 4)});
      out.push_back(MemsetCmd{dv32, static_cast<size_t>(count * 4)});
      launch("backward", {op(0), op(1), op(2), op(3), op(4), op(6), op(5),
                          res(0), dk32, dv32, slotOf(scale, true)});
      launch("backward_finalize",
             {dk32, dv32, res(1), res(2), static_cast<uint64_t>(count)});
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
  if (auto *g = std::get_if<GemmCmd>(&cmd))
    return gemms.run(g->index, stream);
  if (auto *m = std::get_if<MemsetCmd>(&cmd))
    return check(cu->cuMemsetD8Async(m->dst, 0, m->bytes, stream),
                 "cuMemsetD8Async");
  const CopyCmd &c = std::get<CopyCmd>(cmd);
  if (c.src == c.dst || c.bytes == 0)
    return llvm::Error::success();
  return check(cu->cuMemcpyDtoDAsync_v2(c.dst, c.src, c.bytes, stream),
               "cuMemcpyDtoDAsync");
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

const CudaDeviceInfo &CudaBackend::deviceInfo() const { return impl->info; }
const PreparedPlan &CudaBackend::prepared() const { return impl->prep; }

llvm::Expected<std::unique_ptr<CudaBackend>>
CudaBackend::create(const exec::ExecPlan &plan, const CudaOptions &options) {
  auto impl = std::make_unique<Impl>(plan, options);
  llvm::Expected<PreparedPlan> prep = prepareCudaPlan(plan, options);
  if (!prep)
    return prep.takeError();
  impl->prep = std::move(*prep);
  if (llvm::Error e = impl->init())
    return std::move(e);
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
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

llvm::Expected<exec::StepResult>
CudaBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                  const exec::StepOptions &options) {
  Impl &I = *impl;
  const exec::ExecPlan &plan = I.plan;
  const CudaDriverApi &cu = *I.cu;
  using Clock = std::chrono::steady_clock;
  Clock::time_point begin = Clock::now();
  if (auto e = I.check(cu.cuCtxSetCurrent(I.ctx), "cuCtxSetCurrent"))
    return std::move(e);

  // Inputs into their pinned pool, in the planned dtype.
  int64_t optimizerStep = state.step + 1;
  for (int64_t id : plan.inputs) {
    const exec::Value &v = plan.values[id];
    int64_t n = v.type.numElements();
    uint8_t *dst = I.hostAddress(id);
    if (v.name == "step") {
      std::vector<float> one(n, static_cast<float>(optimizerStep));
      narrow(one.data(), v.type.dtype, n, dst);
      if (v.type.dtype == DType::I64 && n == 1)
        std::memcpy(dst, &optimizerStep, 8);
      continue;
    }
    auto it = inputs.find(v.name);
    if (it == inputs.end())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "step input '" + v.name +
                                         "' was not provided");
    if (static_cast<int64_t>(it->second.size()) != n)
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "step input '" + v.name + "' has " + llvm::Twine(it->second.size()) +
              " elements; the plan expects " + llvm::Twine(n));
    narrow(it->second.data(), v.type.dtype, n, dst);
  }

  CUstream compute = I.streams[0];
  if (auto e = I.syncStream(0, "step start", I.baseEvent))
    return std::move(e);
  Clock::time_point t0 = Clock::now();
  auto since0 = [t0](Clock::time_point t) {
    return std::chrono::duration<double>(t - t0).count();
  };
  {
    std::lock_guard<std::mutex> lock(I.errorMu);
    I.workerError.clear();
  }
  I.worker.reset();

  size_t n = plan.instructions.size();
  std::vector<std::pair<double, double>> hostTimes(n, {-1.0, 0.0});
  llvm::StringMap<int64_t> pendingUpdate; // param -> its host_adamw
  size_t fetchCount = 0;
  bool trace = options.trace;
  // Written by the worker, read after drain(); only the first update sets it.
  std::atomic<bool> skipped = false;

  // host_adamw `i` on the worker, once its gradient is on the host.
  auto hostUpdate = [&](size_t i) {
    // An error (of the worker or of the issue loop) cancels the updates
    // still queued: the step fails as a whole.
    if (I.workerFailed() || skipped)
      return;
    const exec::Instruction &inst = plan.instructions[i];
    if (options.applyUpdates && I.prep.lossDef >= 0 &&
        static_cast<int64_t>(i) == I.prep.firstUpdate) {
      // Nothing is updated yet: a non-finite loss skips the step.
      if (CUresult r = I.cu->cuEventSynchronize(I.lossEvent)) {
        I.setWorkerError(
            "instruction #" + std::to_string(i) +
            ": cuEventSynchronize (loss): " + cuResultString(*I.cu, r));
        return;
      }
      const exec::Value &lossValue = I.plan.values[I.prep.lossValue];
      float loss = 0;
      widen(lossValue.home == Home::Device
                ? static_cast<const uint8_t *>(I.lossStage)
                : I.hostAddress(I.prep.lossValue),
            lossValue.type.dtype, 1, &loss);
      if (!std::isfinite(loss)) {
        skipped = true;
        return;
      }
    }
    Clock::time_point start = Clock::now();
    host::HostTensor *master = state.find(inst.param);
    host::HostTensor *m = state.expAvg(inst.param);
    host::HostTensor *v = state.expAvgSq(inst.param);
    if (!master || !m || !v) {
      I.setWorkerError("host state lacks '" + inst.param +
                       "' or its AdamW moments");
      return;
    }
    const exec::Value &g = I.plan.values[inst.operands[0]];
    int64_t count = g.type.numElements();
    const uint8_t *grad = I.hostAddress(inst.operands[0]);
    std::vector<float> wide;
    if (options.onGradient || g.type.dtype == DType::F16) {
      wide.resize(count);
      widen(grad, g.type.dtype, count, wide.data());
    }
    if (options.onGradient)
      options.onGradient(inst.param, wide);
    if (options.applyUpdates) {
      std::optional<int64_t> bad =
          g.type.dtype == DType::BF16
              ? cpu::firstNonFiniteBf16(
                    reinterpret_cast<const uint16_t *>(grad), count)
          : g.type.dtype == DType::F32
              ? cpu::firstNonFinite(reinterpret_cast<const float *>(grad),
                                    count)
              : cpu::firstNonFinite(wide.data(), count);
      if (bad) {
        float value = 0;
        widen(grad + *bad * exec::dtypeBytes(g.type.dtype), g.type.dtype, 1,
              &value);
        I.setWorkerError(cpu::nonFiniteGradientMessage(
            inst.param, optimizerStep, *bad, value));
        return;
      }
      state.incomplete = true;
      cpu::AdamWHyper hyper = cpu::adamwHyperOf(inst, optimizerStep);
      if (g.type.dtype == DType::BF16)
        cpu::adamwStep(hyper, count, master->data.data(), m->data.data(),
                       v->data.data(), reinterpret_cast<const uint16_t *>(grad),
                       nullptr);
      else if (g.type.dtype == DType::F32)
        cpu::adamwStep(hyper, count, master->data.data(), m->data.data(),
                       v->data.data(), reinterpret_cast<const float *>(grad),
                       nullptr);
      else
        cpu::adamwStep(hyper, count, master->data.data(), m->data.data(),
                       v->data.data(), wide.data(), nullptr);
    }
    hostTimes[i] = {since0(start), since0(Clock::now()) - since0(start)};
  };

  auto issueAll = [&]() -> llvm::Error {
    for (size_t i = 0; i < n; ++i) {
      const exec::Instruction &inst = plan.instructions[i];
      const PreparedInstruction &pi = I.prep.instructions[i];
      if (I.workerFailed())
        return llvm::Error::success(); // reported after the drain

      if (!isGpuStream(inst.stream)) {
        // The host stream: everything on the worker, in order, each task
        // after the GPU work it waits for (derived waits, a plan wait).
        std::vector<CUevent> events;
        for (const Dependency &d : pi.waits)
          if (isGpuStream(d.stream))
            events.push_back(I.doneEvents[d.instruction]);
        if (inst.op == "wait" && inst.event) {
          int64_t recorder = I.prep.eventRecorder[*inst.event];
          if (recorder >= 0 && isGpuStream(plan.instructions[recorder].stream))
            events.push_back(I.planEvents[*inst.event]);
        }
        bool update = inst.op == "host_adamw";
        if (update)
          pendingUpdate[inst.param] = i;
        I.worker.enqueue(i, [&I, &hostUpdate, events, i, update] {
          if (I.workerFailed())
            return;
          for (CUevent ev : events)
            if (CUresult r = I.cu->cuEventSynchronize(ev)) {
              I.setWorkerError(
                  "instruction #" + std::to_string(i) + " ('" +
                  I.plan.instructions[i].op +
                  "'): cuEventSynchronize: " + cuResultString(*I.cu, r));
              return;
            }
          if (update)
            hostUpdate(i);
        });
        continue;
      }

      // A GPU stream: cross-stream waits first.
      CUstream stream = I.streamOf(inst.stream);
      for (const Dependency &d : pi.waits) {
        if (isGpuStream(d.stream)) {
          if (auto e = I.check(
                  cu.cuStreamWaitEvent(stream, I.doneEvents[d.instruction], 0),
                  "cuStreamWaitEvent"))
            return e;
        } else {
          I.worker.waitFor(d.instruction);
        }
      }
      if (inst.op == "record") {
        if (auto e =
                I.check(cu.cuEventRecord(I.planEvents[*inst.event], stream),
                        "cuEventRecord"))
          return e;
        continue;
      }
      if (inst.op == "wait") {
        int64_t recorder = I.prep.eventRecorder[*inst.event];
        if (recorder >= 0 && !isGpuStream(plan.instructions[recorder].stream)) {
          I.worker.waitFor(recorder);
          continue;
        }
        if (auto e = I.check(
                cu.cuStreamWaitEvent(stream, I.planEvents[*inst.event], 0),
                "cuStreamWaitEvent"))
          return e;
        continue;
      }

      if (inst.op == "fetch") {
        // The master may be updated this step already: its AdamW first.
        auto pending = pendingUpdate.find(inst.param);
        if (pending != pendingUpdate.end())
          I.worker.waitFor(pending->second);
        const host::HostTensor *source = state.find(inst.param);
        if (!source)
          return instError(i, inst,
                           "host state has no parameter '" + inst.param + "'");
        const exec::Value &v = plan.values[inst.results[0]];
        if (static_cast<int64_t>(source->data.size()) != v.type.numElements())
          return instError(
              i, inst, "host tensor '" + inst.param + "' has the wrong size");
        size_t slot = fetchCount++ % I.slotEvents.size();
        if (I.slotUsed[slot])
          if (auto e = I.check(cu.cuEventSynchronize(I.slotEvents[slot]),
                               "cuEventSynchronize (staging)"))
            return e;
        uint8_t *stage =
            static_cast<uint8_t *>(I.staging) +
            slot * alignUp(std::max<int64_t>(I.prep.stagingSlotBytes, 1), 4096);
        narrow(source->data.data(), v.type.dtype, v.type.numElements(), stage);
        if (trace)
          cu.cuEventRecord(I.startEvents[i], stream);
        if (auto e = I.check(
                cu.cuMemcpyHtoDAsync_v2(I.deviceAddress(inst.results[0]), stage,
                                        v.type.bytes(), stream),
                "cuMemcpyHtoDAsync (fetch " + inst.param + ")"))
          return e;
        if (auto e = I.check(cu.cuEventRecord(I.slotEvents[slot], stream),
                             "cuEventRecord"))
          return e;
        I.slotUsed[slot] = true;
      } else {
        if (trace)
          cu.cuEventRecord(I.startEvents[i], stream);
        if (inst.op == "h2d") {
          if (auto e = I.check(cu.cuMemcpyHtoDAsync_v2(
                                   I.deviceAddress(inst.results[0]),
                                   I.hostAddress(inst.operands[0]),
                                   plan.values[inst.results[0]].type.bytes(),
                                   stream),
                               "cuMemcpyHtoDAsync"))
            return instError(i, inst, llvm::toString(std::move(e)));
        } else if (inst.op == "d2h") {
          if (auto e = I.check(cu.cuMemcpyDtoHAsync_v2(
                                   I.hostAddress(inst.results[0]),
                                   I.deviceAddress(inst.operands[0]),
                                   plan.values[inst.results[0]].type.bytes(),
                                   stream),
                               "cuMemcpyDtoHAsync"))
            return instError(i, inst, llvm::toString(std::move(e)));
        } else {
          for (const DeviceCmd &cmd : I.commands[i])
            if (auto e = I.issue(cmd, stream))
              return instError(i, inst, llvm::toString(std::move(e)));
        }
      }
      if (trace)
        cu.cuEventRecord(I.endEvents[i], stream);
      if (I.prep.needsDoneEvent[i])
        if (auto e = I.check(cu.cuEventRecord(I.doneEvents[i], stream),
                             "cuEventRecord"))
          return e;
      if (static_cast<int64_t>(i) == I.prep.lossDef) {
        int64_t lossId = I.prep.lossValue;
        const exec::Value &loss = plan.values[lossId];
        if (auto e = I.check(loss.home == Home::Device
                                 ? cu.cuMemcpyDtoHAsync_v2(
                                       I.lossStage, I.deviceAddress(lossId),
                                       loss.type.bytes(), stream)
                                 : CUDA_SUCCESS,
                             "cuMemcpyDtoHAsync (loss)"))
          return e;
        if (auto e = I.check(cu.cuEventRecord(I.lossEvent, stream),
                             "cuEventRecord (loss)"))
          return e;
      }
    }
    return llvm::Error::success();
  };

  llvm::Error issued = issueAll();
  if (issued)
    I.setWorkerError("cancelled"); // no queued update may apply (hostUpdate)
  // Whatever happened, nothing may stay in flight past this call.
  I.worker.drain();
  llvm::Error synced = llvm::Error::success();
  for (int s = 0; s < 3; ++s) {
    llvm::Error e = I.syncStream(s, "the step failed on the GPU");
    if (!synced)
      synced = std::move(e);
    else
      llvm::consumeError(std::move(e));
  }
  if (issued) {
    llvm::consumeError(std::move(synced));
    return std::move(issued);
  }
  if (synced)
    return std::move(synced);
  {
    std::lock_guard<std::mutex> lock(I.errorMu);
    if (!I.workerError.empty())
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "host stream: " + I.workerError);
  }

  exec::StepResult result;
  if (plan.outputs.empty())
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "the plan returns no loss");
  int64_t lossId = plan.outputs[0];
  const exec::Value &lossValue = plan.values[lossId];
  if (lossValue.home == Home::Device) {
    std::vector<uint8_t> bytes(lossValue.type.bytes());
    if (auto e = I.check(cu.cuMemcpyDtoHAsync_v2(bytes.data(),
                                                 I.deviceAddress(lossId),
                                                 bytes.size(), compute),
                         "cuMemcpyDtoHAsync (loss)"))
      return std::move(e);
    if (auto e = I.syncStream(0, "loss"))
      return std::move(e);
    widen(bytes.data(), lossValue.type.dtype, 1, &result.loss);
  } else {
    widen(I.hostAddress(lossId), lossValue.type.dtype, 1, &result.loss);
  }
  if (skipped || (options.applyUpdates && I.prep.firstUpdate < 0 &&
                  !std::isfinite(result.loss))) {
    result.skipped = true;
  } else if (options.applyUpdates && !std::isfinite(result.loss)) {
    state.incomplete = true; // updated before the loss was known
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        llvm::formatv("step {0}: the loss is {1}, and this plan updates "
                      "parameters before it computes the loss, so the step "
                      "could not be skipped: the host state is incomplete",
                      optimizerStep, result.loss)
            .str());
  } else if (options.applyUpdates) {
    state.step = optimizerStep;
    state.incomplete = false;
  }

  if (trace) {
    for (size_t i = 0; i < n; ++i) {
      const exec::Instruction &inst = plan.instructions[i];
      if (inst.op == "record" || inst.op == "wait")
        continue;
      exec::TraceSpan span;
      span.stream = inst.stream;
      span.name = inst.param.empty() ? inst.op : inst.op + " " + inst.param;
      span.instruction = i;
      span.layer = inst.layer;
      span.flops = inst.cost.matmulFlops + inst.cost.attentionFlops +
                   inst.cost.otherFlops;
      span.bytes = inst.cost.bytes;
      if (isGpuStream(inst.stream)) {
        float startMs = 0, durMs = 0;
        if (cu.cuEventElapsedTime(&startMs, I.baseEvent, I.startEvents[i]) !=
                CUDA_SUCCESS ||
            cu.cuEventElapsedTime(&durMs, I.startEvents[i], I.endEvents[i]) !=
                CUDA_SUCCESS)
          continue;
        span.start = startMs * 1e-3;
        span.seconds = durMs * 1e-3;
      } else {
        if (hostTimes[i].first < 0)
          continue;
        span.start = hostTimes[i].first;
        span.seconds = hostTimes[i].second;
      }
      result.spans.push_back(std::move(span));
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  result.memory.plannedArenaBytes = plan.arenaBytes;
  result.memory.plannedLiveBytes = plan.plannedLiveBytes;
  result.memory.measuredArenaBytes = I.prep.arenaHighWater;
  result.memory.measuredLiveBytes = I.prep.peakLiveBytes;
  return result;
}

} // namespace megaslide::cuda
