//===- SimBackend.cpp - Predicted timing of an execution plan -------------===//

#include "megaslide/runtime/sim/SimBackend.h"

#include "megaslide/runtime/plan/HostPool.h"
#include "megaslide/runtime/plan/Liveness.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Twine.h"

#include <algorithm>
#include <cmath>
#include <string>

using namespace megaslide;
using namespace megaslide::sim;

namespace {

llvm::Error errorAt(size_t instruction, const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                 "instruction #" + llvm::Twine(instruction) +
                                     ": " + message);
}

bool isEvent(const exec::Instruction &inst) {
  return inst.op == exec::OpCode::Record || inst.op == exec::OpCode::Wait;
}

/// A device buffer of the step: a value that owns arena bytes, with the
/// instructions that produce or read it or any view of it.
struct Buffer {
  int64_t value = -1;
  int64_t producer = -1;
  std::vector<int64_t> readers;
  bool returned = false;
};

/// The device buffers in value order, and the buffer of each device value.
/// A view of a device value shares its buffer, as reshapes do in the
/// planner's DeviceBuffers; a view of a host value owns its bytes.
struct Buffers {
  std::vector<Buffer> buffers;
  std::vector<int64_t> bufferOf; ///< per value; -1 when not on the device
};

llvm::Expected<Buffers> collectBuffers(const exec::ExecPlan &plan) {
  size_t numValues = plan.values.size();
  Buffers b;
  b.bufferOf.assign(numValues, -1);
  for (size_t id = 0; id < numValues; ++id) {
    const exec::Value &v = plan.values[id];
    if (v.home != exec::Home::Device)
      continue;
    if (v.viewOf) {
      if (*v.viewOf < 0 || static_cast<size_t>(*v.viewOf) >= id)
        return llvm::createStringError(
            llvm::inconvertibleErrorCode(),
            "value %zu is a view of %lld, which is not an earlier value", id,
            static_cast<long long>(*v.viewOf));
      if (int64_t of = b.bufferOf[*v.viewOf]; of >= 0) {
        b.bufferOf[id] = of;
        continue;
      }
    }
    b.bufferOf[id] = b.buffers.size();
    b.buffers.push_back({static_cast<int64_t>(id), -1, {}, false});
  }
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    int64_t index = i;
    for (int64_t r : inst.results)
      if (int64_t of = b.bufferOf[r]; of >= 0 && b.buffers[of].value == r)
        b.buffers[of].producer = index;
    for (int64_t o : inst.operands)
      if (int64_t of = b.bufferOf[o]; of >= 0) {
        std::vector<int64_t> &readers = b.buffers[of].readers;
        if (readers.empty() || readers.back() != index)
          readers.push_back(index);
      }
  }
  for (int64_t id : plan.outputs)
    if (id >= 0 && static_cast<size_t>(id) < numValues && b.bufferOf[id] >= 0)
      b.buffers[b.bufferOf[id]].returned = true;
  return b;
}

/// Checks the ids the replay indexes with.
llvm::Error checkIds(const exec::ExecPlan &plan) {
  size_t numValues = plan.values.size();
  std::vector<bool> recorded(std::max<int64_t>(plan.numEvents, 0), false);
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    for (int64_t id : llvm::concat<const int64_t>(inst.operands, inst.results))
      if (id < 0 || static_cast<size_t>(id) >= numValues)
        return errorAt(i, "value id " + llvm::Twine(id) + " is out of range");
    if (!isEvent(inst))
      continue;
    if (!inst.event || *inst.event < 0 || *inst.event >= plan.numEvents)
      return errorAt(i, llvm::Twine("'") + exec::opName(inst.op) +
                            "' has no event in range");
    if (inst.op == exec::OpCode::Record)
      recorded[*inst.event] = true;
    else if (!recorded[*inst.event])
      return errorAt(i, "waits for event " + llvm::Twine(*inst.event) +
                            ", which is not recorded before");
  }
  return llvm::Error::success();
}

uint64_t flopsOf(const exec::CostInputs &c) {
  return c.matmulFlops + c.attentionFlops + c.otherFlops;
}

