//===- ModelBuilder.cpp - Training-step IR from a model config ------------===//
//
// Emits the forward of DiT / Wan blocks with the exact parameter names and
// shapes of their reference implementations (diffusers'
// WanTransformer3DModel: Wan 2.1 T2V, I2V and FLF2V, Wan 2.2 A14B and
// TI2V; facebookresearch/DiT), then differentiates it and appends an AdamW
// update per parameter.
//
// Precision: persistent state is fp32 (master, moments); compute runs on
// working copies cast from the masters, bf16 by default (so gradients are
// bf16 and are cast to fp32 inside the AdamW update) or fp32 with
// `TrainingOptions::computeType`. The fp32 working copy is still a cast
// (an identity one) so that both precisions have the same structure: the
// pipeline turns each load + cast into one fetch of the working copy.
//
//===----------------------------------------------------------------------===//

#include "megaslide/Model/ModelBuilder.h"

#include "dialects/Graph/GraphAutodiff.h"
#include "dialects/Graph/GraphOps.h"
#include "megaslide/runtime/plan/ExecPlan.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Verifier.h"
#include "llvm/ADT/Twine.h"

using namespace mlir;
using namespace megaslide;
using namespace megaslide::graph;

namespace {

/// Tags every op inserted while a block is being built with its index.
struct LayerTagger : OpBuilder::Listener {
  const std::optional<int64_t> *layer = nullptr;
  void notifyOperationInserted(Operation *op, OpBuilder::InsertPoint) override {
    if (*layer)
      op->setAttr(
          kLayerAttrName,
          IntegerAttr::get(IntegerType::get(op->getContext(), 64), **layer));
  }
};

class TrainingStepBuilder {
public:
  TrainingStepBuilder(MLIRContext &ctx, const ModelConfig &config,
                      const Geometry &geometry, const TrainingOptions &options)
      : ctx(ctx), config(config), geometry(geometry), options(options),
        loc(UnknownLoc::get(&ctx)), b(&ctx), decl(&ctx),
        f32(Float32Type::get(&ctx)) {
    compute = options.computeType == ComputeType::F32
                  ? f32
                  : Type(BFloat16Type::get(&ctx));
    batch = options.batch;
    dim = config.dim();
    tokens = geometry.tokens();
    textLen = options.textLen.value_or(config.textLen);
    if (config.firstFrameConditioning)
      cleanTokens = geometry.grid[1] * geometry.grid[2];
    tagger.layer = &layer;
    b.setListener(&tagger);
  }

  llvm::Expected<OwningOpRef<ModuleOp>> build();

private:
  // Types and shape helpers.
  RankedTensorType act(ArrayRef<int64_t> shape) {
    return RankedTensorType::get(shape, compute);
  }
  static ArrayRef<int64_t> shapeOf(Value v) {
    return cast<RankedTensorType>(v.getType()).getShape();
  }
  RankedTensorType withLast(Value v, int64_t last) {
    SmallVector<int64_t> s(shapeOf(v));
    s.back() = last;
    return act(s);
  }

  /// Declares a parameter named `name` in the current group and returns
  /// its working copy (of the compute type).
  Value param(const Twine &name, ArrayRef<int64_t> shape, bool frozen = false);

