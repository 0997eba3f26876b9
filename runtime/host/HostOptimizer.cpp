//===- HostOptimizer.cpp - The optimizer that runs on the host ------------===//

#include "megaslide/runtime/host/HostOptimizer.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/Finite.h"
#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/runtime/cpu/ParallelFor.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <cstring>

using namespace megaslide;
using namespace megaslide::host;
using exec::DType;

cpu::AdamWHyper host::adamwHyperOf(const exec::Instruction &inst,
                                   int64_t step) {
  cpu::AdamWHyper hyper; // the defaults, for attributes the plan leaves out
  hyper.lr = inst.floatAttr("lr").value_or(hyper.lr);
  hyper.beta1 = inst.floatAttr("beta1").value_or(hyper.beta1);
  hyper.beta2 = inst.floatAttr("beta2").value_or(hyper.beta2);
  hyper.eps = inst.floatAttr("eps").value_or(hyper.eps);
  hyper.weightDecay =
      inst.floatAttr("weight_decay").value_or(hyper.weightDecay);
  hyper.step = step;
  return hyper;
}

double host::clipFactor(double maxGradNorm, double norm) {
  if (maxGradNorm <= 0)
    return 1.0;
  if (!std::isfinite(norm))
    return NAN;
  return std::min(1.0, maxGradNorm / (norm + 1e-6));
}

double host::emaDecayAt(double decay, bool warmup, int64_t k) {
  if (!warmup)
    return decay;
  return std::min(decay, double(1 + k) / double(10 + k)) * (k > 0 ? 1.0 : 0.0);
}

llvm::Expected<AdamWTensors> host::adamwTensors(HostState &state,
                                                llvm::StringRef param) {
  AdamWTensors t{state.find(param), state.expAvg(param), state.expAvgSq(param)};
  if (!t.master || !t.m || !t.v)
    return llvm::createStringError("host state lacks '" + param +
                                   "' or its AdamW moments");
  return t;
}

/// The update of moments kept as ExecPlan::hostState says, with gradient
/// `grad` (fp32 or bf16): cpu::adamw8bitStep over int8 codes, or
/// cpu::factoredStatsStep then cpu::adamwFactoredStep over a matrix's bf16 m
/// and row/column statistics.
template <typename Grad>
static void leanUpdate(const cpu::AdamWHyper &hyper, const AdamWTensors &t,
                       int64_t n, const Grad *grad) {
  float *p = t.master->data.data();
  if (!t.m->codes.empty()) {
    cpu::adamw8bitStep(hyper, n, p, t.m->codes.data(), t.m->absmax.data(),
                       t.v->codes.data(), t.v->absmax.data(), grad);
    return;
  }
  const std::vector<int64_t> &shape = t.master->param->type.shape;
  cpu::FactoredShape f{shape[0], n / shape[0]};
  cpu::factoredStatsStep(hyper, f, grad, t.v->rowStat.data(),
                         t.v->colStat.data());
  cpu::adamwFactoredStep(hyper, f, 0, n, p, t.m->bf16.data(),
                         t.v->rowStat.data(), t.v->colStat.data(),
                         cpu::factoredRowTotal(f, t.v->rowStat.data()), grad);
}

void host::adamwUpdate(const cpu::AdamWHyper &hyper, const AdamWTensors &t,
                       const HostGradient &g) {
  if (t.m->lean() || t.v->lean()) {
    if (g.dtype == DType::BF16) {
      leanUpdate(hyper, t, g.count, static_cast<const uint16_t *>(g.data));
    } else if (g.dtype == DType::F32) {
      leanUpdate(hyper, t, g.count, static_cast<const float *>(g.data));
    } else {
      std::vector<float> wide(g.count);
      cpu::widen(g.data, g.dtype, g.count, wide.data());
      leanUpdate(hyper, t, g.count, wide.data());
    }
    return;
  }
  float *p = t.master->data.data(), *m = t.m->data.data(),
        *v = t.v->data.data();
  if (g.dtype == DType::BF16) {
    cpu::adamwStep(hyper, g.count, p, m, v,
                   static_cast<const uint16_t *>(g.data), nullptr);
  } else if (g.dtype == DType::F32) {
    cpu::adamwStep(hyper, g.count, p, m, v, static_cast<const float *>(g.data),
                   nullptr);
  } else {
    std::vector<float> wide(g.count);
    cpu::widen(g.data, g.dtype, g.count, wide.data());
    cpu::adamwStep(hyper, g.count, p, m, v, wide.data(), nullptr);
  }
}

