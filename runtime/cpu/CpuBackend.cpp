//===- CpuBackend.cpp - The reference backend -----------------------------===//

#include "megaslide/runtime/cpu/CpuBackend.h"

#include "megaslide/runtime/cpu/HostDevice.h"
#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/host/HostState.h"

#include "llvm/ADT/Twine.h"

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
/// host memory, every primitive done before it returns (HostDevice).
class CpuDevice final : public HostDevice {
public:
  CpuDevice(const exec::ExecPlan &plan, std::vector<GraphKernel> kernels)
      : HostDevice(plan, std::move(kernels)), arenaStorage(plan.arenaBytes),
        arena(nullptr) {
    hostStorage.resize(plan.values.size());
    for (size_t id = 0; id < plan.values.size(); ++id)
      if (plan.values[id].home != Home::Device)
        hostStorage[id].resize(plan.values[id].type.bytes());
  }

  const char *name() const override { return "cpu"; }
  uint8_t *hostData(int64_t id) override { return hostStorage[id].data(); }

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

  void measureMemory(exec::MemoryStats &stats) override {
    stats.measuredArenaBytes = arena.highWater;
    stats.measuredLiveBytes = arena.peakLiveBytes;
  }

private:
  void resetMemory() override { arena = TrackingArena(arenaStorage.data()); }
  uint8_t *bytesOf(int64_t id) override {
    const exec::Value &v = plan.values[id];
    if (v.home == Home::Device)
      return arena.at(v.offset);
    return hostStorage[id].data();
  }

  /// The device arena and the host values' bytes, kept from step to step:
  /// a fresh arena each step cost a page fault per 4 KiB, 6% of a
  /// 1,024-token step (docs/Benchmarks.md, "CPU training step"). Every
  /// value is written before it is read, as on a device, so what the arena
  /// held in an earlier step is never seen.
  std::vector<uint8_t> arenaStorage;
  std::vector<std::vector<uint8_t>> hostStorage;
  TrackingArena arena; ///< this step's allocations
};

} // namespace

CpuBackend::~CpuBackend() = default;

llvm::Expected<std::unique_ptr<CpuBackend>>
CpuBackend::create(const exec::ExecPlan &plan) {
  // The kernels read MEGASLIDE_CPU_ISA and MEGASLIDE_NUM_THREADS; a bad
  // value is reported here instead of aborting or being ignored there.
  if (const char *error = cpuSettingsError())
    return llvm::createStringError(error);
  if (llvm::Error err = exec::checkOneRank(plan, "cpu"))
    return std::move(err);
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
  llvm::Expected<std::vector<GraphKernel>> kernels = bindGraphKernels(plan);
  if (!kernels)
    return kernels.takeError();
  auto device = std::make_unique<CpuDevice>(plan, std::move(*kernels));
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
