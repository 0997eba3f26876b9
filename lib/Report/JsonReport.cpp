//===- JsonReport.cpp - A plan report as JSON -----------------------------===//
//
// The plan part of the document docs/PlanSchema.md describes: what
// `megaslide-plan --format json`, the C API and Python's megaslide.plan()
// give, and what the HTML page (HtmlReport.cpp) is drawn from.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Report/JsonReport.h"

#include "megaslide/runtime/plan/Stream.h"
#include "megaslide/runtime/sim/HardwareModel.h"

using namespace megaslide;

namespace {

llvm::json::Object recipeToJson(const PlanReport::Recipe &c) {
  auto mode = [](const PlanReport::Recipe::Mode &m) {
    return llvm::json::Object{
        {"available", m.available},
        {"host_bytes", m.hostBytes},
        {"host_fits", m.hostFits},
        {"step_seconds", m.stepSeconds},
        {"host_optimizer_seconds", m.hostOptimizerSeconds},
        {"note", m.note}};
  };
  const RecipeBytes &b = c.bytes;
  llvm::json::Array advice;
  for (const std::string &a : c.advice)
    advice.push_back(a);
  return llvm::json::Object{
      {"update", c.update},
      {"update_auto", c.chosenByAuto},
      {"reason", c.reason},
      {"grad_accum", c.gradAccum},
      {"ema", c.ema},
      {"trainable_params", b.trainableParams},
      {"host_free_bytes", c.hostFreeBytes},
      {"bytes", llvm::json::Object{{"retained_gradients", b.gradientBytes},
                                   {"gradient_accumulator", b.accumulatorBytes},
                                   {"ema", b.emaBytes},
                                   {"deferred", b.deferredBytes()}}},
      {"modes", llvm::json::Object{{"deferred", mode(c.deferred)},
                                   {"streaming", mode(c.streaming)}}},
      {"deferred_updates",
       llvm::json::Object{{"update_seconds", c.updateSeconds},
                          {"updates_end_seconds", c.updatesEnd},
                          {"forward_end_seconds", c.forwardEnd},
                          {"block", c.block},
                          {"block_update_seconds", c.blockUpdateSeconds},
                          {"block_forward_seconds", c.blockForwardSeconds}}},
      {"accumulate_seconds", c.accumulateSeconds},
      {"ema_seconds", c.emaSeconds},
      {"optimizer_step_seconds", c.optimizerStepSeconds},
      {"device_accumulation_bytes", c.deviceAccumulationBytes},
      {"device_accumulation_fits", c.deviceAccumulationFits},
      {"advice", std::move(advice)}};
}

llvm::json::Object jobToJson(const PlanReport::Job &job) {
  llvm::json::Array advice;
  for (const std::string &a : job.advice)
    advice.push_back(a);
  return llvm::json::Object{
      {"gpus_per_node", job.gpusPerNode},
      {"nodes", job.nodes},
      {"ranks", job.ranks()},
      {"collective_seconds", job.collectiveSeconds},
      {"collective_bytes_per_rank", job.collectiveBytes},
      {"norm_allreduce_seconds", job.normAllReduceSeconds},
      {"step_seconds_per_rank", job.stepSeconds},
      {"samples_per_second", job.samplesPerSecond},
      {"one_gpu_step_seconds", job.oneGpuStepSeconds},
      {"one_gpu_samples_per_second", job.oneGpuSamplesPerSecond},
      {"scaling_efficiency", job.scalingEfficiency},
      {"host_bytes_per_rank", job.hostPerRankBytes},
      {"host_bytes_per_node", job.hostPerNodeBytes},
      {"nodes_to_fit_host", job.nodesToFitHost},
      {"advice", std::move(advice)}};
}

} // namespace

