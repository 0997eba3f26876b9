//===- GraphOps.td - MegaSlide graph ops -------------------*- tablegen -*-===//
//
// Shapes use B = batch, N = tokens, D = model dim, H = heads, Dh = head dim.
// Token tensors are [B, N, D]; attention operands are [B, N, H, Dh] with the
// (T, Y, X) token grid flattened row-major.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_GRAPH_OPS
#define MEGASLIDE_GRAPH_OPS

include "dialects/Graph/GraphDialect.td"
include "dialects/Graph/GraphInterfaces.td"
include "mlir/IR/EnumAttr.td"
include "mlir/IR/OpAsmInterface.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/InferTypeOpInterface.td"

def Graph_FloatTensor : StaticShapeTensorOf<[F32, BF16, F16]>;
def Graph_IndexTensor : StaticShapeTensorOf<[I32, I64]>;
def Graph_ScalarF32 : 0DTensorOf<[F32]>;
def Graph_StepTensor : 0DTensorOf<[I64]>;
def Graph_Triple : ConfinedAttr<DenseI64ArrayAttr, [DenseArrayCount<3>]>;

def Graph_Differentiable
    : DeclareOpInterfaceMethods<Graph_DifferentiableOpInterface>;
def Graph_Flops : DeclareOpInterfaceMethods<Graph_FlopCountOpInterface>;

//===----------------------------------------------------------------------===//
// Persistent state
//===----------------------------------------------------------------------===//

// Why load, store and adamw never reach a plan (PlanOp.td).
defvar Graph_HostStateAccess = "replaced by schedule ops in "
    "megaslide-insert-transfers; megaslide-verify-schedule refuses any left";

def Graph_ParamRole : I32EnumAttr<"ParamRole", "role of a persistent tensor", [
    I32EnumAttrCase<"weight", 0>, I32EnumAttrCase<"master", 1>,
    I32EnumAttrCase<"moment", 2>, I32EnumAttrCase<"gradient", 3>,
    I32EnumAttrCase<"frozen", 4>]> {
  let cppNamespace = "::megaslide::graph";
}

def Graph_ParamGroup : I32EnumAttr<"ParamGroup", "part of the model", [
    I32EnumAttrCase<"embeddings", 0>, I32EnumAttrCase<"blocks", 1>,
    I32EnumAttrCase<"head", 2>]> {
  let cppNamespace = "::megaslide::graph";
}