  // Layers with reference-implementation parameter names.
  Value linear(const Twine &name, Value x, int64_t out, bool bias = true);
  /// `eps`: the config's unless given.
  Value layerNorm(Value x, const Twine &affineName = Twine(),
                  std::optional<double> eps = std::nullopt);
  Value rmsNorm(const Twine &name, Value x);
  Value reshape(Value x, ArrayRef<int64_t> shape) {
    return ReshapeOp::create(b, loc, act(shape), x);
  }
  SmallVector<Value> split(Value x, int64_t n) {
    SmallVector<Type> types(n, withLast(x, shapeOf(x).back() / n));
    return SplitOp::create(b, loc, types, x).getResults();
  }
  Value heads(Value x) {
    int64_t n = shapeOf(x)[1];
    return reshape(x, {batch, n, config.numHeads, config.headDim});
  }
  Value merge(Value x) { return reshape(x, {batch, shapeOf(x)[1], dim}); }
  Value attention(Value q, Value k, Value v) {
    return AttentionOp::create(b, loc, q.getType(), q, k, v, FloatAttr());
  }
  Value rope(Value x);
  Value modulate(Value x, Value shift, Value scale) {
    return ModulateOp::create(b, loc, x.getType(), x, shift, scale);
  }
  Value gate(Value x, Value g) {
    return GateOp::create(b, loc, x.getType(), x, g);
  }
  Value add(Value x, Value y) { return AddOp::create(b, loc, x, y); }
  Value gelu(Value x) { return GeluOp::create(b, loc, x); }
  Value geluExact(Value x) {
    return GeluOp::create(b, loc, x.getType(), x, /*exact=*/true);
  }
  Value silu(Value x) { return SiluOp::create(b, loc, x); }
  Value timestepEmbedding(Value t) {
    return TimestepEmbeddingOp::create(
        b, loc, act({shapeOf(t)[0], config.freqDim}), t,
        b.getF64FloatAttr(10000.0), b.getF64FloatAttr(1000.0));
  }

  // Wan 2.2 TI2V image-to-video (config.firstFrameConditioning): the
  // tokens of the first latent frame, the first cleanTokens of a sample
  // (patch_size[0] is 1), have time 0; the rest the sample's time.
  /// [B, N, W] -> the first cleanTokens tokens and the others.
  std::pair<Value, Value> splitTokens(Value x);
  Value joinTokens(Value head, Value tail);
  /// Rows [2B, W] -> the first B and the last B.
  std::pair<Value, Value> splitRows(Value x);
  /// fn on the clean tokens with the clean modulation, on the others with
  /// the sample's; fn alone without clean tokens.
  Value byToken(Value x, llvm::function_ref<Value(Value, bool)> fn);
  Value patchify(Value latents) {
    int64_t width = config.patchVolume() * shapeOf(latents)[1];
    return PatchifyOp::create(b, loc, act({batch, tokens, width}), latents,
                              b.getDenseI64ArrayAttr(config.patch));
  }
  /// Latents [B, C, T, H, W] without their first frame.
  Value laterFrames(Value latents) {
    return unpatchify(splitTokens(patchify(latents)).second, /*later=*/true);
  }

  /// Patch-embeds `xt` with a conv weight of diffusers shape `weightShape`.
  Value patchEmbed(const Twine &prefix, Value xt,
                   ArrayRef<int64_t> weightShape);
  /// `later`: the tokens of the frames after the first only.
  Value unpatchify(Value tokens, bool later = false);

  // Architectures: return the velocity prediction [B, Cout, T, H, W].
  /// `image`: the image embedder's tokens (Value() without image
  /// conditioning); `imageCondition` the mask and conditioning latents.
  Value wanForward(Value xt, Value t, Value text, Value image,
                   Value imageCondition);
  Value wanAttention(const Twine &prefix, Value h, Value context,
                     Value image = Value());
  Value imageEmbedder(Value image);
  Value ditForward(Value xt, Value t, Value labels);

  void emitOptimizer(ArrayRef<Value> grads, Value step);

  MLIRContext &ctx;
  const ModelConfig &config;
  const Geometry &geometry;
  const TrainingOptions &options;
  Location loc;
  OpBuilder b;    ///< inside @train_step
  OpBuilder decl; ///< module level, before @train_step
  Type f32;
  Type compute; ///< activations, working copies and gradients
  int64_t batch, dim, tokens, textLen;
  int64_t cleanTokens = 0; ///< see splitTokens

