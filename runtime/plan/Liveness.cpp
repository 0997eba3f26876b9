//===- Liveness.cpp - When the values of a step hold their bytes ----------===//

#include "megaslide/runtime/plan/Liveness.h"

using namespace megaslide;
using namespace megaslide::exec;

int64_t exec::bufferOf(const ExecPlan &plan, int64_t id) {
  // Views are validated to point at earlier ids, so this terminates.
  while (plan.values[id].viewOf)
    id = *plan.values[id].viewOf;
  return id;
}

std::vector<int64_t> exec::liveBytesAt(llvm::ArrayRef<Slice> slices,
                                       int64_t numSteps) {
  std::vector<int64_t> delta(numSteps + 1, 0);
  for (const Slice &s : slices) {
    delta[s.start] += s.size;
    delta[s.end + 1] -= s.size;
  }
  std::vector<int64_t> live(numSteps);
  int64_t running = 0;
  for (int64_t t = 0; t < numSteps; ++t)
    live[t] = running += delta[t];
  return live;
}

Liveness exec::computeLiveness(const ExecPlan &plan) {
  Liveness l;
  size_t n = plan.values.size();
  int64_t steps = plan.instructions.size();
  l.def.assign(n, -1);
  l.lastUse.assign(n, -1);
  for (int64_t id : plan.inputs)
    l.def[id] = 0;
  auto read = [&](int64_t id, int64_t at) {
    int64_t &last = l.lastUse[bufferOf(plan, id)];
    last = std::max(last, at);
  };
  for (int64_t i = 0; i < steps; ++i) {
    const Instruction &inst = plan.instructions[i];
    for (int64_t r : inst.results) {
      l.def[r] = i;
      read(r, i);
    }
    for (int64_t o : inst.operands)
      read(o, i);
  }
  for (int64_t id : plan.outputs)
    l.lastUse[bufferOf(plan, id)] = steps - 1;

  // Live bytes: the device buffers over their intervals, each workspace
  // during its instruction.
  std::vector<Slice> slices;
  for (size_t id = 0; id < n; ++id) {
    const Value &v = plan.values[id];
    if (v.home != Home::Device || v.viewOf || l.def[id] < 0)
      continue;
    l.deviceBuffers.push_back(id);
    slices.push_back({v.type.bytes(), l.def[id], l.end(id)});
  }
  for (int64_t i = 0; i < steps; ++i)
    for (const Range &r : plan.instructions[i].workspace)
      slices.push_back({r.size, i, i});
  l.liveBytes = liveBytesAt(slices, steps);
  for (int64_t bytes : l.liveBytes)
    l.peakLiveBytes = std::max(l.peakLiveBytes, bytes);
  return l;
}
