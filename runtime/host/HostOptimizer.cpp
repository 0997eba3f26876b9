//===- HostOptimizer.cpp - The optimizer that runs on the host ------------===//

#include "megaslide/runtime/host/HostOptimizer.h"

#include "megaslide/runtime/host/NvmeTier.h"

#include "megaslide/runtime/dist/Collectives.h"

#include "megaslide/runtime/cpu/Convert.h"
#include "megaslide/runtime/cpu/Finite.h"
#include "megaslide/runtime/cpu/LeanAdamW.h"
#include "megaslide/runtime/cpu/ParallelFor.h"
#include "megaslide/runtime/support/FaultInjection.h"

#include "llvm/ADT/DenseSet.h"
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

/// AdamW over `n` elements with moments kept in bf16 (bf16-moments) and
/// the gradient in its dtype, as adamwElements.
static void adamwElementsBf16(const cpu::AdamWHyper &hyper, int64_t n, float *p,
                              uint16_t *m, uint16_t *v, const void *g,
                              DType dtype) {
  if (dtype == DType::BF16) {
    cpu::adamwStepBf16Moments(hyper, n, p, m, v,
                              static_cast<const uint16_t *>(g));
  } else if (dtype == DType::F32) {
    cpu::adamwStepBf16Moments(hyper, n, p, m, v, static_cast<const float *>(g));
  } else {
    std::vector<float> wide(n);
    cpu::widen(g, dtype, n, wide.data());
    cpu::adamwStepBf16Moments(hyper, n, p, m, v, wide.data());
  }
}

/// AdamW over `n` elements with the gradient in its dtype (bf16 and f32
/// read as they are, f16 widened first: the same values).
static void adamwElements(const cpu::AdamWHyper &hyper, int64_t n, float *p,
                          float *m, float *v, const void *g, DType dtype) {
  if (dtype == DType::BF16) {
    cpu::adamwStep(hyper, n, p, m, v, static_cast<const uint16_t *>(g),
                   nullptr);
  } else if (dtype == DType::F32) {
    cpu::adamwStep(hyper, n, p, m, v, static_cast<const float *>(g), nullptr);
  } else {
    std::vector<float> wide(n);
    cpu::widen(g, dtype, n, wide.data());
    cpu::adamwStep(hyper, n, p, m, v, wide.data(), nullptr);
  }
}

