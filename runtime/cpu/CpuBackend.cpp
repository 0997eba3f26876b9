//===- CpuBackend.cpp - The reference backend -----------------------------===//

#include "megaslide/runtime/cpu/CpuBackend.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/plan/Liveness.h"

#include "llvm/ADT/Twine.h"

#include <cstring>
#include <map>

using namespace megaslide;
using namespace megaslide::cpu;
using exec::DType;
using exec::Home;

namespace {

/// The tracking allocator standing in for device memory: every allocation
/// is placed where the plan says, checked against the live ones, and
/// measured.
class TrackingArena {
public:
  explicit TrackingArena(uint8_t *storage) : storage(storage) {}

  llvm::Error allocate(int64_t offset, int64_t size, int64_t owner) {
    if (size == 0)
      return llvm::Error::success();
    auto next = live.lower_bound(offset);
    if (next != live.end() && next->first < offset + size)
      return overlap(owner, next->second.owner);
    if (next != live.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > offset)
        return overlap(owner, prev->second.owner);
    }
    live[offset] = {size, owner};
    liveBytes += size;
    peakLiveBytes = std::max(peakLiveBytes, liveBytes);
    highWater = std::max(highWater, offset + size);
    return llvm::Error::success();
  }
  void release(int64_t offset) {
    auto it = live.find(offset);
    if (it == live.end())
      return;
    liveBytes -= it->second.size;
    live.erase(it);
  }
  uint8_t *at(int64_t offset) { return storage + offset; }

  int64_t highWater = 0, peakLiveBytes = 0;

private:
  llvm::Error overlap(int64_t a, int64_t b) {
    return llvm::createStringError("device memory plan is corrupt: %" +
                                   llvm::Twine(a) + " is placed over live %" +
                                   llvm::Twine(b));
  }
  struct Allocation {
    int64_t size, owner;
  };
  uint8_t *storage;
  std::map<int64_t, Allocation> live; ///< by offset
  int64_t liveBytes = 0;
};

/// The cpu backend's primitives: the device arena and the host values in
/// host memory, every primitive done before it returns.
class CpuDevice final : public exec::Device {
public:
  explicit CpuDevice(const exec::ExecPlan &plan)
      : plan(plan), arenaStorage(plan.arenaBytes), arena(nullptr) {
    hostStorage.resize(plan.values.size());
    for (size_t id = 0; id < plan.values.size(); ++id)
      if (plan.values[id].home != Home::Device)
        hostStorage[id].resize(plan.values[id].type.bytes());
  }

  /// Per instruction; null for schedule ops and views.
  std::vector<GraphKernel> kernels;

  const char *name() const override { return "cpu"; }
  bool synchronous() const override { return true; }
  uint8_t *hostData(int64_t id) override { return hostStorage[id].data(); }

  llvm::Error beginStep(exec::StepSetup setup) override {
    fetches = std::move(setup.fetches);
    arena = TrackingArena(arenaStorage.data());
    return llvm::Error::success();
  }

  llvm::Error allocate(size_t i) override {
    // Results and workspace where the plan put them.
    const exec::Instruction &inst = plan.instructions[i];
    for (int64_t r : inst.results) {
      const exec::Value &v = plan.values[r];
      if (v.home == Home::Device && !v.viewOf)
        if (llvm::Error err = arena.allocate(v.offset, v.type.bytes(), r))
          return err;
    }
    for (const exec::Range &w : inst.workspace)
      if (llvm::Error err = arena.allocate(w.offset, w.size, -1))
        return err;
    return llvm::Error::success();
  }

  void release(size_t i, llvm::ArrayRef<int64_t> dead) override {
    for (const exec::Range &w : plan.instructions[i].workspace)
      arena.release(w.offset);
    for (int64_t id : dead)
      if (plan.values[id].home == Home::Device)
        arena.release(plan.values[id].offset);
  }

  llvm::Error fetch(size_t i, size_t k) override {
    const exec::FetchSource &source = fetches[k];
    if (source.before)
      source.before();
    int64_t id = plan.instructions[i].results[0];
    const exec::Value &v = plan.values[id];
    narrow(source.master, v.type.dtype, v.type.numElements(), data(id));
    return llvm::Error::success();
  }

  llvm::Error copy(size_t i) override {
    const exec::Instruction &inst = plan.instructions[i];
    std::memcpy(data(inst.results[0]), data(inst.operands[0]),
                plan.values[inst.results[0]].type.bytes());
    return llvm::Error::success();
  }