  ParamGroup group = ParamGroup::embeddings;
  std::optional<int64_t> layer;
  LayerTagger tagger;
  struct Trainable {
    ParamOp master;
    Value masterValue; ///< fp32, loaded once
    Value working;     ///< copy of the compute type used by compute
  };
  SmallVector<Trainable> trainables;
};

Value TrainingStepBuilder::param(const Twine &name, ArrayRef<int64_t> shape,
                                 bool frozen) {
  auto type = RankedTensorType::get(shape, f32);
  std::string symbol = name.str();
  auto decl_ = ParamOp::create(
      decl, loc, symbol, frozen ? ParamRole::frozen : ParamRole::master, group,
      layer ? decl.getI64IntegerAttr(*layer) : IntegerAttr(),
      FlatSymbolRefAttr(), type);
  Value master = LoadOp::create(b, loc, type, symbol);
  Value working = CastOp::create(b, loc, act(shape), master);
  if (!frozen)
    trainables.push_back({decl_, master, working});
  return working;
}

Value TrainingStepBuilder::linear(const Twine &name, Value x, int64_t out,
                                  bool bias) {
  int64_t in = shapeOf(x).back();
  Value w = param(name + ".weight", {out, in});
  Value bv = bias ? param(name + ".bias", {out}) : Value();
  return LinearOp::create(b, loc, withLast(x, out), x, w, bv);
}

Value TrainingStepBuilder::layerNorm(Value x, const Twine &affineName,
                                     std::optional<double> eps) {
  SmallVector<Value> affine;
  if (!affineName.isTriviallyEmpty()) {
    int64_t d = shapeOf(x).back();
    affine.push_back(param(affineName + ".weight", {d}));
    affine.push_back(param(affineName + ".bias", {d}));
  }
  return LayerNormOp::create(b, loc, x.getType(), x, affine,
                             b.getF64FloatAttr(eps.value_or(config.eps)));
}

Value TrainingStepBuilder::rmsNorm(const Twine &name, Value x) {
  Value g = param(name + ".weight", {shapeOf(x).back()});
  return RMSNormOp::create(b, loc, x.getType(), x, g,
                           b.getF64FloatAttr(config.eps));
}

Value TrainingStepBuilder::rope(Value x) {
  // Wan 2.1's split of the head dim between t, y and x.
  int64_t spatial = 2 * (config.headDim / 6);
  int64_t temporal = config.headDim - 2 * spatial;
  return Rope3dOp::create(b, loc, x, b.getDenseI64ArrayAttr(geometry.grid),
                          b.getDenseI64ArrayAttr({temporal, spatial, spatial}),
                          b.getF64FloatAttr(config.ropeTheta), UnitAttr());
}

Value TrainingStepBuilder::patchEmbed(const Twine &prefix, Value xt,
                                      ArrayRef<int64_t> weightShape) {
  Value w = param(prefix + ".weight", weightShape);
  SmallVector<int64_t> conv5d = {dim, shapeOf(xt)[1], config.patch[0],
                                 config.patch[1], config.patch[2]};
  if (weightShape.size() != 5)
    w = reshape(w, conv5d);
  Value bias = param(prefix + ".bias", {dim});
  return PatchEmbedOp::create(b, loc, act({batch, tokens, dim}), xt, w, bias);
}

Value TrainingStepBuilder::unpatchify(Value x, bool later) {
  std::array<int64_t, 3> l = geometry.latent, grid = geometry.grid;
  if (later) {
    l[0] -= 1; // a temporal patch of 1: one token frame per latent frame
    grid[0] -= 1;
  }
  int64_t channels = shapeOf(x).back() / config.patchVolume();
  return UnpatchifyOp::create(b, loc, act({batch, channels, l[0], l[1], l[2]}),
                              x, b.getDenseI64ArrayAttr(grid),
                              b.getDenseI64ArrayAttr(config.patch));
}

std::pair<Value, Value> TrainingStepBuilder::splitTokens(Value x) {
  int64_t n = shapeOf(x)[1], width = shapeOf(x)[2];
  Value flat = reshape(x, {batch, n * width});
  auto parts =
      SplitOp::create(b, loc,
                      TypeRange{act({batch, cleanTokens * width}),
                                act({batch, (n - cleanTokens) * width})},
                      flat);
  return {reshape(parts.getResult(0), {batch, cleanTokens, width}),
          reshape(parts.getResult(1), {batch, n - cleanTokens, width})};
}

Value TrainingStepBuilder::joinTokens(Value head, Value tail) {
  int64_t width = shapeOf(head)[2];
  int64_t n = shapeOf(head)[1] + shapeOf(tail)[1];
  Value flat = ConcatOp::create(
      b, loc, act({batch, n * width}),
      ValueRange{reshape(head, {batch, shapeOf(head)[1] * width}),
                 reshape(tail, {batch, shapeOf(tail)[1] * width})});
  return reshape(flat, {batch, n, width});
}

std::pair<Value, Value> TrainingStepBuilder::splitRows(Value x) {
  int64_t width = shapeOf(x)[1];
  SmallVector<Value> halves = split(reshape(x, {1, 2 * batch * width}), 2);
  return {reshape(halves[0], {batch, width}),
          reshape(halves[1], {batch, width})};
}

Value TrainingStepBuilder::byToken(Value x,
                                   llvm::function_ref<Value(Value, bool)> fn) {
  if (!cleanTokens)
    return fn(x, false);
  auto [head, tail] = splitTokens(x);
  return joinTokens(fn(head, true), fn(tail, false));
}

Value TrainingStepBuilder::wanAttention(const Twine &prefix, Value h,
                                        Value context, Value image) {
  Value kv = context ? context : h;
  Value q = linear(prefix + ".to_q", h, dim);
  Value k = linear(prefix + ".to_k", kv, dim);
  Value v = linear(prefix + ".to_v", kv, dim);
  if (config.qkNorm) {
    q = rmsNorm(prefix + ".norm_q", q);
    k = rmsNorm(prefix + ".norm_k", k);
  }
  q = heads(q);
  k = heads(k);
  v = heads(v);
  if (!context) {
    q = rope(q);
    k = rope(k);
  }
  Value o = attention(q, k, v);
  if (image) {
    // diffusers' WanAttnProcessor: the same queries attend to the image
    // tokens through their own keys (always RMS-normed) and values; the
    // two results are summed before the output projection.
    Value ki = rmsNorm(prefix + ".norm_added_k",
                       linear(prefix + ".add_k_proj", image, dim));
    Value vi = linear(prefix + ".add_v_proj", image, dim);
    o = add(o, attention(q, heads(ki), heads(vi)));
  }
  return linear(prefix + ".to_out.0", merge(o), dim);
}

Value TrainingStepBuilder::imageEmbedder(Value image) {
  // diffusers' WanImageEmbedding: [position embedding], LayerNorm,
  // FeedForward (Linear, exact GELU, Linear), LayerNorm; its
  // FP32LayerNorms keep nn.LayerNorm's eps of 1e-5.
  constexpr double kEps = 1e-5;
  const char *p = "condition_embedder.image_embedder";
  if (config.imagePosEmbed) {
    Value pos = reshape(
        param(Twine(p) + ".pos_embed", {1, config.imageLen, config.imageDim}),
        {config.imageLen, config.imageDim});
    image = BiasAddOp::create(b, loc, image.getType(), image, pos);
  }
  Value h = layerNorm(image, Twine(p) + ".norm1", kEps);
  h = linear(Twine(p) + ".ff.net.0.proj", h, config.imageDim);
  h = linear(Twine(p) + ".ff.net.2", geluExact(h), dim);
  return layerNorm(h, Twine(p) + ".norm2", kEps);
}

Value TrainingStepBuilder::wanForward(Value xt, Value t, Value text,
                                      Value image, Value imageCondition) {
  // diffusers WanTransformer3DModel.
  if (imageCondition) {
    // torch.cat([latents, condition], dim=1): the channels of a sample are
    // contiguous, so it is a concat of the last dimension of [B, C*T*H*W].
    auto flat = [&](Value v) {
      ArrayRef<int64_t> s = shapeOf(v);
      return reshape(v, {batch, s[1] * s[2] * s[3] * s[4]});
    };
    SmallVector<int64_t> whole(shapeOf(xt));
    whole[1] = config.inChannels;
    Value both = ConcatOp::create(
        b, loc, act({batch, whole[1] * whole[2] * whole[3] * whole[4]}),
        ValueRange{flat(xt), flat(imageCondition)});
    xt = reshape(both, whole);
  }
  Value x = patchEmbed("patch_embedding", xt,
                       {dim, config.inChannels, config.patch[0],
                        config.patch[1], config.patch[2]});
  // With clean tokens, the embedding of time 0 too, rows after the batch's
  // (one pass through the time embedder's layers).
  if (cleanTokens)
    t = ConcatOp::create(b, loc, RankedTensorType::get({2 * batch}, f32),
                         ValueRange{t, ZerosOp::create(b, loc, t.getType())});
  Value temb = linear("condition_embedder.time_embedder.linear_2",
                      silu(linear("condition_embedder.time_embedder.linear_1",
                                  timestepEmbedding(t), dim)),
                      dim);
  Value timestepProj =
      linear("condition_embedder.time_proj", silu(temb), 6 * dim);
  Value temb0, timestepProj0; // of time 0
  if (cleanTokens) {
    std::tie(temb, temb0) = splitRows(temb);
    std::tie(timestepProj, timestepProj0) = splitRows(timestepProj);
  }
  Value context = linear(
      "condition_embedder.text_embedder.linear_2",
      gelu(linear("condition_embedder.text_embedder.linear_1", text, dim)),
      dim);
  if (image)
    image = imageEmbedder(image);

  group = ParamGroup::blocks;
  for (int64_t i = 0; i < config.numLayers; ++i) {
    layer = i;
    std::string p = "blocks." + std::to_string(i);
    Value table =
        reshape(param(p + ".scale_shift_table", {1, 6, dim}), {6 * dim});
    auto modulationOf = [&](Value proj) {
      return split(BiasAddOp::create(b, loc, proj.getType(), proj, table), 6);
    };
    // m: shift, scale, gate (self-attention); shift, scale, gate (FFN).
    SmallVector<Value> m = modulationOf(timestepProj);
    SmallVector<Value> m0 = cleanTokens ? modulationOf(timestepProj0) : m;
    auto modulated = [&](Value v, int shift, int scale) {
      return byToken(v, [&](Value part, bool clean) {
        const SmallVector<Value> &mm = clean ? m0 : m;
        return modulate(part, mm[shift], mm[scale]);
      });
    };
    auto gated = [&](Value v, int g) {
      return byToken(v, [&](Value part, bool clean) {
        return gate(part, (clean ? m0 : m)[g]);
      });
    };
    Value h = modulated(layerNorm(x), 0, 1);
    x = add(x, gated(wanAttention(p + ".attn1", h, Value()), 2));
    h = config.crossAttnNorm ? layerNorm(x, p + ".norm2") : x;
    x = add(x, wanAttention(p + ".attn2", h, context, image));
    h = modulated(layerNorm(x), 3, 4);
    Value ffn =
        linear(p + ".ffn.net.2",
               gelu(linear(p + ".ffn.net.0.proj", h, config.ffnDim)), dim);
    x = add(x, gated(ffn, 5));
  }
  layer.reset();

  group = ParamGroup::head;
  SmallVector<Value> rows =
      split(reshape(param("scale_shift_table", {1, 2, dim}), {2 * dim}), 2);
  auto shiftScale = [&](Value e) {
    // In this order: a pair's arguments are evaluated in any order.
    Value shift = BiasAddOp::create(b, loc, e.getType(), e, rows[0]);
    Value scale = BiasAddOp::create(b, loc, e.getType(), e, rows[1]);
    return std::make_pair(shift, scale);
  };
  // Not structured bindings: C++17 lambdas cannot capture them.
  std::pair<Value, Value> ss = shiftScale(temb);
  std::pair<Value, Value> ss0 = cleanTokens ? shiftScale(temb0) : ss;
  Value shift = ss.first, scale = ss.second;
  Value shift0 = ss0.first, scale0 = ss0.second;
  Value h = byToken(layerNorm(x), [&](Value part, bool clean) {
    return clean ? modulate(part, shift0, scale0)
                 : modulate(part, shift, scale);
  });
  Value out = linear("proj_out", h, config.patchVolume() * config.outChannels);
  // The clean frame's prediction is not trained: the loss reads the rest.
  if (cleanTokens)
    return unpatchify(splitTokens(out).second, /*later=*/true);
  return unpatchify(out);
}

Value TrainingStepBuilder::ditForward(Value xt, Value t, Value labels) {
  // facebookresearch/DiT models.py: DiT.
  Value x =
      patchEmbed("x_embedder.proj", xt,
                 {dim, config.inChannels, config.patch[1], config.patch[2]});
  // Fixed 2D sin-cos table, stored as a frozen parameter as in the
  // reference (nn.Parameter with requires_grad=False).
  Value pos = reshape(param("pos_embed", {1, tokens, dim}, /*frozen=*/true),
                      {tokens, dim});
  x = BiasAddOp::create(b, loc, x.getType(), x, pos);
  Value temb =
      linear("t_embedder.mlp.2",
             silu(linear("t_embedder.mlp.0", timestepEmbedding(t), dim)), dim);
  int64_t rows = config.numClasses + (config.classDropout ? 1 : 0);
  Value table = param("y_embedder.embedding_table.weight", {rows, dim});
  Value yemb = EmbeddingOp::create(b, loc, act({batch, dim}), labels, table);
  Value c = silu(add(temb, yemb));

  group = ParamGroup::blocks;
  for (int64_t i = 0; i < config.numLayers; ++i) {
    layer = i;
    std::string p = "blocks." + std::to_string(i);
    SmallVector<Value> m =
        split(linear(p + ".adaLN_modulation.1", c, 6 * dim), 6);
    Value h = modulate(layerNorm(x), m[0], m[1]);
    SmallVector<Value> qkv = split(linear(p + ".attn.qkv", h, 3 * dim), 3);
    Value o = attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]));
    x = add(x, gate(linear(p + ".attn.proj", merge(o), dim), m[2]));
    h = modulate(layerNorm(x), m[3], m[4]);
    Value mlp = linear(p + ".mlp.fc2",
                       gelu(linear(p + ".mlp.fc1", h, config.ffnDim)), dim);
    x = add(x, gate(mlp, m[5]));
  }
  layer.reset();

  group = ParamGroup::head;
  SmallVector<Value> m =
      split(linear("final_layer.adaLN_modulation.1", c, 2 * dim), 2);
  Value h = modulate(layerNorm(x), m[0], m[1]);
  return unpatchify(linear("final_layer.linear", h,
                           config.patchVolume() * config.outChannels));
}

