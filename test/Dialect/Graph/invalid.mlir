// RUN: megaslide-opt %s --split-input-file --verify-diagnostics

// One case per verifier message of the graph dialect (GraphOps.cpp).

//===----------------------------------------------------------------------===//
// Persistent state
//===----------------------------------------------------------------------===//

// Tests that a moment must name the parameter it belongs to.

// expected-error @below {{'megaslide.param' op role 'moment' requires an 'of' parameter}}
megaslide.param moment blocks[0] @w.exp_avg : tensor<4xf32>

// -----

// Tests that a gradient must name the parameter it belongs to.

// expected-error @below {{'megaslide.param' op role 'gradient' requires an 'of' parameter}}
megaslide.param gradient head @w.grad : tensor<4xf32>

// -----

// Tests that only moments and gradients take an `of` parameter.

megaslide.param master head @w : tensor<4xf32>
// expected-error @below {{'megaslide.param' op role 'master' does not take an 'of' parameter}}
megaslide.param master head @w2 of @w : tensor<4xf32>

// -----

// Tests that a param of group `blocks` needs a block index.

// expected-error @below {{a block index '[i]' is required exactly for group 'blocks'}}
megaslide.param master blocks @w : tensor<4xf32>

// -----

// Tests that a param outside group `blocks` takes no block index.

// expected-error @below {{a block index '[i]' is required exactly for group 'blocks'}}
megaslide.param master embeddings[0] @w : tensor<4xf32>

// -----

// Tests that a block index is non-negative.

// expected-error @below {{block index must be non-negative, got -1}}
megaslide.param master blocks[-1] @w : tensor<4xf32>

// -----

// Tests that master weights are fp32.

// expected-error @below {{master weights must be f32, got 'bf16'}}
megaslide.param master head @w : tensor<4xbf16>

// -----

// Tests that persistent state is floating point.

// expected-error @below {{persistent state must be floating point, got 'i32'}}
megaslide.param frozen head @ids : tensor<4xi32>

// -----

// Tests that load names a declared param.