/// The index of the first NaN or infinity of `g`, if any.
static std::optional<int64_t> firstNonFinite(const HostGradient &g) {
  switch (g.dtype) {
  case DType::BF16:
    return cpu::firstNonFiniteBf16(static_cast<const uint16_t *>(g.data),
                                   g.count);
  case DType::F16:
    return cpu::firstNonFiniteF16(static_cast<const uint16_t *>(g.data),
                                  g.count);
  default:
    return cpu::firstNonFinite(static_cast<const float *>(g.data), g.count);
  }
}

llvm::Expected<double> host::streamingUpdate(HostState &state,
                                             const AdamWTensors &t,
                                             const exec::Instruction &inst,
                                             const HostGradient &g,
                                             const StreamingSettings &s) {
  if (std::optional<int64_t> bad = firstNonFinite(g)) {
    float value;
    cpu::widen(static_cast<const uint8_t *>(g.data) +
                   *bad * exec::dtypeBytes(g.dtype),
               g.dtype, 1, &value);
    return llvm::createStringError(
        cpu::nonFiniteGradientMessage(inst.param, s.step, *bad, value));
  }
  double squared = cpu::squaredNorm(g.data, g.dtype, g.count);
  state.incomplete = true;
  cpu::AdamWHyper hyper = adamwHyperOf(inst, s.step);
  hyper.lr = s.lr.value_or(hyper.lr);
  hyper.gradScale = s.gradScale;
  adamwUpdate(hyper, t, g);
  return squared;
}

//===----------------------------------------------------------------------===//
// HostOptimizer
//===----------------------------------------------------------------------===//

int64_t HostOptimizer::Options::ranks() const {
  return collectives ? collectives->size() : 1;
}

namespace {
/// What the optimizer keeps of one parameter's gradient between its
/// micro-batches: their fp32 sum over several, else (deferred) the bytes
/// of one.
struct GradientHold {
  int64_t accumCount = 0;
  uint64_t retainedBytes = 0;
};
} // namespace

/// The elements of a parameter of `count` a rank holds of its sharded
/// state (host::shardedRole): its shard in a job of several ranks.
static int64_t heldCount(int64_t count, const HostOptimizer::Options &o) {
  return o.ranks() > 1
             ? dist::shardRange(count, o.collectives->rank(), o.ranks()).size()
             : count;
}

static GradientHold gradientHold(const exec::TensorType &g,
                                 const HostOptimizer::Options &o) {
  GradientHold hold;
  // Summed in fp32 over micro-batches, and over a job's ranks: by the
  // host, or on the device before it arrives as this rank's shard.
  if (o.ranks() > 1 && o.deviceReduces) {
    int64_t held = heldCount(g.numElements(), o);
    if (o.gradAccum > 1)
      hold.accumCount = held;
    else
      hold.retainedBytes = held * exec::dtypeBytes(g.dtype);
  } else if (o.gradAccum > 1 || o.ranks() > 1)
    hold.accumCount = g.numElements();
  else if (o.deferred)
    hold.retainedBytes = g.bytes();
  return hold;
}

static DType emaDType(const HostOptimizer::Options &o) {
  return o.emaBf16 ? DType::BF16 : DType::F32;
}

HostOptimizer::Footprint HostOptimizer::footprint(const exec::ExecPlan &plan,
                                                  const Options &o) {
  Footprint f;
  for (const exec::Instruction &inst : plan.instructions) {
    if (inst.op != exec::OpCode::HostAdamW)
      continue;
    const exec::TensorType &g = plan.values[inst.operands[0]].type;
    GradientHold hold = gradientHold(g, o);
    f.retainedBytes += hold.retainedBytes;
    f.accumBytes += hold.accumCount * sizeof(float);
    if (o.hasEma())
      f.emaBytes +=
          heldCount(g.numElements(), o) * exec::dtypeBytes(emaDType(o));
  }
  return f;
}