/// The replay's tasks and the buffers whose releases they carry.
struct Built {
  StepTasks step;
  Buffers buffers;
};

/// Moves the deferred updates into the replay: before each fetch that
/// applies one, a task on the host stream timed as the host_adamw it
/// defers, which the fetch depends on. Task indices in deps and releases
/// become those of the longer list. In one step's replay the updates
/// stand for those of the step before, whose gradients are all retained
/// when this one starts.
void insertDeferredUpdates(const exec::ExecPlan &plan, const HardwareModel &hw,
                           StepTasks &step) {
  llvm::StringMap<int64_t> updateOf; // parameter -> its host_adamw
  for (auto [i, inst] : llvm::enumerate(plan.instructions))
    if (inst.op == exec::OpCode::HostAdamW && inst.hasAttr(exec::kDeferredAttr))
      updateOf[inst.param] = i;
  if (updateOf.empty())
    return;
  size_t n = plan.instructions.size();
  std::vector<Task> tasks;
  tasks.reserve(n + updateOf.size());
  step.taskOf.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    Task task = std::move(step.tasks[i]);
    // Deps and releases name this or earlier instructions, mapped by now.
    step.taskOf[i] = tasks.size();
    for (int64_t &dep : task.deps)
      dep = step.taskOf[dep];
    for (int64_t &blocker : task.issueAfter)
      blocker = step.taskOf[blocker];
    for (Release &r : task.frees)
      for (int64_t &user : r.users)
        user = step.taskOf[user];
    const exec::Param *p =
        inst.op == exec::OpCode::Fetch && inst.hasAttr(exec::kAppliesUpdateAttr)
            ? plan.updatedParam(inst.param)
            : nullptr;
    if (auto it = p ? updateOf.find(p->name) : updateOf.end();
        it != updateOf.end()) {
      const exec::Instruction &adamw = plan.instructions[it->second];
      Task update;
      update.stream = exec::Stream::Host;
      update.seconds = secondsFor(sim::CostKind::HostAdamW, KernelFamily::None,
                                  adamw.cost, hw);
      update.hostBytes = hostMemoryBytes(sim::CostKind::HostAdamW, adamw.cost);
      if (update.hostBytes > 0 && update.seconds > 0)
        update.hostRate = update.hostBytes / update.seconds;
      else
        update.hostBytes = 0;
      int64_t at = tasks.size();
      step.updates.push_back({at, static_cast<int64_t>(i), it->second});
      tasks.push_back(std::move(update));
      task.deps.push_back(at);
      step.taskOf[i] = tasks.size();
    }
    tasks.push_back(std::move(task));
  }
  step.tasks = std::move(tasks);
}

