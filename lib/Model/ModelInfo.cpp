//===- ModelInfo.cpp - Parameter, token and FLOP report -------------------===//

#include "megaslide/Model/ModelInfo.h"

#include "megaslide/Support/Units.h"

#include "dialects/Schedule/SchedulePolicies.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/FormatVariadic.h"

#include <chrono>

using namespace mlir;
using namespace megaslide;
using namespace megaslide::graph;

ModelInfo megaslide::analyzeTrainingStep(ModuleOp module) {
  ModelInfo info;
  info.hostStateBytes.assign(schedule::hostStatePolicies().size(), 0);
  for (auto param : module.getOps<ParamOp>()) {
    if (param.getRole() != ParamRole::master &&
        param.getRole() != ParamRole::frozen)
      continue;
    uint64_t n = param.getNumElements();
    for (schedule::HostStatePolicy p : schedule::hostStatePolicies())
      info.hostStateBytes[static_cast<unsigned>(p)] +=
          param.getRole() == ParamRole::frozen
              ? 4 * n
              : schedule::trainableStateBytes(p,
                                              param.getTensorType().getShape());
    info.totalParams += n;
    (param.getRole() == ParamRole::frozen ? info.frozenParams
                                          : info.trainableParams) += n;
    switch (param.getGroup()) {
    case ParamGroup::embeddings:
      info.embeddingParams += n;
      break;
    case ParamGroup::head:
      info.headParams += n;
      break;
    case ParamGroup::blocks: {
      info.blockParams += n;
      uint64_t layer = param.getLayerAttr().getInt();
      if (info.perBlock.size() <= layer)
        info.perBlock.resize(layer + 1);
      info.perBlock[layer] += n;
      if (layer == 0) {
        // "blocks.0.attn1.to_q.weight" -> "attn1".
        StringRef sub = param.getSymName().split('.').second.split('.').second;
        sub = sub.split('.').first;
        auto it = llvm::find_if(info.blockBreakdown,
                                [&](auto &e) { return e.first == sub; });
        if (it == info.blockBreakdown.end())
          info.blockBreakdown.emplace_back(sub.str(), n);
        else
          it->second += n;
      }
      break;
    }
    }
  }
  // Everything after the loss is backward work, including helpers that
  // are not gradient ops themselves (accumulating adds, inverse RoPE).
  bool afterLoss = false;
  module.walk([&](Operation *op) {
    ++info.numOps;
    auto counted = dyn_cast<FlopCountOpInterface>(op);
    if (counted) {
      FlopCount c = counted.getFlopCount();
      if (isa<AdamWOp>(op))
        info.optimizerFlops += c.total();
      else if (afterLoss)
        info.backward += c;
      else
        info.forward += c;
    }
    afterLoss |= isa<FlowMatchingLossOp>(op);
  });
  return info;
}

llvm::Expected<ModelInfo> megaslide::computeModelInfo(
    MLIRContext &context, StringRef model, const VideoShape &video,
    const TrainingOptions &options, OwningOpRef<ModuleOp> *moduleOut) {
  llvm::Expected<ModelConfig> config = loadModelConfig(model);
  if (!config)
    return config.takeError();
  llvm::Expected<Geometry> geometry = computeGeometry(*config, video);
  if (!geometry)
    return geometry.takeError();
  auto start = std::chrono::steady_clock::now();
  auto module = buildTrainingStep(context, *config, *geometry, options);
  if (!module)
    return module.takeError();
  ModelInfo info = analyzeTrainingStep(**module);
  info.buildSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  info.config = *config;
  info.video = video;
  info.geometry = *geometry;
  info.options = options;
  info.options.textLen = options.textLen.value_or(config->textLen);
  if (moduleOut)
    *moduleOut = std::move(*module);
  return info;
}