void HostOptimizer::prepare(const exec::ExecPlan &p, HostState &s,
                            const Options &o) {
  plan = &p;
  state = &s;
  options = o;
  if (o.hasEma())
    for (const exec::Instruction &inst : p.instructions)
      if (inst.op == exec::OpCode::HostAdamW) {
        const HostTensor *master = s.find(inst.param);
        if (!master || s.find(inst.param + ".ema"))
          continue;
        exec::Param param = *master->param;
        param.name = inst.param + ".ema";
        param.role = "ema";
        param.of = inst.param;
        param.type.dtype = emaDType(o);
        s.addTensor(std::move(param), master); // sharded like its master
      }
  // Pointers into the state only now that no tensor is added.
  updates.clear();
  updateIndex.clear();
  for (const exec::Instruction &inst : p.instructions) {
    if (inst.op != exec::OpCode::HostAdamW)
      continue;
    Update u;
    u.inst = &inst;
    u.tensors = {s.find(inst.param), s.expAvg(inst.param),
                 s.expAvgSq(inst.param)};
    u.ema = s.find(inst.param + ".ema");
    const exec::TensorType &g = p.values[inst.operands[0]].type;
    u.dtype = g.dtype;
    u.count = g.numElements();
    GradientHold hold = gradientHold(g, o);
    u.accum.resize(hold.accumCount);
    u.retained.resize(hold.retainedBytes);
    updateIndex[inst.param] = updates.size();
    updates.push_back(std::move(u));
  }
}

/// The EMA starts as a copy of the weights (rounded, for a bf16 EMA).
static void copyToEma(const HostTensor &master, HostTensor &ema) {
  if (ema.bf16.empty()) {
    ema.data = master.data;
    return;
  }
  cpu::narrow(master.data.data(), DType::BF16, master.data.size(),
              ema.bf16.data());
}

void HostOptimizer::startEma() {
  if (options.hasEma() && emaCount == 0 && !options.emaWarmup)
    for (Update &u : updates)
      copyToEma(*u.tensors.master, *u.ema);
}

double HostOptimizer::beginStreamingStep() {
  startEma();
  return lastNorm ? clipFactor(options.maxGradNorm, *lastNorm) : 1.0;
}

double HostOptimizer::endStreamingStep(double gradSquaredNorm) {
  double norm = std::sqrt(gradSquaredNorm);
  lastNorm = norm;
  if (options.hasEma()) {
    pendingEmaDecay =
        emaDecayAt(options.emaDecay, options.emaWarmup, emaCount++);
    for (Update &u : updates)
      updateEma(u);
  }
  return norm;
}

void HostOptimizer::retain(const exec::Instruction &inst,
                           const HostGradient &g) {
  Update &u = updates[updateIndex.find(inst.param)->second];
  if (u.pending)
    apply(u); // a plan fetches a parameter before its gradient; be safe
  // What the step runner gives is what prepare() sized: the whole
  // gradient, or the rank's shard of the device's sum.
  size_t bytes = g.count * exec::dtypeBytes(g.dtype);
  assert((u.accum.empty() ? bytes == u.retained.size()
                          : g.count == static_cast<int64_t>(u.accum.size())) &&
         "a gradient of another size than the optimizer keeps");
  if (u.accum.empty()) {
    std::memcpy(u.retained.data(), g.data, bytes);
    u.squaredNorm = cpu::squaredNorm(g.data, g.dtype, g.count);
  } else if (u.received == 0) {
    cpu::widen(g.data, g.dtype, g.count, u.accum.data());
  } else {
    cpu::accumulate(g.data, g.dtype, g.count, u.accum.data());
  }
  ++u.received;
  // A test-only fault (support/FaultInjection.h): a finite loss with a
  // non-finite gradient, which no input makes.
  if (fault::nanGradient(inst.param, state->step + 1)) {
    float nan = NAN;
    if (u.accum.empty())
      cpu::narrow(&nan, u.dtype, 1, u.retained.data());
    else
      u.accum[0] = nan;
    u.squaredNorm = NAN;
  }
}

void HostOptimizer::applyPending(llvm::StringRef fetched) {
  // A fetch reads a master, or the persistent bf16 copy its update makes.
  const exec::Param *master = plan ? plan->updatedParam(fetched) : nullptr;
  auto it = master ? updateIndex.find(master->name) : updateIndex.end();
  if (it != updateIndex.end() && updates[it->second].pending)
    apply(updates[it->second]);
}

void HostOptimizer::flush() {
  for (Update &u : updates)
    if (u.pending)
      apply(u);
}

void HostOptimizer::apply(Update &u) {
  cpu::AdamWHyper hyper = adamwHyperOf(*u.inst, pendingStep);
  hyper.lr = pendingLr;
  hyper.gradScale = pendingScale;
  if (!u.accum.empty())
    adamwUpdate(hyper, u.tensors, {u.accum.data(), DType::F32, u.count});
  else
    adamwUpdate(hyper, u.tensors, {u.retained.data(), u.dtype, u.count});
  u.pending = false;
  if (u.ema)
    updateEma(u);
}