/// The NVMe tier's transfers (plan.tierRoles) in the replay. Each update
/// of a parameter with tiered state (its host_adamw, or in a plan with
/// deferred updates the task that applies it), in the order the host
/// stream runs them, reads that state before it, and the update depends
/// on the read; a write of it follows the update (write-behind). A read
/// is issued as soon as the window has room (read-ahead): after the write
/// of the last earlier parameter whose state does not fit in the window
/// with its own and those in between. Reads and writes share one I/O lane
/// at drives x the drives' sequential rates (a drive reads or writes, not
/// both at full rate); a plan replayed without a drive count is priced at
/// one. With deferred updates the EMA's tiered bytes move with its
/// parameter's update; the streaming update's EMA pass is the report's.
void insertTierIo(const exec::ExecPlan &plan, const HardwareModel &hw,
                  StepTasks &step) {
  if (plan.tierRoles.empty())
    return;
  bool moments = llvm::is_contained(plan.tierRoles, "moment");
  bool ema = llvm::is_contained(plan.tierRoles, "ema");
  // The streaming update's EMA is one pass after the step
  // (HostOptimizer::endStreamingStep), outside the replay; the deferred
  // one updates each parameter's EMA with its AdamW.
  bool deferred = plan.defersUpdates();
  int64_t ranks = std::max<int64_t>(1, plan.jobRanks());
  int64_t emaBytes = plan.emaDtype == "f32"    ? 4
                     : plan.emaDtype == "bf16" ? 2
                                               : 0;
  llvm::StringMap<uint64_t> bytesOf; // parameter -> one rank's tier bytes
  for (const exec::Param &p : plan.params) {
    if (moments && p.role == "moment")
      bytesOf[p.of] += (p.type.bytes() + ranks - 1) / ranks;
    if (ema && deferred && p.role == "master")
      bytesOf[p.name] += (p.type.numElements() * emaBytes + ranks - 1) / ranks;
  }
  // The updates in task order: (task, bytes).
  size_t n = step.tasks.size();
  auto taskOfInstruction = [&](size_t i) {
    return step.taskOf.empty() ? int64_t(i) : step.taskOf[i];
  };
  std::vector<std::pair<int64_t, uint64_t>> updates;
  for (const StepTasks::Update &u : step.updates)
    updates.push_back(
        {u.task, bytesOf.lookup(plan.instructions[u.hostAdamW].param)});
  for (auto [i, inst] : llvm::enumerate(plan.instructions))
    if (inst.op == exec::OpCode::HostAdamW &&
        !inst.hasAttr(exec::kDeferredAttr))
      updates.push_back({taskOfInstruction(i), bytesOf.lookup(inst.param)});
  llvm::erase_if(updates, [](const auto &u) { return u.second == 0; });
  llvm::sort(updates);
  // The update whose write lets each read start: -1 for none.
  size_t k = updates.size();
  std::vector<int64_t> gate(k, -1);
  uint64_t window =
      static_cast<uint64_t>(std::max<int64_t>(plan.tierWindowBytes, 0));
  uint64_t held = 0;
  for (size_t first = 0, j = 0; j < k; ++j) {
    held += updates[j].second;
    while (held > window && first < j)
      held -= updates[first++].second;
    gate[j] = int64_t(first) - 1;
  }
  std::vector<std::vector<size_t>> readsAfter(k + 1); // [0]: at the start
  for (size_t j = 0; j < k; ++j)
    readsAfter[gate[j] + 1].push_back(j);
  double drives = double(std::max<int64_t>(1, plan.tierDrives));
  auto transfer = [&](uint64_t bytes, double rate, int64_t after) {
    Task t;
    t.stream = exec::Stream::Host;
    t.io = true;
    t.seconds = double(bytes) / (drives * rate);
    if (after >= 0)
      t.deps.push_back(after);
    return t;
  };

  std::vector<Task> tasks;
  tasks.reserve(n + 2 * k);
  std::vector<int64_t> newIndex(n), readIndex(k), writeIndex(k);
  auto emitReads = [&](size_t slot, int64_t after) {
    for (size_t j : readsAfter[slot]) {
      readIndex[j] = tasks.size();
      tasks.push_back(transfer(updates[j].second, hw.nvmeReadBandwidth, after));
      step.tierBytes += updates[j].second;
    }
  };
  emitReads(0, -1);
  size_t next = 0; // the next update in task order
  for (size_t i = 0; i < n; ++i) {
    Task task = std::move(step.tasks[i]);
    // Deps and releases name this or earlier tasks, mapped by now.
    newIndex[i] = tasks.size();
    for (int64_t &dep : task.deps)
      dep = newIndex[dep];
    for (int64_t &blocker : task.issueAfter)
      blocker = newIndex[blocker];
    for (Release &r : task.frees)
      for (int64_t &user : r.users)
        user = newIndex[user];
    bool isUpdate = next < k && updates[next].first == int64_t(i);
    if (isUpdate)
      task.deps.push_back(readIndex[next]);
    tasks.push_back(std::move(task));
    if (isUpdate) {
      writeIndex[next] = tasks.size();
      tasks.push_back(
          transfer(updates[next].second, hw.nvmeWriteBandwidth, newIndex[i]));
      emitReads(next + 1, writeIndex[next]);
      ++next;
    }
  }
  step.tasks = std::move(tasks);
  if (step.taskOf.empty())
    step.taskOf.assign(newIndex.begin(), newIndex.end());
  else
    for (int64_t &t : step.taskOf)
      t = newIndex[t];
  for (StepTasks::Update &u : step.updates)
    u.task = newIndex[u.task];
}