def Graph_ParamOp : Graph_Op<"param", [Symbol]> {
  let summary = "declares a persistent tensor of the model state";
  let notInPlans = "a declaration, which the plan makes in its `params`";
  let description = [{
    Names one persistent tensor: a trainable parameter's fp32 `master`
    copy, an AdamW `moment` of it (`of` names the parameter), a persistent
    bf16 `weight` copy, a persistent `gradient`, or a `frozen` buffer that
    is counted as a parameter but never updated. The symbol is the tensor's
    name in diffusers-format checkpoints. `blocks[i]` places it in
    transformer block `i`.

    ```mlir
    megaslide.param master blocks[0] @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
    megaslide.param moment blocks[0] @"blocks.0.attn1.to_q.weight.exp_avg" of @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
    megaslide.param master embeddings @"patch_embedding.bias" : tensor<64xf32>
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, Graph_ParamRole:$role,
                       Graph_ParamGroup:$group, OptionalAttr<I64Attr>:$layer,
                       OptionalAttr<FlatSymbolRefAttr>:$of,
                       TypeAttrOf<AnyStaticShapeTensor>:$type);
  let assemblyFormat = [{
    $role $group (`[` $layer^ `]`)? $sym_name (`of` $of^)? attr-dict `:` $type
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::RankedTensorType getTensorType() {
      return ::llvm::cast<::mlir::RankedTensorType>(getType());
    }
    /// Number of elements of the tensor.
    int64_t getNumElements() { return getTensorType().getNumElements(); }
  }];
}

def Graph_LoadOp : Graph_Op<"load", [
    DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "reads the current value of a persistent tensor";
  let notInPlans = Graph_HostStateAccess;
  let description = [{
    ```mlir
    %w = megaslide.load @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
    ```
  }];
  let arguments = (ins FlatSymbolRefAttr:$param);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$param attr-dict `:` type($result)";
}

def Graph_StoreOp : Graph_Op<"store", [
    DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "writes a new value to a persistent tensor";
  let notInPlans = Graph_HostStateAccess;
  let description = [{
    ```mlir
    megaslide.store %w2, @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$value, FlatSymbolRefAttr:$param);
  let assemblyFormat = "$value `,` $param attr-dict `:` type($value)";
}

def Graph_AdamWOp : Graph_Op<"adamw", [Pure, Graph_Flops,
    AllTypesMatch<["param", "new_param"]>, AllTypesMatch<["m", "new_m"]>,
    AllTypesMatch<["v", "new_v", "m"]>]> {
  let summary = "one decoupled-weight-decay Adam (AdamW) update";
  let notInPlans = Graph_HostStateAccess;
  let description = [{
    With step `t` (1-based) and gradient `g` (cast to fp32):
    `m' = b1 m + (1-b1) g`, `v' = b2 v + (1-b2) g^2`,
    `p' = p - lr (wd p + (m'/(1-b1^t)) / (sqrt(v'/(1-b2^t)) + eps))`.

    ```mlir
    %p2, %m2, %v2 = megaslide.adamw %p, %g, %m, %v, %step {lr = 1.0e-04 : f64}
        : tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$param, Graph_FloatTensor:$grad,
                       Graph_FloatTensor:$m, Graph_FloatTensor:$v,
                       Graph_StepTensor:$step,
                       DefaultValuedAttr<F64Attr, "1.0e-4">:$lr,
                       DefaultValuedAttr<F64Attr, "0.9">:$beta1,
                       DefaultValuedAttr<F64Attr, "0.999">:$beta2,
                       DefaultValuedAttr<F64Attr, "1.0e-8">:$eps,
                       DefaultValuedAttr<F64Attr, "0.0">:$weight_decay);
  let results = (outs RankedTensorOf<[F32]>:$new_param,
                      Graph_FloatTensor:$new_m, Graph_FloatTensor:$new_v);
  let assemblyFormat = [{
    $param `,` $grad `,` $m `,` $v `,` $step attr-dict `:`
    type($param) `,` type($grad) `,` type($m) `,` type($v) `,` type($step)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Structural ops
//===----------------------------------------------------------------------===//

def Graph_CastOp : Graph_Op<"cast", [Pure, Graph_Differentiable,
    SameOperandsAndResultShape]> {
  let summary = "converts a tensor to another element type";
  let description = [{
    ```mlir
    %w16 = megaslide.cast %w : tensor<64x64xf32> -> tensor<64x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
}

def Graph_ReshapeOp : Graph_Op<"reshape", [Pure, Graph_Differentiable]> {
  let summary = "reinterprets a tensor with another static shape";
  // A view of its operand: no work, no kernel.
  let costKind = "None";
  let kernelFamily = "None";
  let description = [{
    Row-major reinterpretation; the element count is unchanged.

    ```mlir
    %h = megaslide.reshape %x : tensor<1x16x64xbf16> -> tensor<1x16x4x16xbf16>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Graph_SplitOp : Graph_Op<"split", [Pure, Graph_Differentiable]> {
  let summary = "splits the last dimension into consecutive pieces";
  let description = [{
    Like `torch.split(x, sizes, dim=-1)`: the results' last dimensions
    are the pieces' widths, in order, and sum to the input's (equal widths
    are `torch.chunk(x, n, dim=-1)`).

    ```mlir
    %s:2 = megaslide.split %x : tensor<1x128xbf16> -> tensor<1x64xbf16>, tensor<1x64xbf16>
    %u:2 = megaslide.split %x : tensor<1x128xbf16> -> tensor<1x32xbf16>, tensor<1x96xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Variadic<Graph_FloatTensor>:$results);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($results)";
  let hasVerifier = 1;
}

def Graph_ConcatOp : Graph_Op<"concat", [Pure, Graph_Differentiable]> {
  let summary = "concatenates tensors along the last dimension";
  let description = [{
    The inverse of `megaslide.split`.

    ```mlir
    %x = megaslide.concat %a, %b : tensor<1x64xbf16>, tensor<1x64xbf16> -> tensor<1x128xbf16>
    ```
  }];
  let arguments = (ins Variadic<Graph_FloatTensor>:$inputs);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$inputs attr-dict `:` type($inputs) `->` type($result)";
  let hasVerifier = 1;
}

def Graph_ZerosOp : Graph_Op<"zeros", [Pure]> {
  let summary = "a tensor filled with zeros";
  let description = [{
    ```mlir
    %z = megaslide.zeros : tensor<1x64xbf16>
    ```
  }];
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

//===----------------------------------------------------------------------===//
// Embeddings
//===----------------------------------------------------------------------===//

def Graph_PatchEmbedOp : Graph_Op<"patch_embed", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "3D convolution with stride equal to the patch (patchify + linear)";
  let kernelFamily = "Gemm";
  let description = [{
    Latents `x` [B, C, T, H, W] are cut into non-overlapping patches
    (pt, ph, pw) taken from the weight [D, C, pt, ph, pw]; each patch is
    projected to D channels and biased. Tokens come out row-major over the
    patch grid (T/pt, H/ph, W/pw): [B, N, D].

    ```mlir
    %t = megaslide.patch_embed %x, %w, %b
        : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight,
                       Graph_FloatTensor:$bias);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $input `,` $weight `,` $bias attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_PatchEmbedGradOp : Graph_Op<"patch_embed_grad", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "weight and bias gradients of patch_embed";
  let kernelFamily = "Gemm";
  let description = [{
    Given the latents and the gradient of the tokens [B, N, D], returns
    the gradients of the weight [D, C, pt, ph, pw] and of the bias [D].
    The latents are data, so no input gradient is produced.

    ```mlir
    %dw, %db = megaslide.patch_embed_grad %x, %dy
        : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$weight_grad, Graph_FloatTensor:$bias_grad);
  let assemblyFormat = [{
    $input `,` $result_grad attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_UnpatchifyOp : Graph_Op<"unpatchify", [Pure, Graph_Differentiable]> {
  let summary = "reassembles per-token patches into latents";
  let description = [{
    Tokens [B, N, pt*ph*pw*C] over the patch grid `grid` = (T, Y, X)
    become latents [B, C, T*pt, Y*ph, X*pw]. Within a token the patch is
    laid out (pt, ph, pw, C), channels fastest, as in DiT and Wan 2.1.

    ```mlir
    %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
        : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_Triple:$grid,
                       Graph_Triple:$patch);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Graph_PatchifyOp : Graph_Op<"patchify", [Pure, Graph_BackwardOp]> {
  let summary = "cuts latents into per-token patches (inverse of unpatchify)";
  let description = [{
    The exact inverse of `megaslide.unpatchify`, used for its gradient, and
    in the forward to take latents apart by token (Wan 2.2 TI2V's clean
    first frame) where nothing is differentiated.

    ```mlir
    %t = megaslide.patchify %y {patch = array<i64: 1, 2, 2>}
        : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_Triple:$patch);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Graph_TimestepEmbeddingOp : Graph_Op<"timestep_embedding", [Pure,
    Graph_Flops]> {
  let summary = "sinusoidal embedding of diffusion timesteps";
  let description = [{
    For `t` [B] and an even output width `2h`: with
    `f_i = max_period^(-i/h)` and `s = time_scale * t`, the result is
    `[cos(s f_0..f_{h-1}), sin(s f_0..f_{h-1})]` (DiT; diffusers `Timesteps`
    with `flip_sin_to_cos`, shift 0).

    ```mlir
    %e = megaslide.timestep_embedding %t {time_scale = 1000.0 : f64} : tensor<2xf32> -> tensor<2x256xbf16>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$timesteps,
                       DefaultValuedAttr<F64Attr, "10000.0">:$max_period,
                       DefaultValuedAttr<F64Attr, "1.0">:$time_scale);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$timesteps attr-dict `:` type($timesteps) `->` type($result)";
  let hasVerifier = 1;
}

def Graph_EmbeddingOp : Graph_Op<"embedding", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "looks up rows of an embedding table";
  let description = [{
    `result[b] = table[ids[b]]` for ids [B] and a table [V, D].

    ```mlir
    %y = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
    ```
  }];
  let arguments = (ins Graph_IndexTensor:$ids, Graph_FloatTensor:$table);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$ids `,` $table attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Graph_EmbeddingGradOp : Graph_Op<"embedding_grad", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "scatter-adds row gradients into a table gradient";
  let description = [{
    ```mlir
    %dt = megaslide.embedding_grad %ids, %dy : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
    ```
  }];
  let arguments = (ins Graph_IndexTensor:$ids, Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$table_grad);
  let assemblyFormat = "$ids `,` $result_grad attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Dense layers, norms, activations
//===----------------------------------------------------------------------===//

def Graph_LinearOp : Graph_Op<"linear", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "y = x W^T + b over the last dimension";
  let kernelFamily = "Gemm";
  let description = [{
    `x` [..., in], `weight` [out, in] (PyTorch layout), optional `bias` [out].

    ```mlir
    %y = megaslide.linear %x, %w, %b
        : (tensor<1x32x64xbf16>, tensor<256x64xbf16>, tensor<256xbf16>) -> tensor<1x32x256xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight,
                       Optional<Graph_FloatTensor>:$bias);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $input `,` $weight (`,` $bias^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_LinearGradDataOp : Graph_Op<"linear_grad_data", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "input gradient of linear: dx = dy W";
  let kernelFamily = "Gemm";
  let description = [{
    ```mlir
    %dx = megaslide.linear_grad_data %dy, %w
        : (tensor<1x32x256xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$result_grad, Graph_FloatTensor:$weight);
  let results = (outs Graph_FloatTensor:$input_grad);
  let assemblyFormat = [{
    $result_grad `,` $weight attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_LinearGradParamsOp : Graph_Op<"linear_grad_params", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "weight (and bias) gradients of linear";
  let kernelFamily = "Gemm";
  let description = [{
    `dW = dy^T x` summed over all leading dimensions; with a second result,
    `db = sum(dy)` over the leading dimensions.

    ```mlir
    %dw, %db = megaslide.linear_grad_params %x, %dy
        : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<256xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$weight_grad,
                      Optional<Graph_FloatTensor>:$bias_grad);
  let assemblyFormat = [{
    $input `,` $result_grad attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_LayerNormOp : Graph_Op<"layer_norm", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "LayerNorm over the last dimension, with or without affine";
  let description = [{
    `(x - mean) / sqrt(var + eps)`, then `* gamma + beta` when the two
    affine operands [D] are given. Statistics are computed in fp32.

    ```mlir
    %y = megaslide.layer_norm %x {eps = 1.0e-06 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
    %z = megaslide.layer_norm %x, %g, %b {eps = 1.0e-06 : f64}
        : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input,
                       Variadic<Graph_FloatTensor>:$affine,
                       DefaultValuedAttr<F64Attr, "1.0e-6">:$eps);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $input (`,` $affine^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_LayerNormGradOp : Graph_Op<"layer_norm_grad", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "gradients of layer_norm";
  let description = [{
    Returns the input gradient, then the gamma and beta gradients when the
    forward op was affine (the affine operands are passed again).

    ```mlir
    %dx, %dg, %db = megaslide.layer_norm_grad %x, %dy, %g, %b {eps = 1.0e-06 : f64}
        : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
          -> (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad,
                       Variadic<Graph_FloatTensor>:$affine,
                       DefaultValuedAttr<F64Attr, "1.0e-6">:$eps);
  let results = (outs Graph_FloatTensor:$input_grad,
                      Variadic<Graph_FloatTensor>:$affine_grads);
  let assemblyFormat = [{
    $input `,` $result_grad (`,` $affine^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_RMSNormOp : Graph_Op<"rms_norm", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "RMSNorm over the last dimension (also QK-norm)";
  let description = [{
    `x / sqrt(mean(x^2) + eps)`, times `gamma` [D] when given. Wan 2.1's
    QK-norm (`rms_norm_across_heads`) is this op on q and k before the
    heads are split.

    ```mlir
    %y = megaslide.rms_norm %x, %g {eps = 1.0e-06 : f64}
        : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input,
                       Optional<Graph_FloatTensor>:$gamma,
                       DefaultValuedAttr<F64Attr, "1.0e-6">:$eps);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $input (`,` $gamma^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_RMSNormGradOp : Graph_Op<"rms_norm_grad", [Pure, Graph_BackwardOp,
    Graph_Flops]> {
  let summary = "gradients of rms_norm";
  let description = [{
    ```mlir
    %dx, %dg = megaslide.rms_norm_grad %x, %dy, %g {eps = 1.0e-06 : f64}
        : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>)
          -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad,
                       Optional<Graph_FloatTensor>:$gamma,
                       DefaultValuedAttr<F64Attr, "1.0e-6">:$eps);
  let results = (outs Graph_FloatTensor:$input_grad,
                      Optional<Graph_FloatTensor>:$gamma_grad);
  let assemblyFormat = [{
    $input `,` $result_grad (`,` $gamma^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_ModulateOp : Graph_Op<"modulate", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "adaLN modulation: x * (1 + scale) + shift";
  let description = [{
    `x` [B, N, D]; `shift` and `scale` [B, D] broadcast over tokens.

    ```mlir
    %y = megaslide.modulate %x, %shift, %scale
        : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$shift,
                       Graph_FloatTensor:$scale);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $input `,` $shift `,` $scale attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_ModulateGradOp : Graph_Op<"modulate_grad", [Pure, Graph_BackwardOp,
    Graph_Flops]> {
  let summary = "gradients of modulate";
  let description = [{
    `dx = dy (1 + scale)`, `dshift = sum_N dy`, `dscale = sum_N dy x`.

    ```mlir
    %dx, %dshift, %dscale = megaslide.modulate_grad %x, %scale, %dy
        : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
          -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$scale,
                       Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$input_grad,
                      Graph_FloatTensor:$shift_grad, Graph_FloatTensor:$scale_grad);
  let assemblyFormat = [{
    $input `,` $scale `,` $result_grad attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_GateOp : Graph_Op<"gate", [Pure, Graph_Differentiable, Graph_Flops]> {
  let summary = "adaLN gate: x * gate, the gate broadcast over tokens";
  let description = [{
    ```mlir
    %y = megaslide.gate %x, %g : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$gate);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input `,` $gate attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Graph_GateGradOp : Graph_Op<"gate_grad", [Pure, Graph_BackwardOp,
    Graph_Flops]> {
  let summary = "gradients of gate";
  let description = [{
    `dx = dy * gate`, `dgate = sum_N dy x`.

    ```mlir
    %dx, %dg = megaslide.gate_grad %x, %g, %dy
        : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
          -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$gate,
                       Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$input_grad, Graph_FloatTensor:$gate_grad);
  let assemblyFormat = [{
    $input `,` $gate `,` $result_grad attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

class Graph_UnaryOp<string mnemonic, string what>
    : Graph_Op<mnemonic, [Pure, Graph_Differentiable, Graph_Flops,
                          SameOperandsAndResultType]> {
  let summary = what;
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
}

class Graph_UnaryGradOp<string mnemonic, string what>
    : Graph_Op<mnemonic, [Pure, Graph_BackwardOp, Graph_Flops,
                          SameOperandsAndResultType]> {
  let summary = what;
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$input_grad);
  let assemblyFormat = "$input `,` $result_grad attr-dict `:` type($input_grad)";
}

def Graph_GeluOp : Graph_UnaryOp<"gelu", "GELU, tanh-approximated or exact"> {
  let description = [{
    `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, PyTorch's
    `approximate="tanh"`, used by DiT and Wan 2.1's blocks; with `exact`,
    `0.5 x (1 + erf(x / sqrt(2)))`, PyTorch's default, used by Wan's image
    embedder.

    ```mlir
    %y = megaslide.gelu %x : tensor<1x32x256xbf16>
    %e = megaslide.gelu %x {exact} : tensor<1x32x256xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, UnitAttr:$exact);
}

def Graph_GeluGradOp : Graph_UnaryGradOp<"gelu_grad", "gradient of gelu"> {
  let description = [{
    `exact` as on the `megaslide.gelu` it differentiates.

    ```mlir
    %dx = megaslide.gelu_grad %x, %dy : tensor<1x32x256xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$result_grad,
                       UnitAttr:$exact);
}

def Graph_SiluOp : Graph_UnaryOp<"silu", "SiLU: x * sigmoid(x)"> {
  let description = [{
    ```mlir
    %y = megaslide.silu %x : tensor<1x64xbf16>
    ```
  }];
}

def Graph_SiluGradOp : Graph_UnaryGradOp<"silu_grad", "gradient of silu"> {
  let description = [{
    ```mlir
    %dx = megaslide.silu_grad %x, %dy : tensor<1x64xbf16>
    ```
  }];
}

def Graph_AddOp : Graph_Op<"add", [Pure, Graph_Differentiable, Graph_Flops,
    SameOperandsAndResultType]> {
  let summary = "elementwise sum of two tensors of the same type (residual add)";
  let description = [{
    ```mlir
    %y = megaslide.add %x, %r : tensor<1x32x64xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$lhs, Graph_FloatTensor:$rhs);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($result)";
}

def Graph_BiasAddOp : Graph_Op<"bias_add", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "adds a tensor broadcast over the leading dimensions";
  let description = [{
    The bias shape must be a suffix of the input shape (a learned table
    added to every sample, a frozen position embedding added to every
    batch element).

    ```mlir
    %y = megaslide.bias_add %x, %table : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<2x384xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$bias);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input `,` $bias attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Graph_BiasAddGradOp : Graph_Op<"bias_add_grad", [Pure, Graph_BackwardOp,
    Graph_Flops]> {
  let summary = "sums a gradient over leading dimensions down to a bias shape";
  let description = [{
    ```mlir
    %db = megaslide.bias_add_grad %dy : tensor<2x384xbf16> -> tensor<384xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$result_grad);
  let results = (outs Graph_FloatTensor:$bias_grad);
  let assemblyFormat = "$result_grad attr-dict `:` type($result_grad) `->` type($bias_grad)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Attention
//===----------------------------------------------------------------------===//

def Graph_Rope3dOp : Graph_Op<"rope3d", [Pure, Graph_Differentiable,
    Graph_Flops, SameOperandsAndResultType]> {
  let summary = "3D rotary position embedding over a (T, Y, X) token grid";
  let description = [{
    `x` [B, N, H, Dh] with N = T*Y*X tokens in row-major (t, y, x) order.
    The head dim is split into `dims` = (dt, dy, dx) channels (Wan 2.1:
    dt = Dh - 4*(Dh/6), dy = dx = 2*(Dh/6)); each part rotates adjacent
    channel pairs (2i, 2i+1) by angle `pos * theta^(-2i/d)` with pos the
    token's t, y or x, counter-clockwise as diffusers' complex product
    (x0 + i x1) e^(i angle): (x0 cos - x1 sin, x0 sin + x1 cos). `inverse`
    rotates by the negated angle, which is the gradient of the forward
    rotation.

    ```mlir
    %q2 = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>}
        : tensor<1x32x4x16xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_Triple:$grid,
                       Graph_Triple:$dims,
                       DefaultValuedAttr<F64Attr, "10000.0">:$theta,
                       UnitAttr:$inverse);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Graph_AttentionOp : Graph_Op<"attention", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "global multi-head scaled dot-product attention";
  let kernelFamily = "AttentionFwd";
  let description = [{
    `softmax(scale q k^T) v` per batch and head, q [B, Nq, H, Dh], k and v
    [B, Nk, H, Dh]. Self-attention when Nq = Nk over the same tokens;
    cross-attention to text tokens otherwise. Default scale 1/sqrt(Dh).

    ```mlir
    %o = megaslide.attention %q, %k, %v
        : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                       Graph_FloatTensor:$value, OptionalAttr<F64Attr>:$scale);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $query `,` $key `,` $value attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    /// The softmax scale, defaulting to 1/sqrt(head dim).
    double getEffectiveScale();
  }];
}

def Graph_AttentionGradOp : Graph_Op<"attention_grad", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "gradients of attention with respect to q, k and v";
  let kernelFamily = "AttentionBwd";
  let description = [{
    ```mlir
    %dq, %dk, %dv = megaslide.attention_grad %q, %k, %v, %o, %do
        : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
           tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
          -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                       Graph_FloatTensor:$value, Graph_FloatTensor:$output,
                       Graph_FloatTensor:$output_grad, OptionalAttr<F64Attr>:$scale);
  let results = (outs Graph_FloatTensor:$query_grad, Graph_FloatTensor:$key_grad,
                      Graph_FloatTensor:$value_grad);
  let assemblyFormat = [{
    $query `,` $key `,` $value `,` $output `,` $output_grad attr-dict `:`
    functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_Dsa3dOp : Graph_Op<"dsa3d", [Pure, Graph_Differentiable,
    Graph_Flops]> {
  let summary = "3D Deformable Slide Attention and its softmax log-sum-exp";
  let kernelFamily = "Dsa3dFwd";
  let description = [{
    Linear-cost local attention over the token grid `grid` = (T, Y, X)
    (docs/Dsa3d.md, "Definition"). Queries are tiled by
    `tile` = (tt, ty, tx); all queries of a tile attend to the same
    `window` = (kt, ky, kx) keys: a clamped temporal range around the
    tile's centre frame and, per key frame j, a spatial window displaced by
    `offsets`[b, h, tile, j] = (dy, dx) and clamped inside the grid.
    q, k, v, result: [B, N, H, Dh]; offsets: i32
    [B, H, ceil(T/tt), ceil(Y/ty), ceil(X/tx), kt, 2].

    Like FlashAttention, the forward also returns `lse`: fp32 [B, H, N],
    the natural-log log-sum-exp of the scaled logits of each query's
    softmax. `dsa3d_grad` consumes it to recompute the probabilities, so
    the backward needs neither a second forward nor a stored attention
    matrix.

    ```mlir
    %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
        : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
           tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                       Graph_FloatTensor:$value, RankedTensorOf<[I32]>:$offsets,
                       Graph_Triple:$grid, Graph_Triple:$window, Graph_Triple:$tile,
                       OptionalAttr<F64Attr>:$scale);
  let results = (outs Graph_FloatTensor:$result, RankedTensorOf<[F32]>:$lse);
  let assemblyFormat = [{
    $query `,` $key `,` $value `,` $offsets attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_Dsa3dGradOp : Graph_Op<"dsa3d_grad", [Pure, Graph_BackwardOp,
    Graph_Flops]> {
  let summary = "gradients of dsa3d with respect to q, k and v";
  let kernelFamily = "Dsa3dBwd";
  let description = [{
    Takes the forward's `output` and its `lse` (fp32 [B, H, N]) beside the
    output gradient: probabilities are recomputed as
    exp(scale q.k - lse), FlashAttention-style. Offsets are integers and
    carry no gradient.

    ```mlir
    %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 2, 4, 4>,
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
        : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
           tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
           tensor<1x32x4x16xbf16>)
          -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                       Graph_FloatTensor:$value, RankedTensorOf<[I32]>:$offsets,
                       Graph_FloatTensor:$output, RankedTensorOf<[F32]>:$lse,
                       Graph_FloatTensor:$output_grad,
                       Graph_Triple:$grid, Graph_Triple:$window, Graph_Triple:$tile,
                       OptionalAttr<F64Attr>:$scale);
  let results = (outs Graph_FloatTensor:$query_grad, Graph_FloatTensor:$key_grad,
                      Graph_FloatTensor:$value_grad);
  let assemblyFormat = [{
    $query `,` $key `,` $value `,` $offsets `,` $output `,` $lse `,` $output_grad
    attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_Dsa3dOffsetsOp : Graph_Op<"dsa3d_offsets", [Pure, Graph_Flops]> {
  let summary = "block-matching estimate of 3D-DSA window displacements";
  let kernelFamily = "Dsa3dOffsets";
  let description = [{
    For each query tile and key frame: the displacement (dy, dx) in
    [-radius, radius]^2 maximising the dot product between the mean-pooled
    query tile and the mean-pooled keys of the displaced window (ties:
    smallest |dy|+|dx|, then dy, then dx). Integer result, no gradient.

    ```mlir
    %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
        window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
        : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                       Graph_Triple:$grid, Graph_Triple:$window, Graph_Triple:$tile,
                       ConfinedAttr<I64Attr, [IntNonNegative]>:$radius);
  let results = (outs RankedTensorOf<[I32]>:$offsets);
  let assemblyFormat = [{
    $query `,` $key attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Flow matching
//===----------------------------------------------------------------------===//

def Graph_FlowInterpolateOp : Graph_Op<"flow_interpolate", [Pure, Graph_Flops]> {
  let summary = "noisy latents of rectified flow: (1 - t) x0 + t noise";
  let description = [{
    `t` [B] in [0, 1] broadcast over each sample.

    ```mlir
    %xt = megaslide.flow_interpolate %x0, %noise, %t
        : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$latents, Graph_FloatTensor:$noise,
                       RankedTensorOf<[F32]>:$timesteps);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = [{
    $latents `,` $noise `,` $timesteps attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

// Results named only when there are two: an unweighted loss prints as
// the single-result op it was before weights.
def Graph_FlowMatchingLossOp : Graph_Op<"flow_matching_loss", [Pure,
    Graph_Differentiable, Graph_Flops,
    DeclareOpInterfaceMethods<OpAsmOpInterface, ["getAsmResultNames"]>]> {
  let summary = "velocity MSE: mean((pred - (noise - x0))^2)";
  let description = [{
    The prediction may carry more channels than the latents (DiT's learned
    sigma): only the first C channels are compared, the rest get a zero
    gradient. Result: an fp32 scalar.

    ```mlir
    %loss = megaslide.flow_matching_loss %pred, %x0, %noise
        : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
    ```

    With per-sample `weights` [B] (fp32) the loss is the mean over the
    samples of `weights[b]` times the sample's mean squared error
    (diffusers' weighted flow-matching loss); a second result is the
    unweighted loss, reported and not differentiated.

    ```mlir
    %loss, %unweighted = megaslide.flow_matching_loss %pred, %x0, %noise weights %w
        : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> (tensor<f32>, tensor<f32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$prediction, Graph_FloatTensor:$latents,
                       Graph_FloatTensor:$noise,
                       Optional<RankedTensorOf<[F32]>>:$weights);
  let results = (outs Graph_ScalarF32:$loss,
                      Optional<Graph_ScalarF32>:$unweighted_loss);
  let assemblyFormat = [{
    $prediction `,` $latents `,` $noise (`weights` $weights^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

def Graph_FlowMatchingLossGradOp : Graph_Op<"flow_matching_loss_grad", [Pure,
    Graph_BackwardOp, Graph_Flops]> {
  let summary = "gradient of flow_matching_loss with respect to the prediction";
  let description = [{
    `2 w[b] (pred - (noise - x0)) / numel(x0)` on the first C channels, zero
    on the rest, with w the optional per-sample `weights` (1 without); the
    upstream gradient of the loss is 1.

    ```mlir
    %dp = megaslide.flow_matching_loss_grad %pred, %x0, %noise
        : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x16x2x8x8xbf16>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$prediction, Graph_FloatTensor:$latents,
                       Graph_FloatTensor:$noise,
                       Optional<RankedTensorOf<[F32]>>:$weights);
  let results = (outs Graph_FloatTensor:$prediction_grad);
  let assemblyFormat = [{
    $prediction `,` $latents `,` $noise (`weights` $weights^)? attr-dict `:` functional-type(operands, results)
  }];
  let hasVerifier = 1;
}

#endif // MEGASLIDE_GRAPH_OPS