func.func @load_unknown() -> tensor<4xf32> {
  // expected-error @below {{'megaslide.load' op 'nope' does not name a megaslide.param}}
  %0 = megaslide.load @nope : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Tests that a symbol that is not a param is rejected by load.

func.func @not_a_param() {
  return
}
func.func @load_func() -> tensor<4xf32> {
  // expected-error @below {{'megaslide.load' op 'not_a_param' does not name a megaslide.param}}
  %0 = megaslide.load @not_a_param : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Tests that load yields exactly the declared type.

megaslide.param master head @w : tensor<4xf32>
func.func @load_type() -> tensor<8xf32> {
  // expected-error @below {{'megaslide.load' op type 'tensor<8xf32>' does not match 'tensor<4xf32>' declared by 'w'}}
  %0 = megaslide.load @w : tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

// Tests that store names a declared param.

func.func @store_unknown(%x: tensor<4xf32>) {
  // expected-error @below {{'megaslide.store' op 'nope' does not name a megaslide.param}}
  megaslide.store %x, @nope : tensor<4xf32>
  return
}

// -----

// Tests that store writes exactly the declared type.

megaslide.param master head @w : tensor<4xf32>
func.func @store_type(%x: tensor<4xbf16>) {
  // expected-error @below {{'megaslide.store' op type 'tensor<4xbf16>' does not match 'tensor<4xf32>' declared by 'w'}}
  megaslide.store %x, @w : tensor<4xbf16>
  return
}

// -----

// Tests that the adamw gradient has the parameter's shape.

func.func @adamw_grad(%p: tensor<4xf32>, %g: tensor<8xbf16>, %s: tensor<i64>) {
  // expected-error @below {{'grad' has shape [8] but expected [4]}}
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %p, %p, %s
      : tensor<4xf32>, tensor<8xbf16>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}

// -----

// Tests that the adamw moments have the parameter's shape.

func.func @adamw_m(%p: tensor<4xf32>, %m: tensor<2x2xf32>, %s: tensor<i64>) {
  // expected-error @below {{'m' has shape [2, 2] but expected [4]}}
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %m, %m, %s
      : tensor<4xf32>, tensor<4xf32>, tensor<2x2xf32>, tensor<2x2xf32>, tensor<i64>
  return
}

// -----

// Tests that adamw betas lie in [0, 1).

func.func @adamw_betas(%p: tensor<4xf32>, %s: tensor<i64>) {
  // expected-error @below {{betas must lie in [0, 1), got (9.000000e-01, 1.000000e+00)}}
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {beta2 = 1.0 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}

// -----

// Tests that a NaN beta is rejected like any value outside [0, 1).

func.func @adamw_nan_beta(%p: tensor<4xf32>, %s: tensor<i64>) {
  // expected-error @below {{betas must lie in [0, 1)}}
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {beta1 = 0x7FF8000000000000 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}

// -----

// Tests that adamw needs a positive eps.

func.func @adamw_eps(%p: tensor<4xf32>, %s: tensor<i64>) {
  // expected-error @below {{needs lr >= 0, eps > 0, weight_decay >= 0}}
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {eps = 0.0 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}

// -----

// Tests that adamw needs a non-negative learning rate.

func.func @adamw_lr(%p: tensor<4xf32>, %s: tensor<i64>) {
  // expected-error @below {{needs lr >= 0, eps > 0, weight_decay >= 0}}
  %p1, %m1, %v1 = megaslide.adamw %p, %p, %p, %p, %s {lr = -1.0e-04 : f64}
      : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<i64>
  return
}

// -----

//===----------------------------------------------------------------------===//
// Structural ops
//===----------------------------------------------------------------------===//

// Tests that reshape keeps the element count.

func.func @reshape_count(%x: tensor<2x3xbf16>) -> tensor<7xbf16> {
  // expected-error @below {{cannot reshape 6 elements [2, 3] into 7 elements [7]}}
  %y = megaslide.reshape %x : tensor<2x3xbf16> -> tensor<7xbf16>
  return %y : tensor<7xbf16>
}

// -----

// Tests that reshape keeps the element type.

func.func @reshape_type(%x: tensor<2x3xbf16>) -> tensor<6xf32> {
  // expected-error @below {{must not change the element type}}
  %y = megaslide.reshape %x : tensor<2x3xbf16> -> tensor<6xf32>
  return %y : tensor<6xf32>
}

// -----

// Tests that reshape needs static shapes.

func.func @reshape_dynamic(%x: tensor<?x3xbf16>) -> tensor<6xbf16> {
  // expected-error @below {{needs static shapes}}
  %y = megaslide.reshape %x : tensor<?x3xbf16> -> tensor<6xbf16>
  return %y : tensor<6xbf16>
}

// -----

// Tests that split needs at least one result.

func.func @split_none(%x: tensor<1x4xbf16>) {
  // expected-error @below {{needs at least one result}}
  "megaslide.split"(%x) : (tensor<1x4xbf16>) -> ()
  return
}

// -----

// Tests that split's pieces cover the last dimension exactly.

func.func @split_short(%x: tensor<1x5xbf16>) {
  // expected-error @below {{results are 4 wide together, but the input's last dimension is 5}}
  %s:2 = megaslide.split %x : tensor<1x5xbf16> -> tensor<1x2xbf16>, tensor<1x2xbf16>
  return
}

// -----

// Tests that split needs a last dimension.

func.func @split_scalar(%x: tensor<bf16>) {
  // expected-error @below {{input must have rank >= 1}}
  %s = megaslide.split %x : tensor<bf16> -> tensor<bf16>
  return
}

// -----

// Tests that every split result is a piece of the input's last dimension.

func.func @split_shape(%x: tensor<1x4xbf16>) {
  // expected-error @below {{result [2, 2] is not a piece of the last dimension of [1, 4]}}
  %s:2 = megaslide.split %x : tensor<1x4xbf16> -> tensor<1x2xbf16>, tensor<2x2xbf16>
  return
}

// -----

// Tests that split keeps the element type.

func.func @split_type(%x: tensor<1x4xbf16>) {
  // expected-error @below {{mixes element types 'bf16' and 'f32'; insert megaslide.cast}}
  %s:2 = megaslide.split %x : tensor<1x4xbf16> -> tensor<1x2xbf16>, tensor<1x2xf32>
  return
}

// -----

// Tests that concat needs at least one input.

func.func @concat_none() {
  // expected-error @below {{needs at least one input}}
  %y = "megaslide.concat"() : () -> tensor<1x4xbf16>
  return
}

// -----

// Tests that concat needs a last dimension.

func.func @concat_scalar(%x: tensor<bf16>) {
  // expected-error @below {{inputs must have rank >= 1}}
  %y = megaslide.concat %x, %x : tensor<bf16>, tensor<bf16> -> tensor<2xbf16>
  return
}

// -----

// Tests that concat inputs agree outside the last dimension.

func.func @concat_leading(%a: tensor<1x4xbf16>, %b: tensor<2x4xbf16>) {
  // expected-error @below {{inputs [1, 4] and [2, 4] differ outside the last dimension}}
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<2x4xbf16> -> tensor<1x8xbf16>
  return
}

// -----

// Tests that concat inputs have the same rank.

func.func @concat_rank(%a: tensor<1x4xbf16>, %b: tensor<4xbf16>) {
  // expected-error @below {{inputs [1, 4] and [4] differ outside the last dimension}}
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<4xbf16> -> tensor<1x8xbf16>
  return
}

// -----

// Tests that the concat result's last dimension is the sum of the inputs'.

func.func @concat_result(%a: tensor<1x4xbf16>, %b: tensor<1x2xbf16>) {
  // expected-error @below {{'result' has shape [1, 8] but expected [1, 6]}}
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<1x2xbf16> -> tensor<1x8xbf16>
  return
}

// -----

// Tests that concat does not mix element types.

func.func @concat_type(%a: tensor<1x4xbf16>, %b: tensor<1x2xf16>) {
  // expected-error @below {{mixes element types 'bf16' and 'f16'; insert megaslide.cast}}
  %y = megaslide.concat %a, %b : tensor<1x4xbf16>, tensor<1x2xf16> -> tensor<1x6xbf16>
  return
}

// -----

//===----------------------------------------------------------------------===//
// Embeddings
//===----------------------------------------------------------------------===//

// Tests that patch_embed takes 5-D latents.

func.func @patch_embed_rank(%x: tensor<1x16x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>) {
  // expected-error @below {{'input' must have rank 5 [B, C, T, H, W], got [1, 16, 8, 8]}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x16x64xbf16>
  return
}

// -----

// Tests that the patch_embed weight has as many input channels as the
// latents.

func.func @patch_embed_channels(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x4x1x2x2xbf16>, %b: tensor<64xbf16>) {
  // expected-error @below {{weight has 4 input channels but the latents have 16}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x4x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that a patch_embed weight without output channels is rejected
// (its FLOP count divides by them).

func.func @patch_embed_no_channels(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<0x16x1x2x2xbf16>, %b: tensor<0xbf16>) {
  // expected-error @below {{weight [0, 16, 1, 2, 2] must have at least one output channel}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<0x16x1x2x2xbf16>, tensor<0xbf16>) -> tensor<1x32x0xbf16>
  return
}

// -----

// Tests that the patch_embed bias has one entry per output channel.

func.func @patch_embed_bias(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<32xbf16>) {
  // expected-error @below {{'bias' has shape [32] but expected [64]}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<32xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the latent extents must be divisible by the patch.

func.func @patch_embed_divisible(%x: tensor<1x16x2x9x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>) {
  // expected-error @below {{latent extents [2, 9, 8] are not divisible by the patch [1, 2, 2]}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x9x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that patch_embed yields one token per patch.

func.func @patch_embed_result(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>) {
  // expected-error @below {{'result' has shape [1, 16, 64] but expected [1, 32, 64]}}
  %t = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x16x64xbf16>
  return
}

// -----

// Tests that patch_embed_grad checks the token gradient against the
// latents and the weight gradient.

func.func @patch_embed_grad_tokens(%x: tensor<1x16x2x8x8xbf16>, %dy: tensor<1x32x32xbf16>) {
  // expected-error @below {{'result_grad' has shape [1, 32, 32] but expected [1, 32, 64]}}
  %dw, %db = megaslide.patch_embed_grad %x, %dy
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x32xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests that the patch_embed_grad weight gradient has the latents'
// input channels.

func.func @patch_embed_grad_channels(%x: tensor<1x16x2x8x8xbf16>, %dy: tensor<1x32x64xbf16>) {
  // expected-error @below {{weight_grad has 8 input channels but the latents have 16}}
  %dw, %db = megaslide.patch_embed_grad %x, %dy
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x8x1x2x2xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests that unpatchify takes tokens of rank 3.

func.func @unpatchify_rank(%t: tensor<32x64xbf16>) {
  // expected-error @below {{'tokens' must have rank 3 [B, N, pt*ph*pw*C], got [32, 64]}}
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that unpatchify's tokens carry one patch of every channel.

func.func @unpatchify_tokens(%t: tensor<1x32x32xbf16>) {
  // expected-error @below {{'tokens' has shape [1, 32, 32] but expected [1, 32, 64]}}
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x32xbf16> -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that the unpatchify grid times the patch gives the latent extents.

func.func @unpatchify_grid(%t: tensor<1x32x64xbf16>) {
  // expected-error @below {{grid [2, 2, 8] times patch [1, 2, 2] does not give latents [2, 8, 8]}}
  %y = megaslide.unpatchify %t {grid = array<i64: 2, 2, 8>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that patchify takes 5-D latents.

func.func @patchify_rank(%y: tensor<16x2x8x8xbf16>) {
  // expected-error @below {{'latents' must have rank 5 [B, C, T, H, W], got [16, 2, 8, 8]}}
  %t = megaslide.patchify %y {patch = array<i64: 1, 2, 2>} : tensor<16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that patchify rejects a non-positive patch.

func.func @patchify_patch(%y: tensor<1x16x2x8x8xbf16>) {
  // expected-error @below {{latent extents [2, 8, 8] are not divisible by the patch [1, 0, 2]}}
  %t = megaslide.patchify %y {patch = array<i64: 1, 0, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that patch attributes are triples.

func.func @patchify_triple(%y: tensor<1x16x2x8x8xbf16>) {
  // expected-error @below {{attribute 'patch' failed to satisfy constraint}}
  %t = megaslide.patchify %y {patch = array<i64: 2, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that timestep_embedding yields one row per timestep.

func.func @timestep_batch(%t: tensor<2xf32>) {
  // expected-error @below {{result batch 3 does not match 2 timesteps}}
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<3x256xbf16>
  return
}

// -----

// Tests that timestep_embedding needs an even width (cos and sin halves).

func.func @timestep_odd(%t: tensor<2xf32>) {
  // expected-error @below {{embedding width must be positive and even, got 255}}
  %e = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x255xbf16>
  return
}

// -----

// Tests that timestep_embedding needs a max_period above 1.

func.func @timestep_period(%t: tensor<2xf32>) {
  // expected-error @below {{max_period must exceed 1, got 1.000000e+00}}
  %e = megaslide.timestep_embedding %t {max_period = 1.0 : f64} : tensor<2xf32> -> tensor<2x256xbf16>
  return
}

// -----

// Tests that timestep_embedding takes a vector of timesteps.

func.func @timestep_rank(%t: tensor<2x1xf32>) {
  // expected-error @below {{'timesteps' must have rank 1 [B], got [2, 1]}}
  %e = megaslide.timestep_embedding %t : tensor<2x1xf32> -> tensor<2x256xbf16>
  return
}

// -----

// Tests that embedding yields one table row per id.

func.func @embedding_result(%ids: tensor<2xi64>, %table: tensor<10x64xbf16>) {
  // expected-error @below {{'result' has shape [2, 32] but expected [2, 64]}}
  %y = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<10x64xbf16>) -> tensor<2x32xbf16>
  return
}

// -----

// Tests that the embedding table is 2-D.

func.func @embedding_table(%ids: tensor<2xi64>, %table: tensor<640xbf16>) {
  // expected-error @below {{'table' must have rank 2 [V, D], got [640]}}
  %y = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<640xbf16>) -> tensor<2x64xbf16>
  return
}

// -----

// Tests that embedding_grad takes one row gradient per id.

func.func @embedding_grad_rows(%ids: tensor<2xi64>, %dy: tensor<3x64xbf16>) {
  // expected-error @below {{'result_grad' has shape [3, 64] but expected [2, 64]}}
  %dt = megaslide.embedding_grad %ids, %dy : (tensor<2xi64>, tensor<3x64xbf16>) -> tensor<10x64xbf16>
  return
}

// -----

//===----------------------------------------------------------------------===//
// Dense layers, norms, activations
//===----------------------------------------------------------------------===//

// Tests that the linear input ends in the weight's in-features.

func.func @linear_in(%x: tensor<1x32x48xbf16>, %w: tensor<256x64xbf16>) {
  // expected-error @below {{input [1, 32, 48] does not end in the weight's in-features 64}}
  %y = megaslide.linear %x, %w : (tensor<1x32x48xbf16>, tensor<256x64xbf16>) -> tensor<1x32x256xbf16>
  return
}

// -----

// Tests that the linear weight is 2-D.

func.func @linear_weight(%x: tensor<1x32x64xbf16>, %w: tensor<64xbf16>) {
  // expected-error @below {{'weight' must have rank 2 [out, in], got [64]}}
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the linear bias has one entry per out-feature.

func.func @linear_bias(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>, %b: tensor<64xbf16>) {
  // expected-error @below {{'bias' has shape [64] but expected [256]}}
  %y = megaslide.linear %x, %w, %b
      : (tensor<1x32x64xbf16>, tensor<256x64xbf16>, tensor<64xbf16>) -> tensor<1x32x256xbf16>
  return
}

// -----

// Tests that the linear result replaces the last dimension by the
// out-features.

func.func @linear_result(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>) {
  // expected-error @below {{'result' has shape [1, 32, 64] but expected [1, 32, 256]}}
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that linear does not mix element types.

func.func @linear_types(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xf32>) {
  // expected-error @below {{mixes element types 'bf16' and 'f32'; insert megaslide.cast}}
  %y = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<256x64xf32>) -> tensor<1x32x256xbf16>
  return
}

// -----

// Tests that linear_grad_data's result gradient ends in the out-features.

func.func @linear_grad_data_dy(%dy: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>) {
  // expected-error @below {{result_grad [1, 32, 64] does not end in the weight's out-features 256}}
  %dx = megaslide.linear_grad_data %dy, %w
      : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that linear_grad_data yields an input gradient of the input's shape.

func.func @linear_grad_data_dx(%dy: tensor<1x32x256xbf16>, %w: tensor<256x64xbf16>) {
  // expected-error @below {{'input_grad' has shape [1, 32, 256] but expected [1, 32, 64]}}
  %dx = megaslide.linear_grad_data %dy, %w
      : (tensor<1x32x256xbf16>, tensor<256x64xbf16>) -> tensor<1x32x256xbf16>
  return
}

// -----

// Tests that linear_grad_params' input and result gradient share their
// leading dimensions.

func.func @linear_grad_params_leading(%x: tensor<1x16x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  // expected-error @below {{input [1, 16, 64] and result_grad [1, 32, 256] differ in leading dimensions}}
  %dw = megaslide.linear_grad_params %x, %dy
      : (tensor<1x16x64xbf16>, tensor<1x32x256xbf16>) -> tensor<256x64xbf16>
  return
}

// -----

// Tests that linear_grad_params yields a weight gradient [out, in].

func.func @linear_grad_params_weight(%x: tensor<1x32x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  // expected-error @below {{'weight_grad' has shape [64, 256] but expected [256, 64]}}
  %dw = megaslide.linear_grad_params %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> tensor<64x256xbf16>
  return
}

// -----

// Tests that linear_grad_params yields a bias gradient [out].

func.func @linear_grad_params_bias(%x: tensor<1x32x64xbf16>, %dy: tensor<1x32x256xbf16>) {
  // expected-error @below {{'bias_grad' has shape [64] but expected [256]}}
  %dw, %db = megaslide.linear_grad_params %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests that layer_norm takes both affine operands or none.

func.func @layer_norm_one_affine(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // expected-error @below {{takes either no affine operands or both gamma and beta, got 1}}
  %y = megaslide.layer_norm %x, %g : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the layer_norm affine operands are per channel.

func.func @layer_norm_affine_shape(%x: tensor<1x32x64xbf16>, %g: tensor<32xbf16>) {
  // expected-error @below {{'affine' has shape [32] but expected [64]}}
  %y = megaslide.layer_norm %x, %g, %g
      : (tensor<1x32x64xbf16>, tensor<32xbf16>, tensor<32xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that a rank-0 input to a norm is rejected, not a crash.

func.func @layer_norm_scalar(%x: tensor<bf16>, %g: tensor<1xbf16>) {
  // expected-error @below {{'input' must have rank >= 1 to normalise over its last dimension, got []}}
  %y = megaslide.layer_norm %x, %g, %g : (tensor<bf16>, tensor<1xbf16>, tensor<1xbf16>) -> tensor<bf16>
  return
}

// -----

// Tests that layer_norm needs a positive eps.

func.func @layer_norm_eps(%x: tensor<1x32x64xbf16>) {
  // expected-error @below {{eps must be positive, got 0.000000e+00}}
  %y = megaslide.layer_norm %x {eps = 0.0 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that layer_norm keeps the input shape.

func.func @layer_norm_result(%x: tensor<1x32x64xbf16>) {
  // expected-error @below {{'result' has shape [32, 64] but expected [1, 32, 64]}}
  %y = megaslide.layer_norm %x : (tensor<1x32x64xbf16>) -> tensor<32x64xbf16>
  return
}

// -----

// Tests that layer_norm_grad returns one gradient per affine operand.

func.func @layer_norm_grad_count(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // expected-error @below {{returns one gradient per affine operand: expected 2, got 0}}
  %dx = megaslide.layer_norm_grad %x, %x, %g, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that layer_norm_grad takes both affine operands or none.

func.func @layer_norm_grad_one_affine(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // expected-error @below {{takes either no affine operands or both gamma and beta, got 1}}
  %dx, %dg = megaslide.layer_norm_grad %x, %x, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests that layer_norm_grad's result gradient has the input's shape.

func.func @layer_norm_grad_dy(%x: tensor<1x32x64xbf16>, %dy: tensor<1x16x64xbf16>) {
  // expected-error @below {{'result_grad' has shape [1, 16, 64] but expected [1, 32, 64]}}
  %dx = megaslide.layer_norm_grad %x, %dy
      : (tensor<1x32x64xbf16>, tensor<1x16x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that rms_norm's gamma is per channel.

func.func @rms_norm_gamma(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xbf16>) {
  // expected-error @below {{'gamma' has shape [1, 64] but expected [64]}}
  %y = megaslide.rms_norm %x, %g : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that a rank-0 input to rms_norm is rejected, not a crash.

func.func @rms_norm_scalar(%x: tensor<bf16>, %g: tensor<1xbf16>) {
  // expected-error @below {{'input' must have rank >= 1 to normalise over its last dimension, got []}}
  %y = megaslide.rms_norm %x, %g : (tensor<bf16>, tensor<1xbf16>) -> tensor<bf16>
  return
}

// -----

// Tests that rms_norm_grad returns a gamma gradient exactly when gamma is
// given.

func.func @rms_norm_grad_gamma(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // expected-error @below {{returns a gamma gradient exactly when gamma is given}}
  %dx = megaslide.rms_norm_grad %x, %x, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the rms_norm_grad gamma gradient is per channel.

func.func @rms_norm_grad_gamma_shape(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // expected-error @below {{'gamma_grad' has shape [32] but expected [64]}}
  %dx, %dg = megaslide.rms_norm_grad %x, %x, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<32xbf16>)
  return
}

// -----

// Tests that rms_norm_grad's input gradient has the input's shape.

func.func @rms_norm_grad_dx(%x: tensor<1x32x64xbf16>) {
  // expected-error @below {{'input_grad' has shape [1, 32, 32] but expected [1, 32, 64]}}
  %dx = megaslide.rms_norm_grad %x, %x {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x32xbf16>
  return
}

// -----

// Tests that modulate takes tokens [B, N, D].

func.func @modulate_rank(%x: tensor<32x64xbf16>, %s: tensor<1x64xbf16>) {
  // expected-error @below {{'input' must have rank 3 [B, N, D], got [32, 64]}}
  %y = megaslide.modulate %x, %s, %s
      : (tensor<32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<32x64xbf16>
  return
}

// -----

// Tests that modulate's shift is per sample and channel.

func.func @modulate_shift(%x: tensor<1x32x64xbf16>, %shift: tensor<64xbf16>, %scale: tensor<1x64xbf16>) {
  // expected-error @below {{'shift' has shape [64] but expected [1, 64]}}
  %y = megaslide.modulate %x, %shift, %scale
      : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that modulate_grad's scale gradient is per sample and channel.

func.func @modulate_grad_scale(%x: tensor<1x32x64xbf16>, %s: tensor<1x64xbf16>) {
  // expected-error @below {{'scale_grad' has shape [1, 32, 64] but expected [1, 64]}}
  %dx, %dshift, %dscale = megaslide.modulate_grad %x, %s, %x
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
  return
}

// -----

// Tests that the gate is per sample and channel.

func.func @gate_shape(%x: tensor<2x32x64xbf16>, %g: tensor<1x64xbf16>) {
  // expected-error @below {{'gate' has shape [1, 64] but expected [2, 64]}}
  %y = megaslide.gate %x, %g : (tensor<2x32x64xbf16>, tensor<1x64xbf16>) -> tensor<2x32x64xbf16>
  return
}

// -----

// Tests that gate_grad's input gradient has the input's shape.

func.func @gate_grad_dx(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xbf16>, %dx: tensor<1x64xbf16>) {
  // expected-error @below {{'input_grad' has shape [1, 64] but expected [1, 32, 64]}}
  %a, %b = megaslide.gate_grad %x, %g, %x
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x64xbf16>, tensor<1x64xbf16>)
  return
}

// -----

// Tests that gate does not mix element types.

func.func @gate_types(%x: tensor<1x32x64xbf16>, %g: tensor<1x64xf32>) {
  // expected-error @below {{mixes element types 'bf16' and 'f32'; insert megaslide.cast}}
  %y = megaslide.gate %x, %g : (tensor<1x32x64xbf16>, tensor<1x64xf32>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the bias of bias_add is a suffix of the input shape.

func.func @bias_add_suffix(%x: tensor<2x384xbf16>, %b: tensor<2xbf16>) {
  // expected-error @below {{bias shape [2] is not a suffix of [2, 384]}}
  %y = megaslide.bias_add %x, %b : (tensor<2x384xbf16>, tensor<2xbf16>) -> tensor<2x384xbf16>
  return
}

// -----

// Tests that bias_add keeps the input shape.

func.func @bias_add_result(%x: tensor<2x384xbf16>, %b: tensor<384xbf16>) {
  // expected-error @below {{'result' has shape [384] but expected [2, 384]}}
  %y = megaslide.bias_add %x, %b : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<384xbf16>
  return
}

// -----

// Tests that bias_add_grad reduces to a suffix of the gradient's shape.

func.func @bias_add_grad_suffix(%dy: tensor<2x384xbf16>) {
  // expected-error @below {{bias shape [1, 2, 384] is not a suffix of [2, 384]}}
  %db = megaslide.bias_add_grad %dy : tensor<2x384xbf16> -> tensor<1x2x384xbf16>
  return
}

// -----

// Tests that add takes operands of one type (an ODS trait).

func.func @add_types(%a: tensor<4xbf16>, %b: tensor<4xf32>) {
  // expected-error @below {{requires the same type for all operands and results}}
  %y = "megaslide.add"(%a, %b) : (tensor<4xbf16>, tensor<4xf32>) -> tensor<4xbf16>
  return
}

// -----

//===----------------------------------------------------------------------===//
// Attention
//===----------------------------------------------------------------------===//

// Tests that rope3d takes [B, N, H, Dh].

func.func @rope_rank(%q: tensor<1x32x64xbf16>) {
  // expected-error @below {{'input' must have rank 4 [B, N, H, Dh], got [1, 32, 64]}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>} : tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the rope3d grid covers the tokens.

func.func @rope_grid(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{token count 32 does not match grid [2, 4, 2]}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 2>, dims = array<i64: 8, 4, 4>} : tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that rope3d rotates channel pairs, so each part is even.

func.func @rope_odd(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{dims [6, 5, 5] must be even and sum to the head dim 16}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 6, 5, 5>} : tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that the rope3d parts sum to the head dim.

func.func @rope_sum(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{dims [4, 4, 4] must be even and sum to the head dim 16}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 4, 4>} : tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that rope3d needs theta above 1.

func.func @rope_theta(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{theta must exceed 1}}
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, theta = 0.5 : f64} : tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that attention's query and key agree in batch, heads and head dim.

func.func @attention_heads(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x2x16xbf16>) {
  // expected-error @below {{query [1, 32, 4, 16] and key [1, 8, 2, 16] differ in batch, heads or head dim}}
  %o = megaslide.attention %q, %k, %k
      : (tensor<1x32x4x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that attention's key is [B, N, H, Dh].

func.func @attention_key_rank(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x64xbf16>) {
  // expected-error @below {{'key' must have rank 4 [B, N, H, Dh], got [1, 8, 64]}}
  %o = megaslide.attention %q, %k, %k
      : (tensor<1x32x4x16xbf16>, tensor<1x8x64xbf16>, tensor<1x8x64xbf16>) -> tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that attention's value has the key's shape.

func.func @attention_value(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>, %v: tensor<1x16x4x16xbf16>) {
  // expected-error @below {{'value' has shape [1, 16, 4, 16] but expected [1, 8, 4, 16]}}
  %o = megaslide.attention %q, %k, %v
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x16x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that attention's result has the query's shape.

func.func @attention_result(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>) {
  // expected-error @below {{'result' has shape [1, 8, 4, 16] but expected [1, 32, 4, 16]}}
  %o = megaslide.attention %q, %k, %k
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x8x4x16xbf16>
  return
}

// -----

// Tests that attention does not mix element types.

func.func @attention_types(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xf32>) {
  // expected-error @below {{mixes element types 'bf16' and 'f32'; insert megaslide.cast}}
  %o = megaslide.attention %q, %k, %k
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>) -> tensor<1x32x4x16xbf16>
  return
}

// -----

// Tests that attention_grad's key gradient has the key's shape.

func.func @attention_grad_dk(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>) {
  // expected-error @below {{'key_grad' has shape [1, 32, 4, 16] but expected [1, 8, 4, 16]}}
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %k, %q, %q
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return
}

// -----

// Tests that attention_grad's output has the query's shape.

func.func @attention_grad_output(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>) {
  // expected-error @below {{'output' has shape [1, 8, 4, 16] but expected [1, 32, 4, 16]}}
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %k, %k, %q
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x8x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return
}

// -----

// Tests that a 3D-DSA window no larger than the grid is required.

func.func @dsa_window(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x3x2xi32>) {
  // expected-error @below {{window extent 3 along t exceeds the grid extent 2; use a window of at most the grid}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 3, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x3x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that a spatial 3D-DSA window larger than the grid is rejected.

func.func @dsa_window_x(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{window extent 5 along x exceeds the grid extent 4}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 5>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that 3D-DSA grid, window and tile are positive.

func.func @dsa_tile(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{grid, window and tile must be positive, got grid [2, 4, 4], window [2, 2, 2], tile [1, 0, 2]}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 0, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that the 3D-DSA grid covers the tokens.

func.func @dsa_tokens(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{token count 32 does not match grid [2, 4, 8] (64 tokens)}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 8>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that the 3D-DSA offsets are [B, H, tiles_t, tiles_y, tiles_x, kt, 2].

func.func @dsa_offsets(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2xi32>) {
  // expected-error @below {{'offsets' has shape [1, 4, 2, 2, 2, 2] but expected [1, 4, 2, 2, 2, 2, 2]}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that the 3D-DSA offsets count partial tiles (ceil division).

func.func @dsa_offsets_ceil(%q: tensor<1x48x4x16xbf16>, %off: tensor<1x4x3x1x1x2x2xi32>) {
  // expected-error @below {{'offsets' has shape [1, 4, 3, 1, 1, 2, 2] but expected [1, 4, 2, 1, 1, 2, 2]}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 3, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 4, 4>}
      : (tensor<1x48x4x16xbf16>, tensor<1x48x4x16xbf16>, tensor<1x48x4x16xbf16>,
         tensor<1x4x3x1x1x2x2xi32>) -> (tensor<1x48x4x16xbf16>, tensor<1x4x48xf32>)
  return
}

// -----

// Tests that 3D-DSA is self-attention: the key has the query's shape.

func.func @dsa_key(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{'key' has shape [1, 8, 4, 16] but expected [1, 32, 4, 16]}}
  %o, %lse = megaslide.dsa3d %q, %k, %k, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that 3D-DSA takes [B, N, H, Dh].

func.func @dsa_rank(%q: tensor<32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{'query' must have rank 4 [B, N, H, Dh], got [32, 4, 16]}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<32x4x16xbf16>, tensor<32x4x16xbf16>, tensor<32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<32x4x16xbf16>, tensor<1x4x32xf32>)
  return
}

// -----

// Tests that dsa3d_grad's value gradient has the query's shape.

func.func @dsa_grad_dv(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                        %lse: tensor<1x4x32xf32>, %bad: tensor<1x32x4x8xbf16>) {
  // expected-error @below {{'value_grad' has shape [1, 32, 4, 8] but expected [1, 32, 4, 16]}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x8xbf16>)
  return
}

// -----

// Tests that dsa3d_grad checks its window like dsa3d.

func.func @dsa_grad_window(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                           %lse: tensor<1x4x32xf32>) {
  // expected-error @below {{window extent 8 along y exceeds the grid extent 4}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 8, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that the 3D-DSA log-sum-exp is [B, H, N], not the token-major
// [B, N, H] of the query.

func.func @dsa_lse_shape(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{'lse' has shape [1, 32, 4] but expected [1, 4, 32]}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x32x4xf32>)
  return
}

// -----

// Tests that the 3D-DSA log-sum-exp stays fp32 whatever q's precision.

func.func @dsa_lse_type(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  // expected-error @below {{result #1 must be ranked tensor of 32-bit float values, but got 'tensor<1x4x32xbf16>'}}
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xbf16>)
  return
}

// -----

// Tests that dsa3d_grad checks the log-sum-exp it consumes like dsa3d
// (here one sample too many).

func.func @dsa_grad_lse_shape(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                              %lse: tensor<2x4x32xf32>) {
  // expected-error @below {{'lse' has shape [2, 4, 32] but expected [1, 4, 32]}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<2x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that dsa3d_grad takes an fp32 log-sum-exp, also when q is f16.

func.func @dsa_grad_lse_type(%q: tensor<1x32x4x16xf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                             %lse: tensor<1x4x32xf16>) {
  // expected-error @below {{operand #5 must be ranked tensor of 32-bit float values, but got 'tensor<1x4x32xf16>'}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xf16>, tensor<1x32x4x16xf16>, tensor<1x32x4x16xf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xf16>, tensor<1x4x32xf16>,
         tensor<1x32x4x16xf16>)
        -> (tensor<1x32x4x16xf16>, tensor<1x32x4x16xf16>, tensor<1x32x4x16xf16>)
  return
}

// -----

// Tests that the fp32 log-sum-exp is exempt from the same-element-type rule
// but the 16-bit tensors still share one type.

func.func @dsa_grad_mixed(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                          %lse: tensor<1x4x32xf32>, %do: tensor<1x32x4x16xf16>) {
  // expected-error @below {{mixes element types 'bf16' and 'f16'; insert megaslide.cast}}
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %do {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that dsa3d_offsets yields offsets of the expected shape.

func.func @dsa_offsets_result(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{'offsets' has shape [1, 4, 2, 2, 2, 1, 2] but expected [1, 4, 2, 2, 2, 2, 2]}}
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x1x2xi32>
  return
}

// -----

// Tests that the dsa3d_offsets search radius is non-negative.

func.func @dsa_offsets_radius(%q: tensor<1x32x4x16xbf16>) {
  // expected-error @below {{attribute 'radius' failed to satisfy constraint}}
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = -1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  return
}

// -----

//===----------------------------------------------------------------------===//
// Flow matching
//===----------------------------------------------------------------------===//

// Tests that flow_interpolate takes one timestep per sample.

func.func @flow_timesteps(%x: tensor<2x16x2x8x8xbf16>, %t: tensor<1xf32>) {
  // expected-error @below {{'timesteps' has shape [1] but expected [2]}}
  %xt = megaslide.flow_interpolate %x, %x, %t
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<2x16x2x8x8xbf16>
  return
}

// -----

// Tests that flow_interpolate's noise has the latents' shape.

func.func @flow_noise(%x: tensor<1x16x2x8x8xbf16>, %n: tensor<1x16x2x8x4xbf16>, %t: tensor<1xf32>) {
  // expected-error @below {{'noise' has shape [1, 16, 2, 8, 4] but expected [1, 16, 2, 8, 8]}}
  %xt = megaslide.flow_interpolate %x, %n, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x4xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that flow_interpolate's latents have a batch dimension.

func.func @flow_scalar(%x: tensor<bf16>, %t: tensor<1xf32>) {
  // expected-error @below {{latents must have a batch dimension}}
  %xt = megaslide.flow_interpolate %x, %x, %t : (tensor<bf16>, tensor<bf16>, tensor<1xf32>) -> tensor<bf16>
  return
}

// -----

// Tests that flow_interpolate keeps latents and noise in one precision.

func.func @flow_types(%x: tensor<1x16x2x8x8xbf16>, %n: tensor<1x16x2x8x8xf32>, %t: tensor<1xf32>) {
  // expected-error @below {{mixes element types 'bf16' and 'f32'; insert megaslide.cast}}
  %xt = megaslide.flow_interpolate %x, %n, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xf32>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that the prediction may not have fewer channels than the latents.

func.func @loss_channels(%p: tensor<1x8x2x8x8xbf16>, %x: tensor<1x16x2x8x8xbf16>) {
  // expected-error @below {{prediction [1, 8, 2, 8, 8] must match the latents [1, 16, 2, 8, 8] except for extra channels}}
  %l = megaslide.flow_matching_loss %p, %x, %x
      : (tensor<1x8x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  return
}

// -----

// Tests that the loss's noise has the latents' shape.

func.func @loss_noise(%x: tensor<1x16x2x8x8xbf16>, %n: tensor<2x16x2x8x8xbf16>) {
  // expected-error @below {{'noise' has shape [2, 16, 2, 8, 8] but expected [1, 16, 2, 8, 8]}}
  %l = megaslide.flow_matching_loss %x, %x, %n
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>) -> tensor<f32>
  return
}

// -----

// Tests that the loss is an fp32 scalar (an ODS type constraint).

func.func @loss_type(%x: tensor<1x16x2x8x8xbf16>) {
  // expected-error @below {{result #0 must be 0D tensor of 32-bit float values}}
  %l = megaslide.flow_matching_loss %x, %x, %x
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<bf16>
  return
}

// -----

// Tests that the loss gradient has the prediction's shape.

func.func @loss_grad_shape(%p: tensor<1x32x2x8x8xbf16>, %x: tensor<1x16x2x8x8xbf16>) {
  // expected-error @below {{'prediction_grad' has shape [1, 16, 2, 8, 8] but expected [1, 32, 2, 8, 8]}}
  %dp = megaslide.flow_matching_loss_grad %p, %x, %x
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x16x2x8x8xbf16>
  return
}

// -----

// Tests that loss weights are one per sample.

func.func @loss_weights_shape(%x: tensor<2x16x2x8x8xbf16>, %w: tensor<3xf32>) {
  // expected-error @below {{'weights' has shape [3] but expected [2]}}
  %l, %u = megaslide.flow_matching_loss %x, %x, %x weights %w
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<3xf32>) -> (tensor<f32>, tensor<f32>)
  return
}

// -----

// Tests that a weighted loss returns the unweighted loss too, and only a
// weighted one does.

func.func @loss_weights_results(%x: tensor<2x16x2x8x8xbf16>, %w: tensor<2xf32>) {
  // expected-error @below {{returns the unweighted loss exactly when it has weights}}
  %l = megaslide.flow_matching_loss %x, %x, %x weights %w
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> tensor<f32>
  return
}

// -----

func.func @loss_unweighted_results(%x: tensor<2x16x2x8x8xbf16>) {
  // expected-error @below {{returns the unweighted loss exactly when it has weights}}
  %l, %u = megaslide.flow_matching_loss %x, %x, %x
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>) -> (tensor<f32>, tensor<f32>)
  return
}

// -----

// Tests that the weights of the loss's gradient are fp32.

func.func @loss_grad_weights_type(%x: tensor<2x16x2x8x8xbf16>, %w: tensor<2xbf16>) {
  // expected-error @below {{operand #3 must be ranked tensor of 32-bit float values}}
  %dp = megaslide.flow_matching_loss_grad %x, %x, %x weights %w
      : (tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xbf16>) -> tensor<2x16x2x8x8xbf16>
  return
}

// -----

// Tests that an explicit softmax scale must be positive.
func.func @attention_negative_scale(%q: tensor<1x8x2x4xbf16>) -> tensor<1x8x2x4xbf16> {
  // expected-error @+1 {{scale must be positive and finite, got -1}}
  %o = megaslide.attention %q, %q, %q {scale = -1.0 : f64}
      : (tensor<1x8x2x4xbf16>, tensor<1x8x2x4xbf16>, tensor<1x8x2x4xbf16>) -> tensor<1x8x2x4xbf16>
  return %o : tensor<1x8x2x4xbf16>
}
