//===- HostPool.cpp - Pinned host values and cross-stream waits -----------===//

#include "megaslide/runtime/plan/HostPool.h"

#include "megaslide/runtime/dist/Collectives.h"
#include "megaslide/runtime/support/Packing.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>
#include <array>
#include <map>
#include <optional>

namespace megaslide::exec {

namespace {

constexpr int kStreams = kNumStreams;

/// Pinned bytes of a value of `bytes` (hostValueBytes): at least one, so
/// every value has an address of its own.
int64_t poolBytes(int64_t bytes) {
  return alignTo(std::max<int64_t>(bytes, 1), kHostPoolAlign);
}

/// For every byte, the last instruction of each stream that touched it.
class HazardMap {
public:
  explicit HazardMap(int64_t size) {
    std::array<int64_t, kStreams> none;
    none.fill(-1);
    segments[0] = none;
    segments[std::max<int64_t>(size, 1)] = none; // sentinel
  }

  /// Records that `inst` on `stream` touches [lo, hi); a write also raises
  /// `deps` to the last toucher of those bytes on every other stream.
  void touch(int64_t lo, int64_t hi, Stream stream, int64_t inst, bool write,
             std::array<int64_t, kStreams> &deps) {
    if (lo >= hi)
      return;
    split(lo);
    split(hi);
    int s = static_cast<int>(stream);
    for (auto it = segments.find(lo); it != segments.end() && it->first < hi;
         ++it) {
      if (write)
        for (int o = 0; o < kStreams; ++o)
          if (o != s)
            deps[o] = std::max(deps[o], it->second[o]);
      it->second[s] = inst;
    }
  }

private:
  void split(int64_t at) {
    auto it = segments.upper_bound(at);
    if (it == segments.begin())
      return;
    --it;
    if (it->first != at)
      segments.emplace(at, it->second);
  }
  std::map<int64_t, std::array<int64_t, kStreams>> segments;
};

} // namespace

int64_t deviceOffset(const ExecPlan &plan, int64_t id) {
  for (int guard = 0; guard < 64; ++guard) {
    const Value &v = plan.values[id];
    if (v.offset >= 0 || !v.viewOf)
      return v.offset;
    id = *v.viewOf;
  }
  return -1;
}

int64_t copiedBytes(const ExecPlan &plan, const Instruction &inst) {
  const TensorType &t = plan.values[inst.results[0]].type;
  std::optional<int64_t> ranks = inst.intAttr("ranks");
  if (!ranks)
    return t.bytes();
  return dist::shardRange(t.numElements(), 0, static_cast<int>(*ranks)).size() *
         dtypeBytes(t.dtype);
}

std::vector<int64_t> hostValueBytes(const ExecPlan &plan) {
  std::vector<int64_t> bytes(plan.values.size(), 0);
  for (auto [id, v] : llvm::enumerate(plan.values))
    if (v.home == Home::Host)
      bytes[id] = v.type.bytes();
  for (const Instruction &inst : plan.instructions)
    if (inst.op == OpCode::DeviceToHost && inst.results.size() == 1)
      bytes[inst.results[0]] = copiedBytes(plan, inst);
  return bytes;
}

HostPoolLayout layoutHostPool(const ExecPlan &plan, const Liveness &live,
                              int64_t noReuseBytes) {
  HostPoolLayout layout;
  std::vector<int64_t> valueBytes = hostValueBytes(plan);
  auto poolBytesOf = [&](int64_t id) { return poolBytes(valueBytes[id]); };
  layout.offset.assign(plan.values.size(), -1);
  std::vector<int64_t> hostValues;
  int64_t total = 0;
  for (size_t id = 0; id < plan.values.size(); ++id)
    if (plan.values[id].home == Home::Host) {
      hostValues.push_back(id);
      total += poolBytesOf(id);
    }
  if (total <= noReuseBytes) {
    for (int64_t id : hostValues) {
      layout.offset[id] = layout.bytes;
      layout.bytes += poolBytesOf(id);
    }
    return layout;
  }
  layout.shared = true;

  // Gradients in program order, grouped by runs of one layer.
  std::vector<bool> updated(plan.values.size());
  for (const Instruction &inst : plan.instructions)
    if (inst.op == OpCode::HostAdamW)
      for (int64_t id : inst.operands)
        updated[id] = true;
  std::vector<std::vector<int64_t>> groups;
  std::optional<int64_t> groupLayer;
  for (const Instruction &inst : plan.instructions) {
    if (inst.op != OpCode::DeviceToHost)
      continue;
    for (int64_t id : inst.results) {
      if (plan.values[id].home != Home::Host || !updated[id] ||
          layout.offset[id] >= 0)
        continue;
      if (groups.empty() || inst.layer != groupLayer)
        groups.emplace_back();
      groupLayer = inst.layer;
      groups.back().push_back(id);
      layout.offset[id] = 0; // placed below
    }
  }
  int64_t slots = std::max<int64_t>(plan.gradientBuffers, 1);
  for (const std::vector<int64_t> &group : groups) {
    int64_t bytes = 0;
    for (int64_t id : group)
      bytes += poolBytesOf(id);
    layout.ringSlotBytes = std::max(layout.ringSlotBytes, bytes);
  }
  if (!groups.empty())
    layout.ringSlots = std::min<int64_t>(slots, groups.size());
  for (auto [g, group] : llvm::enumerate(groups)) {
    int64_t at = static_cast<int64_t>(g) % slots * layout.ringSlotBytes;
    for (int64_t id : group) {
      layout.offset[id] = at;
      at += poolBytesOf(id);
    }
  }
  int64_t ring = layout.ringSlots * layout.ringSlotBytes;

  // The others by program-order lifetimes; outputs live to the end.
  std::vector<bool> isOutput(plan.values.size());
  for (int64_t id : plan.outputs)
    isOutput[id] = true;
  std::vector<int64_t> others;
  std::vector<Slice> slices;
  for (int64_t id : hostValues) {
    if (layout.offset[id] >= 0)
      continue;
    others.push_back(id);
    slices.push_back({poolBytesOf(id), live.def[id],
                      isOutput[id]
                          ? static_cast<int64_t>(plan.instructions.size())
                          : live.end(id)});
  }
  Packing packing = packSlices(slices, kHostPoolAlign);
  for (auto [k, id] : llvm::enumerate(others))
    layout.offset[id] = ring + packing.offsets[k];
  layout.bytes = ring + packing.arenaSize;
  return layout;
}

std::vector<std::vector<Dependency>>
crossStreamWaits(const ExecPlan &plan, const std::vector<int64_t> &hostOffset,
                 int64_t hostBytes) {
  size_t n = plan.instructions.size();
  std::vector<std::vector<Dependency>> waits(n);
  std::vector<int64_t> eventRecorder(std::max<int64_t>(plan.numEvents, 0), -1);
  HazardMap arena(plan.arenaBytes), pool(hostBytes);
  std::vector<int64_t> valueBytes = hostValueBytes(plan);
  int64_t lastWaited[kStreams][kStreams];
  for (auto &row : lastWaited)
    std::fill(std::begin(row), std::end(row), -1);
  for (size_t i = 0; i < n; ++i) {
    const Instruction &inst = plan.instructions[i];
    int S = static_cast<int>(inst.stream);
    std::array<int64_t, kStreams> deps;
    deps.fill(-1);
    auto touchValue = [&](int64_t id, bool write) {
      const Value &v = plan.values[id];
      if (v.home == Home::Device) {
        int64_t off = deviceOffset(plan, id);
        if (off >= 0)
          arena.touch(off, off + v.type.bytes(), inst.stream, i, write, deps);
      } else if (v.home == Home::Host && hostOffset[id] >= 0) {
        int64_t off = hostOffset[id];
        pool.touch(off, off + valueBytes[id], inst.stream, i, write, deps);
      }
    };
    for (int64_t id : inst.operands)
      touchValue(id, false);
    for (int64_t id : inst.results)
      touchValue(id, true);
    for (const Range &w : inst.workspace)
      arena.touch(w.offset, w.offset + w.size, inst.stream, i, true, deps);
    if (inst.op == OpCode::Record && inst.event)
      eventRecorder[*inst.event] = i;
    // A plan wait orders this stream after the recorder.
    if (inst.op == OpCode::Wait && inst.event &&
        eventRecorder[*inst.event] >= 0) {
      int64_t recorder = eventRecorder[*inst.event];
      int R = static_cast<int>(plan.instructions[recorder].stream);
      lastWaited[S][R] = std::max(lastWaited[S][R], recorder);
    }
    for (int s = 0; s < kStreams; ++s) {
      if (s == S || deps[s] < 0 || deps[s] <= lastWaited[S][s])
        continue;
      lastWaited[S][s] = deps[s];
      waits[i].push_back({static_cast<Stream>(s), deps[s]});
    }
  }
  return waits;
}

} // namespace megaslide::exec