void TrainingStepBuilder::emitOptimizer(ArrayRef<Value> grads, Value step) {
  // Last layers first: their gradients are ready first.
  for (int64_t i = trainables.size() - 1; i >= 0; --i) {
    Trainable &t = trainables[i];
    ParamOp master = t.master;
    layer.reset();
    if (IntegerAttr l = master.getLayerAttr())
      layer = l.getInt();
    auto type = master.getTensorType();
    auto symbol = FlatSymbolRefAttr::get(master.getSymNameAttr());
    SmallVector<Value> moments;
    for (StringRef suffix : {".exp_avg", ".exp_avg_sq"}) {
      std::string name = (master.getSymName() + suffix).str();
      ParamOp::create(decl, loc, name, ParamRole::moment, master.getGroup(),
                      master.getLayerAttr(), symbol, type);
      moments.push_back(LoadOp::create(b, loc, type, name));
    }
    auto update = AdamWOp::create(
        b, loc, t.masterValue, grads[i], moments[0], moments[1], step,
        b.getF64FloatAttr(options.learningRate > 0
                              ? options.learningRate
                              : config.learningRate.value_or(exec::kDefaultLr)),
        b.getF64FloatAttr(options.beta1), b.getF64FloatAttr(options.beta2),
        b.getF64FloatAttr(options.adamEps),
        b.getF64FloatAttr(options.weightDecay));
    StoreOp::create(b, loc, update.getNewParam(), symbol);
    StoreOp::create(b, loc, update.getNewM(),
                    master.getSymName().str() + ".exp_avg");
    StoreOp::create(b, loc, update.getNewV(),
                    master.getSymName().str() + ".exp_avg_sq");
  }
  layer.reset();
}