  llvm::Error launch(size_t i) override {
    GraphKernel kernel = kernels[i];
    if (!kernel)
      return llvm::Error::success(); // a reshape's result views its operand
    if (llvm::Error err = runGraphKernel(
            kernel, plan, plan.instructions[i],
            [this](int64_t id) { return data(id); }, wide))
      return llvm::createStringError("instruction #" + llvm::Twine(i) + ": " +
                                     llvm::toString(std::move(err)));
    return llvm::Error::success();
  }

  llvm::Error record(size_t) override { return llvm::Error::success(); }
  llvm::Error wait(size_t) override { return llvm::Error::success(); }
  llvm::Error runOnHost(size_t, std::function<void()> work) override {
    work();
    return llvm::Error::success();
  }

  llvm::Error captureValue(int64_t id, exec::Stream) override {
    const uint8_t *bytes = data(id);
    captured.assign(bytes, bytes + plan.values[id].type.bytes());
    return llvm::Error::success();
  }
  llvm::Error awaitValue(int64_t, void *dst) override {
    std::memcpy(dst, captured.data(), captured.size());
    return llvm::Error::success();
  }

  llvm::Error endStep() override { return llvm::Error::success(); }
  llvm::Error readValue(int64_t id, void *dst) override {
    std::memcpy(dst, data(id), plan.values[id].type.bytes());
    return llvm::Error::success();
  }
  void measureMemory(exec::MemoryStats &stats) override {
    stats.measuredArenaBytes = arena.highWater;
    stats.measuredLiveBytes = arena.peakLiveBytes;
  }

private:
  uint8_t *data(int64_t id) {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Device)
      return arena.at(v.offset);
    return hostStorage[id].data();
  }

  const exec::ExecPlan &plan;
  /// The device arena and the host values' bytes, kept from step to step:
  /// a fresh arena each step cost a page fault per 4 KiB, 6% of a
  /// 1,024-token step (docs/Benchmarks.md, "CPU training step"). Every
  /// value is written before it is read, as on a device, so what the arena
  /// held in an earlier step is never seen.
  std::vector<uint8_t> arenaStorage;
  std::vector<std::vector<uint8_t>> hostStorage;
  TrackingArena arena; ///< this step's allocations
  std::vector<exec::FetchSource> fetches;
  std::vector<uint8_t> captured;
  std::vector<std::vector<float>> wide; ///< graph ops' fp32 operands
};

} // namespace

CpuBackend::~CpuBackend() = default;

llvm::Expected<std::unique_ptr<CpuBackend>>
CpuBackend::create(const exec::ExecPlan &plan) {
  // The kernels read MEGASLIDE_CPU_ISA and MEGASLIDE_NUM_THREADS; a bad
  // value is reported here instead of aborting or being ignored there.
  if (const char *error = cpuSettingsError())
    return llvm::createStringError(error);
  // The arena is host memory here: refuse what cannot be allocated rather
  // than abort inside the allocator.
  llvm::Expected<uint64_t> memory = host::usableHostMemoryBytes();
  if (!memory)
    return memory.takeError();
  if (static_cast<uint64_t>(plan.arenaBytes) > *memory)
    return llvm::createStringError(
        "the plan's device arena of " + llvm::Twine(plan.arenaBytes) +
        " bytes does not fit this machine's memory; the cpu backend holds "
        "it in host memory (use --backend sim for plans this size)");
  std::vector<GraphKernel> kernels;
  for (const exec::Instruction &inst : plan.instructions) {
    GraphKernel kernel = nullptr;
    // A reshape's result is a view: it holds the operand's bytes already.
    if (!exec::isScheduleOp(inst.op) && inst.op != exec::OpCode::Reshape) {
      kernel = findGraphKernel(inst.op);
      if (!kernel)
        return llvm::createStringError(
            llvm::Twine("the cpu backend has no kernel for '") +
            exec::opName(inst.op) + "'");
    }
    kernels.push_back(kernel);
  }
  auto device = std::make_unique<CpuDevice>(plan);
  device->kernels = std::move(kernels);
  std::unique_ptr<CpuBackend> backend(new CpuBackend());
  backend->runner = std::make_unique<exec::StepRunner>(plan, *device);
  backend->device = std::move(device);
  return backend;
}

llvm::Expected<exec::StepResult>
CpuBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                 const exec::StepOptions &options) {
  return runner->run(inputs, state, options);
}