llvm::Expected<Built> build(const exec::ExecPlan &plan, const HardwareModel &hw,
                            int64_t hostPoolNoReuseBytes) {
  if (llvm::Error err = checkIds(plan))
    return std::move(err);
  llvm::Expected<Buffers> buffers = collectBuffers(plan);
  if (!buffers)
    return buffers.takeError();

  size_t n = plan.instructions.size();
  std::vector<int64_t> producer(plan.values.size(), -1);
  std::vector<int64_t> recordOf(std::max<int64_t>(plan.numEvents, 0), -1);
  std::vector<Task> tasks(n);
  for (size_t i = 0; i < n; ++i) {
    const exec::Instruction &inst = plan.instructions[i];
    Task &task = tasks[i];
    task.stream = inst.stream;
    if (inst.op == exec::OpCode::Record) {
      recordOf[*inst.event] = i;
      continue;
    }
    if (inst.op == exec::OpCode::Wait) {
      task.deps.push_back(recordOf[*inst.event]);
      // The cuda backend waits for a host-stream record on its issuing
      // thread (CudaStep.cpp).
      if (exec::isGpuStream(inst.stream) &&
          !exec::isGpuStream(plan.instructions[recordOf[*inst.event]].stream))
        task.issueAfter.push_back(recordOf[*inst.event]);
      continue;
    }
    task.seconds = secondsFor(plan, inst, hw);
    // parseHardwareModel's ranges keep every time finite; a model built
    // in code may not, and an infinite time would corrupt the replay (and
    // its memory figures) rather than fail.
    if (!std::isfinite(task.seconds) || task.seconds < 0)
      return errorAt(i, "the hardware model '" + hw.name +
                            "' gives it a time of " +
                            std::to_string(task.seconds) +
                            " s; check its rates and efficiencies");
    // Host traffic, at the rate that fills the task's own time.
    task.hostBytes = hostMemoryBytes(plan, inst);
    if (task.hostBytes > 0 && task.seconds > 0)
      task.hostRate = task.hostBytes / task.seconds;
    else
      task.hostBytes = 0;
    for (int64_t o : inst.operands)
      if (producer[o] >= 0)
        task.deps.push_back(producer[o]);
    for (int64_t r : inst.results)
      producer[r] = i;
    // Results occupy their arena bytes from the producer on; a view (a
    // reshape, an in-place collective) takes none of its own.
    for (int64_t r : inst.results) {
      const exec::Value &v = plan.values[r];
      if (v.home == exec::Home::Device && v.offset >= 0 && !v.viewOf)
        task.writes.push_back({v.offset, v.type.bytes()});
    }
    for (const exec::Range &w : inst.workspace)
      task.writes.push_back({w.offset, w.size});
  }

  // A buffer's bytes are free once its producer and every reader have
  // ended; the release goes with its last user in program order.
  for (const Buffer &b : buffers->buffers) {
    const exec::Value &v = plan.values[b.value];
    if (b.returned || b.producer < 0 || v.offset < 0)
      continue;
    Release release{{v.offset, v.type.bytes()}, {b.producer}};
    llvm::append_range(release.users, b.readers);
    int64_t last = std::max(b.producer,
                            b.readers.empty() ? int64_t(-1) : b.readers.back());
    tasks[last].frees.push_back(std::move(release));
  }
  for (size_t i = 0; i < n; ++i)
    for (const exec::Range &w : plan.instructions[i].workspace)
      tasks[i].frees.push_back({{w.offset, w.size}, {static_cast<int64_t>(i)}});
  // Pinned bytes reused across streams as the cuda backend lays them out:
  // a GPU instruction that must wait for a host-stream one (a gradient copy
  // into a ring slot whose last gradient's host AdamW is still running)
  // blocks the issuing thread, and everything after it with it.
  exec::HostPoolLayout pool = exec::layoutHostPool(
      plan, exec::computeLiveness(plan), hostPoolNoReuseBytes);
  std::vector<std::vector<exec::Dependency>> waits =
      exec::crossStreamWaits(plan, pool.offset, pool.bytes);
  for (size_t i = 0; i < n; ++i)
    if (exec::isGpuStream(plan.instructions[i].stream))
      for (const exec::Dependency &d : waits[i])
        if (!exec::isGpuStream(d.stream))
          tasks[i].issueAfter.push_back(d.instruction);
  Built built{StepTasks{std::move(tasks), {}, {}, pool.ringSlots,
                        pool.ringSlotBytes},
              std::move(*buffers)};
  insertDeferredUpdates(plan, hw, built.step);
  insertTierIo(plan, hw, built.step);
  return built;
}