void megaslide::addToJson(const PlanReport &r, llvm::json::Object &out) {
  auto categories = [](const auto &pairs) {
    llvm::json::Object o;
    for (const auto &[name, bytes] : pairs)
      o[name] = bytes;
    return o;
  };
  llvm::json::Array violations, activation, layers, top, memory, streams;
  for (const std::string &v : r.violations)
    violations.push_back(v);
  for (const std::string &p : r.activationPolicy)
    activation.push_back(p);
  for (const PlanReport::Layer &l : r.layers)
    layers.push_back(
        llvm::json::Object{{"layer", l.index},
                           {"params", l.params},
                           {"host_bytes", l.hostBytes},
                           {"shard_bytes", l.shardBytes},
                           {"device_peak_bytes", l.devicePeak},
                           {"checkpoint_bytes", l.checkpointBytes},
                           {"activation_policy", l.activationPolicy}});
  for (const auto &[bytes, what] : r.topConsumers)
    top.push_back(llvm::json::Object{{"bytes", bytes}, {"what", what}});
  for (const auto &[t, bytes] : r.memoryTimeline)
    memory.push_back(llvm::json::Array{t, bytes});
  for (const PlanReport::Interval &iv : r.streamTimeline)
    streams.push_back(llvm::json::Object{
        {"stream", exec::streamName(static_cast<exec::Stream>(iv.stream))},
        {"start", iv.start},
        {"end", iv.end},
        {"label", iv.label}});
  llvm::json::Object busy;
  int boundBy = 0;
  bool job = r.job.ranks() > 1;
  for (int s = 0; s < exec::kNumStreams; ++s) {
    // A one-GPU plan has no collectives, and its report no comm stream.
    if (s == static_cast<int>(exec::Stream::Comm) && !job)
      continue;
    busy[exec::streamName(static_cast<exec::Stream>(s))] = r.busySeconds[s];
    if (r.busySeconds[s] > r.busySeconds[boundBy])
      boundBy = s;
  }
  const char *boundName = exec::streamName(static_cast<exec::Stream>(boundBy));
  out["fits"] = r.fits();
  out["violations"] = std::move(violations);
  out["budgets"] = llvm::json::Object{{"gpu_bytes", r.gpuBudget},
                                      {"gpu_reserve_bytes", r.gpuReserve},
                                      {"host_bytes", r.hostBudget}};
  out["hardware"] =
      toJson(r.hardware, /*links=*/job, /*nvme=*/!r.tier.roles.empty());
  out["policies"] = llvm::json::Object{{"host_state", r.hostStatePolicy},
                                       {"activation", std::move(activation)}};
  out["host"] =
      llvm::json::Object{{"total_bytes", r.hostTotal},
                         {"bytes_per_param", r.hostBytesPerParam},
                         {"by_category", categories(r.hostByCategory)}};
  out["device"] =
      llvm::json::Object{{"peak_bytes", r.devicePeak},
                         {"by_category", categories(r.deviceByCategory)},
                         {"top_consumers", std::move(top)}};
  out["per_layer"] = std::move(layers);
  out["transfers"] =
      llvm::json::Object{{"h2d_bytes", r.h2dBytes},
                         {"d2h_bytes", r.d2hBytes},
                         {"h2d_by_kind", categories(r.h2dByKind)},
                         {"d2h_by_kind", categories(r.d2hByKind)}};
  llvm::json::Object families;
  for (int f = 0; f < sim::kNumKernelFamilies; ++f) {
    const PlanReport::Family &family = r.byFamily[f];
    if (!family.instructions || f == static_cast<int>(sim::KernelFamily::None))
      continue;
    families[sim::kernelFamilyName(static_cast<sim::KernelFamily>(f))] =
        llvm::json::Object{{"seconds", family.seconds},
                           {"instructions", family.instructions},
                           {"flops", family.flops},
                           {"bytes", family.bytes}};
  }
  llvm::json::Object elementwise;
  for (const auto &[op, seconds] : r.elementwiseByOp)
    elementwise[op] = seconds;
  out["step"] = llvm::json::Object{
      {"predicted_seconds", r.predictedSeconds},
      {"lower_bound_seconds", r.lowerBoundSeconds},
      {"bound_by", boundName},
      {"busy_seconds", std::move(busy)},
      {"device_flops", r.deviceFlops},
      {"recompute_flops", r.recomputeFlops},
      {"model_flops", r.modelFlops()},
      {"peak_flops", r.peakFlops},
      {"mfu", r.mfu()},
      {"by_kernel_family", std::move(families)},
      {"elementwise_by_op", std::move(elementwise)},
      {"gradient_ring",
       llvm::json::Object{{"slots", r.gradientRingSlots},
                          {"slot_bytes", r.gradientRingSlotBytes},
                          {"waiting_instructions", r.issueWaits.instructions},
                          {"wait_seconds", r.issueWaits.seconds}}}};
  out["timeline"] = llvm::json::Object{{"memory", std::move(memory)},
                                       {"streams", std::move(streams)}};
  if (!r.recipe.update.empty())
    out["recipe"] = recipeToJson(r.recipe);
  if (job)
    out["job"] = jobToJson(r.job);
  if (const PlanReport::Tier &tier = r.tier; !tier.roles.empty())
    out["nvme_tier"] =
        llvm::json::Object{{"roles", tier.roles},
                           {"drives", tier.drives},
                           {"window_bytes", tier.windowBytes},
                           {"on_nvme_by_category", categories(tier.onNvme)},
                           {"bytes_read_per_step", tier.bytesPerStep},
                           {"bytes_written_per_step", tier.bytesPerStep},
                           {"io_busy_seconds", tier.ioSeconds},
                           {"step_growth_seconds", tier.stepGrowthSeconds}};
  if (!r.fitOptions.empty()) {
    llvm::json::Array options;
    for (const PlanReport::FitOption &o : r.fitOptions)
      options.push_back(llvm::json::Object{{"change", o.change},
                                           {"what", o.what},
                                           {"fits", o.fits},
                                           {"host_bytes", o.hostBytes},
                                           {"host_budget_bytes", o.hostBudget},
                                           {"step_seconds", o.stepSeconds},
                                           {"note", o.note}});
    out["fit_options"] = std::move(options);
  }
}