llvm::Expected<OwningOpRef<ModuleOp>> TrainingStepBuilder::build() {
  ctx.loadDialect<GraphDialect, func::FuncDialect>();
  OwningOpRef<ModuleOp> module = ModuleOp::create(loc);
  module->setSymNameAttr(StringAttr::get(&ctx, config.name));

  const auto &l = geometry.latent;
  auto latents = act({batch, config.latentChannels(), l[0], l[1], l[2]});
  auto timesteps = RankedTensorType::get({batch}, f32);
  Type condition =
      config.architecture == Architecture::Wan
          ? Type(act({batch, textLen, config.textDim}))
          : Type(RankedTensorType::get({batch}, IntegerType::get(&ctx, 64)));
  auto stepType = RankedTensorType::get({}, IntegerType::get(&ctx, 64));
  auto lossType = RankedTensorType::get({}, f32);
  SmallVector<std::pair<StringRef, Type>> args = {{"latents", latents},
                                                  {"noise", latents},
                                                  {"timesteps", timesteps},
                                                  {"condition", condition}};
  // Image conditioning: the CLIP embeddings of the conditioning frames,
  // and the mask and latents that go beside the noisy latents.
  if (config.imageDim)
    args.push_back(
        {"image_embeds", act({batch, config.imageLen, config.imageDim})});
  if (config.imageConditionChannels())
    args.push_back(
        {"image_condition",
         act({batch, config.imageConditionChannels(), l[0], l[1], l[2]})});
  // A weighted loss: one weight per sample (docs/Training.md, "Loss
  // weighting"), and the unweighted loss returned after the loss.
  if (options.weightedLoss)
    args.push_back({exec::kLossWeightsInput, timesteps});
  args.push_back({"step", stepType});
  SmallVector<Type> argTypes;
  for (auto &[name, type] : args)
    argTypes.push_back(type);
  SmallVector<Type> results = {lossType};
  if (options.weightedLoss)
    results.push_back(lossType);
  auto fnType = FunctionType::get(&ctx, argTypes, results);

  OpBuilder top(module->getBodyRegion());
  auto fn = func::FuncOp::create(top, loc, kTrainStepName, fnType);
  for (auto [i, arg] : llvm::enumerate(args))
    fn.setArgAttr(i, "megaslide.name", top.getStringAttr(arg.first));
  Block *body = fn.addEntryBlock();
  b.setInsertionPointToEnd(body);
  decl.setInsertionPoint(fn);

  Value x0 = body->getArgument(0), noise = body->getArgument(1);
  Value t = body->getArgument(2), cond = body->getArgument(3);
  auto argNamed = [&](StringRef name) {
    for (auto [i, arg] : llvm::enumerate(args))
      if (arg.first == name)
        return body->getArgument(i);
    return BlockArgument();
  };
  Value image = argNamed("image_embeds");
  Value imageCondition = argNamed("image_condition");
  Value weights = argNamed(exec::kLossWeightsInput);
  Value xt = FlowInterpolateOp::create(b, loc, latents, x0, noise, t);
  if (cleanTokens) {
    // WanImageToVideoPipeline with expand_timesteps: the first latent
    // frame is the clean image's, the others are noised.
    Value clean = splitTokens(patchify(x0)).first;
    xt = unpatchify(joinTokens(clean, splitTokens(patchify(xt)).second));
  }
  Value prediction = config.architecture == Architecture::Wan
                         ? wanForward(xt, t, cond, image, imageCondition)
                         : ditForward(xt, t, cond);
  Value target0 = x0, targetNoise = noise;
  if (cleanTokens) {
    target0 = laterFrames(x0);
    targetNoise = laterFrames(noise);
  }
  auto lossOp = FlowMatchingLossOp::create(b, loc, lossType,
                                           weights ? lossType : Type(),
                                           prediction, target0, targetNoise,
                                           weights);
  Value loss = lossOp.getLoss();

  SmallVector<Value> working;
  for (const Trainable &tr : trainables)
    working.push_back(tr.working);
  FailureOr<SmallVector<Value>> grads = emitBackward(b, loss, working);
  if (failed(grads))
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "internal error: backward pass failed");
  emitOptimizer(*grads, body->getArguments().back());
  SmallVector<Value> returned = {loss};
  if (Value unweighted = lossOp.getUnweightedLoss())
    returned.push_back(unweighted);
  func::ReturnOp::create(b, loc, returned);

  std::string diagnostics;
  {
    ScopedDiagnosticHandler handler(&ctx, [&](Diagnostic &d) {
      diagnostics += d.str() + "\n";
      return success();
    });
    if (failed(verify(*module)))
      return llvm::createStringError(
          llvm::inconvertibleErrorCode(),
          "internal error: the built module does not verify:\n%s",
          diagnostics.c_str());
  }
  return std::move(module);
}

} // namespace