llvm::Error host::adamwUpdate(const cpu::AdamWHyper &hyper,
                              const AdamWTensors &t, const HostGradient &g) {
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
    return llvm::Error::success();
  }
  float *p = t.master->data.data();
  // bf16-moments keeps m and v in bf16.
  bool bf16 = t.m->param->type.dtype == DType::BF16;
  if (!t.m->tier) {
    if (bf16)
      adamwElementsBf16(hyper, g.count, p, t.m->bf16.data(), t.v->bf16.data(),
                        g.data, g.dtype);
    else
      adamwElements(hyper, g.count, p, t.m->data.data(), t.v->data.data(),
                    g.data, g.dtype);
    return llvm::Error::success();
  }
  // Moments in the NVMe tier: chunk by chunk as they arrive; AdamW is
  // elementwise, so the result is that of one pass.
  NvmeTier &tier = *t.m->tier;
  size_t gBytes = exec::dtypeBytes(g.dtype);
  for (int64_t c = 0, begin = 0; begin < g.count; ++c) {
    int64_t n = std::min(kTierChunkElements, g.count - begin);
    llvm::Expected<uint8_t *> m = tier.acquire(t.m->tierId, c);
    if (!m)
      return m.takeError();
    llvm::Expected<uint8_t *> v = tier.acquire(t.v->tierId, c);
    if (!v) {
      llvm::consumeError(tier.release(t.m->tierId, c, false));
      return v.takeError();
    }
    const void *grad = static_cast<const uint8_t *>(g.data) + begin * gBytes;
    if (bf16)
      adamwElementsBf16(hyper, n, p + begin, reinterpret_cast<uint16_t *>(*m),
                        reinterpret_cast<uint16_t *>(*v), grad, g.dtype);
    else
      adamwElements(hyper, n, p + begin, reinterpret_cast<float *>(*m),
                    reinterpret_cast<float *>(*v), grad, g.dtype);
    llvm::Error released = tier.release(t.m->tierId, c, /*dirty=*/true);
    if (llvm::Error e = tier.release(t.v->tierId, c, /*dirty=*/true))
      return llvm::joinErrors(std::move(released), std::move(e));
    if (released)
      return released;
    begin += n;
  }
  return llvm::Error::success();
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
  if (llvm::Error e = adamwUpdate(hyper, t, g))
    return std::move(e);
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
    if (o.hasEma() && !tieredRole(plan, "ema")) // else the tier's
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
        // Sharded like its master; in the NVMe tier, allocated there.
        s.addTensor(std::move(param), master, !tieredRole(p, "ema"));
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
static llvm::Error copyToEma(const HostTensor &master, HostTensor &ema) {
  bool bf16 = ema.param->type.dtype == DType::BF16;
  if (ema.tier) {
    if (!bf16)
      return ema.tier->write(ema.tierId, 0, ema.held(), master.data.data());
    std::vector<uint16_t> rounded(master.data.size());
    cpu::narrow(master.data.data(), DType::BF16, master.data.size(),
                rounded.data());
    return ema.tier->write(ema.tierId, 0, ema.held(), rounded.data());
  }
  if (!bf16)
    ema.data = master.data;
  else
    cpu::narrow(master.data.data(), DType::BF16, master.data.size(),
                ema.bf16.data());
  return llvm::Error::success();
}

void HostOptimizer::startEma() {
  if (options.hasEma() && emaCount == 0 && !options.emaWarmup)
    for (Update &u : updates)
      if (llvm::Error e = copyToEma(*u.tensors.master, *u.ema))
        fail(std::move(e));
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
  llvm::Error e =
      u.accum.empty()
          ? adamwUpdate(hyper, u.tensors, {u.retained.data(), u.dtype, u.count})
          : adamwUpdate(hyper, u.tensors,
                        {u.accum.data(), DType::F32, u.count});
  u.pending = false;
  if (e) {
    fail(std::move(e));
    return;
  }
  if (u.ema)
    updateEma(u);
}

/// diffusers' EMAModel over n elements: ema -= (1 - decay) (ema - param),
/// in fp32; a bf16 EMA (e16) computes in fp32 and rounds to nearest even
/// once. Elementwise, so the result depends on neither the threads' nor
/// the tier's chunks (nor the shard: the master's and the EMA's are the
/// same elements).
static void emaElements(float oneMinus, int64_t n, float *e, uint16_t *e16,
                        const float *p) {
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

void HostOptimizer::updateEma(Update &u) {
  float oneMinus = static_cast<float>(1.0 - pendingEmaDecay);
  const float *p = u.tensors.master->data.data();
  int64_t n = u.tensors.master->held();
  HostTensor &ema = *u.ema;
  if (!ema.tier) {
    emaElements(oneMinus, n, ema.data.empty() ? nullptr : ema.data.data(),
                ema.bf16.empty() ? nullptr : ema.bf16.data(), p);
    return;
  }
  bool bf16 = ema.param->type.dtype == DType::BF16;
  for (int64_t c = 0, begin = 0; begin < n; ++c) {
    int64_t count = std::min(kTierChunkElements, n - begin);
    llvm::Expected<uint8_t *> chunk = ema.tier->acquire(ema.tierId, c);
    if (!chunk)
      return fail(chunk.takeError());
    emaElements(
        oneMinus, count, bf16 ? nullptr : reinterpret_cast<float *>(*chunk),
        bf16 ? reinterpret_cast<uint16_t *>(*chunk) : nullptr, p + begin);
    if (llvm::Error e = ema.tier->release(ema.tierId, c, /*dirty=*/true))
      return fail(std::move(e));
    begin += count;
  }
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
    for (const HostTensor *t : {u.tensors.master, u.tensors.m, u.tensors.v}) {
      size_t values = t->bf16.empty() ? t->data.size() : t->bf16.size();
      if (!t->tier && static_cast<int64_t>(values) != held)
        return llvm::createStringError(
            llvm::formatv("'{0}' holds {1} values, this rank's shard {2}",
                          t->param->name, values, held));
    }
    llvm::Error e =
        u.accum.empty() // one micro-batch, summed on the device
            ? adamwUpdate(hyper, u.tensors, {u.retained.data(), u.dtype, held})
            : adamwUpdate(hyper, u.tensors,
                          {u.shardSum(options), DType::F32, held});
    u.pending = false;
    if (e) {
      fail(std::move(e));
      return failed();
    }
    if (u.ema)
      updateEma(u);
  }
  return llvm::Error::success();
}