/// Device bytes occupied over the replayed time, as (time, change) pairs:
/// a buffer from its producer's start until its release (a returned one
/// until the end of the step), a workspace during its instruction.
std::vector<std::pair<double, int64_t>> occupancy(const exec::ExecPlan &plan,
                                                  const Built &replay,
                                                  const Timeline &timeline) {
  std::vector<std::pair<double, int64_t>> changes;
  auto occupy = [&](int64_t bytes, double from, double until) {
    if (bytes == 0)
      return;
    changes.push_back({from, bytes});
    changes.push_back({until, -bytes});
  };
  for (const Buffer &b : replay.buffers.buffers) {
    const exec::Value &v = plan.values[b.value];
    if (b.producer < 0 || v.offset < 0)
      continue;
    double until = b.returned ? timeline.makespan : timeline.end[b.producer];
    if (!b.returned)
      for (int64_t reader : b.readers)
        until = std::max(until, timeline.end[reader]);
    occupy(v.type.bytes(), timeline.start[b.producer], until);
  }
  for (auto [i, inst] : llvm::enumerate(plan.instructions))
    for (const exec::Range &w : inst.workspace)
      occupy(w.size, timeline.start[i], timeline.end[i]);
  return changes;
}

} // namespace

llvm::Expected<StepTasks> sim::buildTasks(const exec::ExecPlan &plan,
                                          const HardwareModel &hw,
                                          int64_t hostPoolNoReuseBytes) {
  llvm::Expected<Built> replay = build(plan, hw, hostPoolNoReuseBytes);
  if (!replay)
    return replay.takeError();
  return std::move(replay->step);
}

IssueWaits sim::issueWaits(const StepTasks &step, double hostBandwidth,
                           double makespan) {
  IssueWaits w;
  std::vector<Task> free = step.tasks;
  for (Task &task : free)
    if (!task.issueAfter.empty()) {
      ++w.instructions;
      task.issueAfter.clear();
    }
  if (w.instructions)
    w.seconds = makespan - replay(free, hostBandwidth).makespan;
  return w;
}

double sim::withoutTierIo(const StepTasks &step, double hostBandwidth) {
  std::vector<Task> tasks = step.tasks;
  for (Task &task : tasks)
    if (task.io)
      task.seconds = 0;
  return replay(tasks, hostBandwidth).makespan;
}

Timeline sim::perInstruction(const Timeline &timeline, const StepTasks &step) {
  if (step.taskOf.empty())
    return timeline;
  Timeline t = timeline;
  t.start.resize(step.taskOf.size());
  t.end.resize(step.taskOf.size());
  for (auto [i, task] : llvm::enumerate(step.taskOf)) {
    t.start[i] = timeline.start[task];
    t.end[i] = timeline.end[task];
  }
  return t;
}