namespace {

const char *architectureName(Architecture a) {
  return a == Architecture::Wan ? "wan" : "dit";
}

llvm::json::Object flopObject(const FlopCount &c) {
  return llvm::json::Object{{"matmul", c.matmul},
                            {"attention", c.attention},
                            {"other", c.other},
                            {"total", c.total()}};
}

llvm::json::Array tripleArray(const std::array<int64_t, 3> &t) {
  return llvm::json::Array{t[0], t[1], t[2]};
}

/// 105968119872 -> "105,968,119,872".
std::string grouped(uint64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0)
      out += ',';
    out += digits[i];
  }
  return out;
}

std::string flops(uint64_t f) {
  return llvm::formatv("{0:E3}", double(f)).str();
}

} // namespace

llvm::json::Value megaslide::toJson(const ModelInfo &info) {
  const ModelConfig &c = info.config;
  llvm::json::Array perBlock;
  for (uint64_t n : info.perBlock)
    perBlock.push_back(n);
  llvm::json::Object breakdown;
  for (const auto &[name, n] : info.blockBreakdown)
    breakdown[name] = n;
  llvm::json::Array policies;
  for (schedule::HostStatePolicy p : schedule::hostStatePolicies())
    policies.push_back(llvm::json::Object{
        {"name", schedule::stringifyEnum(p)},
        {"description", schedule::describe(p)},
        {"bytes_per_param", schedule::bytesPerParam(p)},
        {"bytes", info.hostStateBytes[static_cast<unsigned>(p)]}});
  FlopCount total = info.forward;
  total += info.backward;
  return llvm::json::Object{
      {"schema_version", kInfoSchemaVersion},
      {"model",
       llvm::json::Object{{"name", c.name},
                          {"architecture", architectureName(c.architecture)},
                          {"num_layers", c.numLayers},
                          {"dim", c.dim()},
                          {"num_heads", c.numHeads},
                          {"head_dim", c.headDim},
                          {"ffn_dim", c.ffnDim},
                          {"in_channels", c.inChannels},
                          {"out_channels", c.outChannels},
                          {"patch_size", tripleArray(c.patch)}}},
      {"video", llvm::json::Object{{"frames", info.video.frames},
                                   {"height", info.video.height},
                                   {"width", info.video.width},
                                   {"units", info.video.latentUnits ? "latent"
                                                                    : "pixels"},
                                   {"batch", info.options.batch},
                                   {"text_len", *info.options.textLen},
                                   {"precision", computeTypeName(
                                                     info.options.computeType)}}},
      {"latent",
       llvm::json::Object{{"shape", tripleArray(info.geometry.latent)},
                          {"vae_stride", tripleArray(c.vaeStride)}}},
      {"grid", tripleArray(info.geometry.grid)},
      {"tokens", info.geometry.tokens()},
      {"params",
       llvm::json::Object{
           {"total", info.totalParams},
           {"trainable", info.trainableParams},
           {"frozen", info.frozenParams},
           {"by_category",
            llvm::json::Object{{"embeddings", info.embeddingParams},
                               {"blocks", info.blockParams},
                               {"head", info.headParams}}},
           {"per_block", std::move(perBlock)},
           {"block_breakdown", std::move(breakdown)}}},
      {"flops",
       llvm::json::Object{
           {"convention", "1 multiply-add = 2 FLOPs; per training step"},
           {"forward", info.forward.total()},
           {"backward", info.backward.total()},
           {"optimizer", info.optimizerFlops},
           {"total", total.total() + info.optimizerFlops},
           {"forward_by_kind", flopObject(info.forward)},
           {"backward_by_kind", flopObject(info.backward)}}},
      {"memory",
       llvm::json::Object{{"bf16_weights_bytes", 2 * info.totalParams},
                          {"fp32_master_bytes", 4 * info.trainableParams},
                          {"adamw_moments_bytes", 8 * info.trainableParams},
                          {"frozen_bytes", 4 * info.frozenParams},
                          {"host_state_policies", std::move(policies)}}},
      {"ir", llvm::json::Object{{"ops", info.numOps},
                                {"build_seconds", info.buildSeconds}}},
  };
}