llvm::StringRef megaslide::computeTypeName(ComputeType type) {
  return type == ComputeType::F32 ? "f32" : "bf16";
}

llvm::Expected<ComputeType> megaslide::parseComputeType(llvm::StringRef value) {
  if (value == "bf16")
    return ComputeType::BF16;
  if (value == "f32")
    return ComputeType::F32;
  return llvm::createStringError(
      llvm::inconvertibleErrorCode(),
      "option 'precision': unknown value '%s'; use one of bf16, f32",
      value.str().c_str());
}

llvm::Expected<OwningOpRef<ModuleOp>>
megaslide::buildTrainingStep(MLIRContext &context, const ModelConfig &config,
                             const Geometry &geometry,
                             const TrainingOptions &options) {
  if (options.batch <= 0)
    return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                   "option 'batch': must be positive, got %lld",
                                   static_cast<long long>(options.batch));
  if (options.textLen && config.architecture != Architecture::Wan)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "option 'text_len': %s is class-conditional and has no text tokens",
        config.name.c_str());
  if (options.textLen && *options.textLen <= 0)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "option 'text_len': must be positive, got %lld",
        static_cast<long long>(*options.textLen));
  if (options.textLen && *options.textLen > kMaxModelWidth)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "option 'text_len': %lld is larger than %lld, the most MegaSlide "
        "plans for",
        static_cast<long long>(*options.textLen),
        static_cast<long long>(kMaxModelWidth));
  if (config.imageDim && options.textLen &&
      *options.textLen != kImageModelTextLen)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "option 'text_len': %lld, but diffusers' Wan attention takes the last "
        "%lld context tokens as the prompt of an image-conditioned model",
        static_cast<long long>(*options.textLen),
        static_cast<long long>(kImageModelTextLen));
  if (config.firstFrameConditioning && geometry.grid[0] < 2)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "%s conditions on its first latent frame, so the video needs at "
        "least 2 latent frames (5 frames at a temporal stride of 4)",
        config.name.c_str());
  // As computeGeometry bounds the tokens of one sample: every activation's
  // byte count must stay far from overflowing int64, whatever the batch.
  int64_t textLen = options.textLen.value_or(config.textLen);
  int64_t tokens = std::max(geometry.tokens(), textLen);
  if (options.batch > exec::kMaxTokensPerStep / tokens)
    return llvm::createStringError(
        llvm::inconvertibleErrorCode(),
        "option 'batch': %lld samples of %lld tokens are more than 2^31 "
        "tokens per step; use a smaller batch, video or text length",
        static_cast<long long>(options.batch), static_cast<long long>(tokens));
  TrainingStepBuilder builder(context, config, geometry, options);
  return builder.build();
}