void HostOptimizer::updateEma(Update &u) {
  // diffusers' EMAModel: ema -= (1 - decay) (ema - param), in fp32.
  // A bf16 EMA computes in fp32 and rounds to nearest even once.
  float oneMinus = static_cast<float>(1.0 - pendingEmaDecay);
  float *e = u.ema->data.data();
  uint16_t *e16 = u.ema->bf16.data();
  const float *p = u.tensors.master->data.data();
  // Elementwise, so the result does not depend on the chunking (or the
  // shard: the master's and the EMA's are the same elements).
  int64_t n = u.tensors.master->held();
  int64_t threads = std::clamp<int64_t>(n >> 16, 1, cpu::cpuThreads());
  cpu::parallelChunks(
      n, threads, cpu::kAdamWChunkAlign, [&](int64_t begin, int64_t end) {
        if (e16)
          for (int64_t i = begin; i < end; ++i) {
            float v = cpu::bf16ToFloat(e16[i]);
            e16[i] = cpu::floatToBf16(v - oneMinus * (v - p[i]));
          }
        else
          for (int64_t i = begin; i < end; ++i)
            e[i] -= oneMinus * (e[i] - p[i]);
      });
}

void HostOptimizer::dropRetained() {
  for (Update &u : updates)
    u.received = 0;
}

llvm::Expected<double> HostOptimizer::retainedNorm() {
  int64_t K = options.gradAccum;
  // The job's micro-batches: the mean is over all of them.
  int64_t all = K * options.ranks();
  std::vector<double> squares;
  for (Update &u : updates) {
    if (u.received != K) {
      dropRetained();
      return llvm::createStringError(llvm::formatv(
          "the plan gave parameter '{0}' {1} gradients in {2} micro-batches",
          u.inst->param, u.received, K));
    }
    // A job's ranks each sum their shard of the gradient over the ranks
    // (the shard they update) and the norm over their shards.
    if (options.ranks() > 1 && !options.deviceReduces)
      if (llvm::Error e = options.collectives->reduceScatterShards(u.accum)) {
        dropRetained();
        return std::move(e);
      }
    if (!u.accum.empty())
      u.squaredNorm = cpu::squaredNorm(u.shardSum(options), DType::F32,
                                       u.tensors.master->held());
    squares.push_back(u.squaredNorm / double(all * all));
  }
  dropRetained();
  if (options.ranks() > 1)
    if (llvm::Error e = options.collectives->allReduceSum(
            llvm::MutableArrayRef<double>(squares)))
      return std::move(e);
  double squared = 0;
  for (double s : squares) // in plan order: the same bits on every rank
    squared += s;
  return std::sqrt(squared);
}

double HostOptimizer::decide(double norm, double lr) {
  double factor = clipFactor(options.maxGradNorm, norm);
  flush(); // none should be left: each fetch applied its own
  if (options.hasEma()) {
    startEma(); // the EMA starts at the weights
    pendingEmaDecay =
        emaDecayAt(options.emaDecay, options.emaWarmup, emaCount++);
  }
  pendingStep = state->step + 1;
  pendingLr = lr;
  pendingScale =
      static_cast<float>(factor / double(options.gradAccum * options.ranks()));
  for (Update &u : updates)
    u.pending = true;
  state->step = pendingStep;
  lastNorm = norm;
  return factor;
}

llvm::Error HostOptimizer::applySharded() {
  for (Update &u : updates) {
    if (!u.pending)
      continue;
    cpu::AdamWHyper hyper = adamwHyperOf(*u.inst, pendingStep);
    hyper.lr = pendingLr;
    hyper.gradScale = pendingScale;
    // Elementwise (cpu::adamwStep): a shard's values are those the whole
    // update gives them. The next fetch gathers the shards
    // (host::gatherWhole).
    int64_t held = u.tensors.master->held();
    for (const HostTensor *t : {u.tensors.master, u.tensors.m, u.tensors.v})
      if (static_cast<int64_t>(t->data.size()) != held)
        return llvm::createStringError(
            llvm::formatv("'{0}' holds {1} values, this rank's shard {2}",
                          t->param->name, t->data.size(), held));
    if (u.accum.empty()) // one micro-batch, summed on the device
      adamwUpdate(hyper, u.tensors, {u.retained.data(), u.dtype, held});
    else
      adamwUpdate(hyper, u.tensors, {u.shardSum(options), DType::F32, held});
    u.pending = false;
    if (u.ema)
      updateEma(u);
  }
  return llvm::Error::success();
}

void HostOptimizer::restore(int64_t emaUpdates,
                            std::optional<double> previousNorm) {
  emaCount = emaUpdates;
  lastNorm = previousNorm;
  for (Update &u : updates) // a checkpoint holds no pending update
    u.pending = false;
}