llvm::Error HostOptimizer::useTier(const NvmeTierOptions &tierOptions) {
  if (llvm::Error e = attachTier(*state, *plan, tierOptions))
    return e;
  NvmeTier *tier = state->tier.get();
  if (!tier)
    return llvm::Error::success();
  // The order updates visit the moments, every step alike: a deferred
  // update lands before its parameter's first fetch (then any left at the
  // flush), a streaming one as its gradient arrives, in program order.
  std::vector<const Update *> visits;
  llvm::DenseSet<const Update *> seen;
  auto visit = [&](llvm::StringRef param) {
    auto it = updateIndex.find(param);
    if (it != updateIndex.end() && seen.insert(&updates[it->second]).second)
      visits.push_back(&updates[it->second]);
  };
  for (const exec::Instruction &inst : plan->instructions)
    if (options.deferred && inst.op == exec::OpCode::Fetch) {
      if (const exec::Param *master = plan->updatedParam(inst.param))
        visit(master->name);
    } else if (!options.deferred && inst.op == exec::OpCode::HostAdamW) {
      visit(inst.param);
    }
  for (const Update &u : updates)
    visit(u.inst->param);
  // A deferred update visits its EMA right after its moments, a streaming
  // one every EMA after the step.
  std::vector<std::pair<NvmeTier::TensorId, int64_t>> order;
  auto visitEma = [&](const Update *u) {
    if (u->ema && u->ema->tier)
      for (int64_t c = 0; c < tier->chunks(u->ema->tierId); ++c)
        order.push_back({u->ema->tierId, c});
  };
  for (const Update *u : visits) {
    if (u->tensors.m->tier)
      for (int64_t c = 0; c < tier->chunks(u->tensors.m->tierId); ++c) {
        order.push_back({u->tensors.m->tierId, c});
        order.push_back({u->tensors.v->tierId, c});
      }
    if (options.deferred)
      visitEma(u);
  }
  if (!options.deferred)
    for (const Update &u : updates)
      visitEma(&u);
  tier->setVisitOrder(std::move(order));
  return llvm::Error::success();
}

void HostOptimizer::fail(llvm::Error e) {
  // Some elements of the update landed: the state is neither step's.
  state->incomplete = true;
  std::string text = llvm::toString(std::move(e));
  if (failure.empty())
    failure = text;
}

llvm::Error HostOptimizer::failed() const {
  if (failure.empty())
    return llvm::Error::success();
  return llvm::createStringError("the host optimizer's update failed: " +
                                 failure);
}

void HostOptimizer::restore(int64_t emaUpdates,
                            std::optional<double> previousNorm) {
  emaCount = emaUpdates;
  lastNorm = previousNorm;
  for (Update &u : updates) // a checkpoint holds no pending update
    u.pending = false;
}
