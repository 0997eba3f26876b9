//===- TextReport.cpp - A plan report as text -----------------------------===//
//
// What `megaslide-plan` prints without --format json or html: memory,
// transfers, the step time and the recipe, then whether the step fits.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Report/TextReport.h"

#include "megaslide/Support/Units.h"
#include "megaslide/runtime/sim/HardwareModel.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace megaslide;

namespace {

void printRecipe(const PlanReport &r, llvm::raw_ostream &os) {
  const PlanReport::Recipe &c = r.recipe;
  const RecipeBytes &b = c.bytes;
  auto bytesAndRate = [&](uint64_t bytes) {
    return llvm::formatv("{0} ({1} B/param)", formatBytes(bytes),
                         b.trainableParams ? bytes / b.trainableParams : 0)
        .str();
  };
  os << "\nTraining recipe: " << c.update << " update (" << c.reason
     << "); grad-accum " << c.gradAccum << "; EMA " << c.ema << "\n";
  os << "  host left for the recipe " << formatBytes(c.hostFreeBytes) << " of "
     << formatBytes(r.hostBudget) << "\n";
  os << "  deferred update / clipping"
     << (c.update == "deferred" ? "" : " (not planned)") << ": "
     << (b.accumulatorBytes ? "fp32 gradient accumulator "
                            : "retained gradients ")
     << bytesAndRate(b.deferredBytes())
     << llvm::formatv(
            "; updates replayed before their fetches {0:F3} s, "
            "the last ends at {1:F3} s, the forward at {2:F3} "
            "s; step {3}{4:F3} s against streaming",
            c.updateSeconds, c.updatesEnd, c.forwardEnd,
            c.deferred.stepSeconds >= c.streaming.stepSeconds ? "+" : "-",
            std::abs(c.deferred.stepSeconds - c.streaming.stepSeconds))
     << "\n";
  if (c.block >= 0)
    os << llvm::formatv("    block {0}: AdamW {1:F3} s against its forward "
                        "compute {2:F3} s ({3})\n",
                        c.block, c.blockUpdateSeconds, c.blockForwardSeconds,
                        c.blockUpdateSeconds <= c.blockForwardSeconds
                            ? "hidden"
                            : "longer: the fetches wait");
  if (c.gradAccum > 1)
    os << llvm::formatv("  grad accumulation: {0} micro-batches, fp32 "
                        "accumulator {1}; {2} adds {3:F3} s (estimate)\n",
                        c.gradAccum, bytesAndRate(b.accumulatorBytes),
                        c.gradAccum - 1, c.accumulateSeconds);
  os << "  device-side accumulation of every gradient would need "
     << formatBytes(c.deviceAccumulationBytes) << " (fp32) besides the peak: "
     << (c.deviceAccumulationFits ? "fits" : "does not fit") << "\n";
  if (b.emaBytes)
    os << "  EMA (" << c.ema << "): " << bytesAndRate(b.emaBytes)
       << llvm::formatv("; one host pass {0:F3} s per optimizer step "
                        "(estimate)\n",
                        c.emaSeconds);
  for (const PlanReport::Recipe::Mode *m : {&c.deferred, &c.streaming}) {
    if (!m->available) {
      os << "  " << m->name << ": " << m->note << "\n";
      continue;
    }
    os << llvm::formatv("  {0,-9} host {1} ({2}), step {3:F3} s, host "
                        "optimizer {4:F3} s; {5}\n",
                        m->name, formatBytes(m->hostBytes),
                        m->hostFits ? "fits" : "does not fit", m->stepSeconds,
                        m->hostOptimizerSeconds, m->note);
  }
  os << llvm::formatv("  optimizer step: {0:F3} s ({1} x the step",
                      c.optimizerStepSeconds, c.gradAccum)
     << (c.gradAccum > 1 ? " + accumulation" : "")
     << (b.emaBytes ? " + EMA" : "") << ")\n";
  for (const std::string &a : c.advice)
    os << "  to fit: " << a << "\n";
}

void printJob(const PlanReport &r, llvm::raw_ostream &os) {
  const PlanReport::Job &job = r.job;
  os << llvm::formatv(
      "\nJob: {0} ranks = {1} node(s) x {2} GPUs, data parallel\n", job.ranks(),
      job.nodes, job.gpusPerNode);
  os << llvm::formatv(
      "  per rank: step {0:F3} s (optimizer step {1:F3} s + norm all-reduce "
      "{2:F6} s); collectives {3:F3} s on the comm stream, {4} sent per "
      "rank\n",
      job.stepSeconds, r.recipe.optimizerStepSeconds, job.normAllReduceSeconds,
      job.collectiveSeconds, formatBytes(job.collectiveBytes));
  os << llvm::formatv("  job: {0:F4} samples/s ({1} x {2:F4} per rank)\n",
                      job.samplesPerSecond, job.ranks(),
                      job.samplesPerSecond / double(job.ranks()));
  if (job.oneGpuStepSeconds > 0)
    os << llvm::formatv(
        "  one GPU (the same model and options, one rank, replayed): step "
        "{0:F3} s, {1:F4} samples/s; scaling efficiency {2:P1}\n",
        job.oneGpuStepSeconds, job.oneGpuSamplesPerSecond,
        job.scalingEfficiency);
  os << llvm::formatv(
      "  host memory: {0} per rank, {1} per node of {2} "
      "(host-mem){3}\n",
      formatBytes(job.hostPerRankBytes), formatBytes(job.hostPerNodeBytes),
      formatBytes(r.hostBudget),
      job.nodesToFitHost ? llvm::formatv("; fits from {0} node(s) of {1} GPUs",
                                         job.nodesToFitHost, job.gpusPerNode)
                               .str()
                         : std::string());
  os << llvm::formatv("  device memory per rank: peak {0} of {1}\n",
                      formatBytes(r.devicePeak), formatBytes(r.arenaBudget));
  for (const std::string &a : job.advice)
    os << "  to fit: " << a << "\n";
}

} // namespace