llvm::Expected<SimResult> sim::simulateStep(const exec::ExecPlan &plan,
                                            const HardwareModel &hw,
                                            trace::ChromeTrace *trace,
                                            int64_t hostPoolNoReuseBytes) {
  llvm::Expected<Built> built = build(plan, hw, hostPoolNoReuseBytes);
  if (!built)
    return built.takeError();
  Timeline replayed = replay(built->step.tasks, hw.hostMemoryBandwidth);
  Timeline timeline = perInstruction(replayed, built->step);

  SimResult r;
  r.makespan = timeline.makespan;
  r.lowerBound = timeline.lowerBound();
  for (int s = 0; s < exec::kNumStreams; ++s) {
    r.busy[s] = timeline.busy[s];
    if (r.busy[s] > r.busy[static_cast<int>(r.boundBy)])
      r.boundBy = static_cast<exec::Stream>(s);
  }
  for (const exec::Instruction &inst : plan.instructions) {
    if (inst.stream == exec::Stream::Compute)
      r.deviceFlops += flopsOf(inst.cost);
    if (inst.op == exec::OpCode::Fetch || inst.op == exec::OpCode::HostToDevice)
      r.h2dBytes += inst.cost.bytes;
    else if (inst.op == exec::OpCode::DeviceToHost)
      r.d2hBytes += inst.cost.bytes;
  }

  for (const Task &task : built->step.tasks)
    for (ByteRange w : task.writes)
      r.arenaHighWater = std::max(r.arenaHighWater, w.offset + w.size);
  std::vector<std::pair<double, int64_t>> changes =
      occupancy(plan, *built, timeline);
  // Releases before writes at the same instant: the bytes change hands.
  llvm::stable_sort(changes, [](const auto &a, const auto &b) {
    return a.first < b.first || (a.first == b.first && a.second < b.second);
  });
  std::vector<std::pair<double, int64_t>> memory; // (time, bytes from then)
  int64_t live = 0;
  for (auto [time, change] : changes) {
    live += change;
    if (!memory.empty() && memory.back().first == time)
      memory.back().second = live;
    else
      memory.push_back({time, live});
  }
  for (auto [time, bytes] : memory)
    r.peakLiveBytes = std::max(r.peakLiveBytes, bytes);
  r.start = std::move(timeline.start);
  r.end = std::move(timeline.end);
  for (const StepTasks::Update &u : built->step.updates)
    r.updates.push_back(
        {u.fetch, u.hostAdamW, replayed.start[u.task], replayed.end[u.task]});
  r.issueWaits =
      issueWaits(built->step, hw.hostMemoryBandwidth, replayed.makespan);
  r.tierBytes = built->step.tierBytes;
  r.ioBusy = replayed.ioBusy;
  if (r.tierBytes)
    r.tierGrowth =
        replayed.makespan - withoutTierIo(built->step, hw.hostMemoryBandwidth);

  if (trace) {
    for (const exec::TraceSpan &span : traceSpans(plan, r))
      trace->complete(span);
    if (memory.empty() || memory.front().first > 0)
      trace->counter("device memory", 0, {{"bytes", int64_t(0)}});
    for (auto [time, bytes] : memory)
      trace->counter("device memory", time, {{"bytes", bytes}});
    trace->setOtherData("backend", "sim");
    trace->setOtherData("hardware", hw.name);
    trace->setOtherData("predicted_seconds", r.makespan);
    trace->setOtherData("lower_bound_seconds", r.lowerBound);
  }
  return r;
}

std::vector<exec::TraceSpan> sim::traceSpans(const exec::ExecPlan &plan,
                                             const SimResult &result) {
  std::vector<exec::TraceSpan> spans;
  for (auto [i, inst] : llvm::enumerate(plan.instructions)) {
    if (isEvent(inst))
      continue;
    spans.push_back(exec::instructionSpan(inst, i, result.start[i],
                                          result.end[i] - result.start[i]));
  }
  return spans;
}

llvm::Expected<std::unique_ptr<SimBackend>>
SimBackend::create(const exec::ExecPlan &plan, HardwareModel hw) {
  // A rank of a job replays with its share of the node's host.
  hw = rankShare(plan, std::move(hw));
  llvm::Expected<SimResult> sim = simulateStep(plan, hw);
  if (!sim)
    return sim.takeError();
  return std::unique_ptr<SimBackend>(
      new SimBackend(plan, std::move(hw), std::move(*sim)));
}

llvm::Expected<exec::StepResult>
SimBackend::step(const exec::StepInputs &inputs, host::HostState &state,
                 const exec::StepOptions &options) {
  exec::StepResult result;
  result.seconds = sim.makespan;
  result.memory.plannedArenaBytes = plan.arenaBytes;
  result.memory.plannedLiveBytes = plan.plannedLiveBytes;
  result.memory.measuredArenaBytes = sim.arenaHighWater;
  result.memory.measuredLiveBytes = sim.peakLiveBytes;
  if (options.trace)
    result.spans = traceSpans(plan, sim);
  return result;
}