void megaslide::printText(const ModelInfo &info, llvm::raw_ostream &os) {
  const ModelConfig &c = info.config;
  const auto &l = info.geometry.latent, &g = info.geometry.grid;
  os << llvm::formatv("MegaSlide model report: {0} ({1}), {2} layers, dim {3}, "
                      "{4} heads x {5}, ffn {6}\n",
                      c.name, architectureName(c.architecture), c.numLayers,
                      c.dim(), c.numHeads, c.headDim, c.ffnDim);
  os << llvm::formatv("Video: {0} frames x {1} x {2} {3}, batch {4}",
                      info.video.frames, info.video.height, info.video.width,
                      info.video.latentUnits ? "latent elements" : "pixels",
                      info.options.batch);
  if (c.architecture == Architecture::Wan)
    os << llvm::formatv(", {0} text tokens", *info.options.textLen);
  os << llvm::formatv(", {0} compute",
                      computeTypeName(info.options.computeType));
  os << llvm::formatv("\n  latents {0} x {1} x {2} (VAE stride {3}x{4}x{5}), "
                      "patch {6}x{7}x{8}\n",
                      l[0], l[1], l[2], c.vaeStride[0], c.vaeStride[1],
                      c.vaeStride[2], c.patch[0], c.patch[1], c.patch[2]);
  os << llvm::formatv("  tokens {0} x {1} x {2} = {3} per sample\n\n", g[0],
                      g[1], g[2], grouped(info.geometry.tokens()));

  os << "Parameters (derived from the built IR)\n";
  os << llvm::formatv("  {0,-12} {1,20}\n", "embeddings",
                      grouped(info.embeddingParams));
  os << llvm::formatv("  {0,-12} {1,20}  ({2} blocks of {3})\n", "blocks",
                      grouped(info.blockParams), info.perBlock.size(),
                      grouped(info.perBlock.empty() ? 0 : info.perBlock[0]));
  os << llvm::formatv("  {0,-12} {1,20}\n", "head", grouped(info.headParams));
  os << llvm::formatv("  {0,-12} {1,20}  ({2:F2} B", "total",
                      grouped(info.totalParams), info.totalParams / 1e9);
  if (info.frozenParams)
    os << llvm::formatv("; {0} frozen", grouped(info.frozenParams));
  os << ")\n  per block:";
  for (const auto &[name, n] : info.blockBreakdown)
    os << " " << name << " " << grouped(n) << ";";
  os << "\n\n";

  os << "FLOPs per training step (1 multiply-add = 2 FLOPs)\n";
  os << llvm::formatv("  {0,-10} {1,12} {2,12} {3,12} {4,12}\n", "", "matmul",
                      "attention", "other", "total");
  for (auto [name, f] :
       {std::pair<const char *, const FlopCount *>{"forward", &info.forward},
        {"backward", &info.backward}})
    os << llvm::formatv("  {0,-10} {1,12} {2,12} {3,12} {4,12}\n", name,
                        flops(f->matmul), flops(f->attention), flops(f->other),
                        flops(f->total()));
  os << llvm::formatv("  {0,-10} {1,51}\n", "AdamW",
                      flops(info.optimizerFlops));
  os << llvm::formatv("  {0,-10} {1,51}\n\n", "step",
                      flops(info.forward.total() + info.backward.total() +
                            info.optimizerFlops));

  os << "Host memory for model state (GB = 10^9 B, GiB = 2^30 B)\n";
  os << llvm::formatv("  bf16 weights         {0}\n",
                      formatBytes(2 * info.totalParams));
  os << llvm::formatv("  fp32 master          {0}\n",
                      formatBytes(4 * info.trainableParams));
  os << llvm::formatv("  AdamW m + v (fp32)   {0}\n",
                      formatBytes(8 * info.trainableParams));
  for (schedule::HostStatePolicy p : schedule::hostStatePolicies())
    os << llvm::formatv(
        "  {0,2} B/param: {1,-40} {2}\n", schedule::bytesPerParam(p),
        schedule::describe(p),
        formatBytes(info.hostStateBytes[static_cast<unsigned>(p)]));
  os << llvm::formatv("\nBuilt and analysed {0} ops in {1:F2} s.\n",
                      grouped(info.numOps), info.buildSeconds);
}