void megaslide::printText(const PlanReport &r, llvm::raw_ostream &os) {
  os << "Plan on " << r.hardware.name << "\n";
  os << "  host-state policy " << r.hostStatePolicy << "; activations:";
  std::map<std::string, int> counts;
  for (const std::string &p : r.activationPolicy)
    ++counts[p];
  for (const auto &[p, n] : counts)
    os << " " << p << " x" << n;
  const PlanReport::Job &job = r.job;
  if (job.ranks() > 1)
    os << llvm::formatv("\n  job: {0} ranks, {1} GPUs on each of {2} "
                        "node(s); host state sharded over the ranks; every "
                        "figure is one rank's but the host memory, one "
                        "node's",
                        job.ranks(), job.gpusPerNode, job.nodes);
  os << "\n\nHost memory" << (job.ranks() > 1 ? " per node" : "") << ": "
     << formatBytes(r.hostTotal) << " of " << formatBytes(r.hostBudget)
     << llvm::formatv(" ({0:F2} B per parameter besides the OS allowance)\n",
                      r.hostBytesPerParam);
  for (const auto &[name, bytes] : r.hostByCategory)
    os << llvm::formatv("  {0,-28} {1}\n", name, formatBytes(bytes));
  for (const auto &[name, bytes] : r.tier.onNvme)
    os << llvm::formatv("  {0,-28} {1} on NVMe, not in host memory\n", name,
                        formatBytes(bytes));
  os << "\nDevice memory: peak " << formatBytes(r.devicePeak) << " of "
     << formatBytes(r.arenaBudget) << " (GPU budget "
     << formatBytes(r.gpuBudget) << " less a runtime "
     << "reserve of " << formatBytes(r.gpuReserve) << "; peak at op "
     << r.peakStep << ")\n";
  for (const auto &[name, bytes] : r.deviceByCategory)
    os << llvm::formatv("  {0,-28} {1}\n", name, formatBytes(bytes));
  os << "  largest live buffers at the peak:\n";
  for (const auto &[bytes, what] : llvm::ArrayRef(r.topConsumers).take_front(5))
    os << llvm::formatv("    {0}  {1}\n", formatBytes(bytes), what);
  if (!r.layers.empty()) {
    const PlanReport::Layer &l = r.layers.front();
    os << llvm::formatv("  per block (block 0): weight shard {0}, device peak "
                        "{1}, checkpoint {2}\n",
                        formatBytes(l.shardBytes), formatBytes(l.devicePeak),
                        formatBytes(l.checkpointBytes));
  }
  os << "\nTransfers per step: host->device " << formatBytes(r.h2dBytes)
     << ", device->host " << formatBytes(r.d2hBytes) << "\n";
  os << llvm::formatv(
      "\nStep time: predicted {0:F3} s, lower bound {1:F3} s ({2:F1}% above)\n",
      r.predictedSeconds, r.lowerBoundSeconds,
      r.lowerBoundSeconds > 0
          ? 100.0 * (r.predictedSeconds / r.lowerBoundSeconds - 1)
          : 0.0);
  os << llvm::formatv("  busy: compute {0:F3} s, h2d {1:F3} s, d2h {2:F3} s, "
                      "host optimizer {3:F3} s",
                      r.busySeconds[0], r.busySeconds[1], r.busySeconds[2],
                      r.busySeconds[3]);
  if (job.ranks() > 1)
    os << llvm::formatv(", collectives {0:F3} s",
                        r.busySeconds[static_cast<int>(exec::Stream::Comm)]);
  os << "\n";
  if (const PlanReport::Tier &tier = r.tier; !tier.roles.empty())
    os << llvm::formatv(
        "  NVMe tier ({0}) on {1} drive(s) at {2:F1} GB/s read, {3:F1} GB/s "
        "write each: {4} read and {4} written per step through a window of "
        "{5}; I/O busy {6:F3} s, {7} (estimate: the drives' sequential "
        "rates)\n",
        llvm::join(tier.roles, ", "), tier.drives,
        r.hardware.nvmeReadBandwidth / 1e9, r.hardware.nvmeWriteBandwidth / 1e9,
        formatBytes(tier.bytesPerStep), formatBytes(tier.windowBytes),
        tier.ioSeconds,
        llvm::formatv("{0}: the step takes {1:F3} s more than without it",
                      tier.hidden(r.predictedSeconds)
                          ? "hidden behind compute"
                          : "not hidden behind compute",
                      tier.stepGrowthSeconds));
  if (r.gradientRingSlots > 0)
    os << llvm::formatv(
        "  gradient ring: {0} pinned buffers of {1}; {2} of {3} gradient "
        "copies follow a host update of their buffer, adding {4:F3} s "
        "(--gradient-buffers)\n",
        r.gradientRingSlots, formatBytes(r.gradientRingSlotBytes),
        r.issueWaits.instructions, r.gradientCopies, r.issueWaits.seconds);
  // Where the compute stream's time goes, largest first.
  std::vector<int> order;
  for (int f = 0; f < sim::kNumKernelFamilies; ++f)
    if (r.byFamily[f].instructions &&
        f != static_cast<int>(sim::KernelFamily::None))
      order.push_back(f);
  llvm::stable_sort(order, [&](int a, int b) {
    return r.byFamily[a].seconds > r.byFamily[b].seconds;
  });
  if (!order.empty())
    os << "  compute by kernel family:";
  for (auto [n, f] : llvm::enumerate(order))
    os << llvm::formatv(
        "{0} {1} {2:F3} s", n ? "," : "",
        sim::kernelFamilyName(static_cast<sim::KernelFamily>(f)),
        r.byFamily[f].seconds);
  if (!order.empty())
    os << "\n";
  // The elementwise family by op, each priced by its own kernel's bytes and
  // instructions (docs/CostModel.md, "Kernel families"): the largest five.
  std::vector<std::pair<std::string, double>> ops(r.elementwiseByOp.begin(),
                                                  r.elementwiseByOp.end());
  llvm::stable_sort(ops, [](const auto &a, const auto &b) {
    return a.second > b.second;
  });
  if (!ops.empty()) {
    os << "  elementwise by op:";
    for (auto [n, op] : llvm::enumerate(llvm::ArrayRef(ops).take_front(5)))
      os << llvm::formatv("{0} {1} {2:F3} s", n ? "," : "", op.first,
                          op.second);
    if (ops.size() > 5)
      os << llvm::formatv(", {0} more", ops.size() - 5);
    os << "\n";
  }
  os << llvm::formatv(
      "  FLOPs: model {0:E3} (as planned, without recomputation), executed "
      "{1:E3} ({2:F1}% recomputation); MFU {3:F1}% of {4:F0} TFLOP/s\n",
      double(r.modelFlops()), double(r.deviceFlops),
      r.deviceFlops ? 100.0 * double(r.recomputeFlops) / double(r.deviceFlops)
                    : 0.0,
      100.0 * r.mfu(), r.peakFlops / 1e12);
  if (!r.recipe.update.empty())
    printRecipe(r, os);
  if (job.ranks() > 1)
    printJob(r, os);
  if (r.fits()) {
    os << "\nFITS.\n";
  } else {
    os << "\nDOES NOT FIT:\n";
    for (const std::string &v : r.violations)
      os << "  " << v << "\n";
    if (!r.fitOptions.empty())
      os << "\nTo fit (each change planned again; smallest change first):\n";
    for (const PlanReport::FitOption &o : r.fitOptions)
      os << llvm::formatv("  {0}: {1}; {2}: needs {3} of {4}{5}\n", o.change,
                          o.what, o.fits ? "fits" : "not enough",
                          formatBytes(o.hostBytes), formatBytes(o.hostBudget),
                          o.note.empty() ? "" : ", " + o.note);
  }
}
