// RUN: megaslide-opt %s --split-input-file | megaslide-opt --split-input-file | FileCheck %s

// Round-trip of every op of the graph dialect: the printed form parses
// back to the same op, including optional operands, optional results and
// attributes with defaults.

// Tests that params of every role and group print back, with the block
// index, the `of` link of moments and gradients, and quoted dotted names
// printed bare.

// CHECK: megaslide.param weight blocks[0] @blocks.0.attn1.to_q.weight.bf16 : tensor<64x64xbf16>
// CHECK: megaslide.param master blocks[0] @blocks.0.attn1.to_q.weight : tensor<64x64xf32>
// CHECK: megaslide.param moment blocks[0] @blocks.0.attn1.to_q.weight.exp_avg of @blocks.0.attn1.to_q.weight : tensor<64x64xf32>
// CHECK: megaslide.param gradient blocks[12] @blocks.12.attn1.to_q.weight.grad of @blocks.12.attn1.to_q.weight : tensor<64x64xf32>
// CHECK: megaslide.param master blocks[12] @blocks.12.attn1.to_q.weight : tensor<64x64xf32>
// CHECK: megaslide.param master embeddings @patch_embedding.bias : tensor<64xf32>
// CHECK: megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>
// CHECK: megaslide.param master head @proj_out.weight : tensor<64x64xf32>
// CHECK-LABEL: func.func @params()
megaslide.param weight blocks[0] @"blocks.0.attn1.to_q.weight.bf16" : tensor<64x64xbf16>
megaslide.param master blocks[0] @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param moment blocks[0] @"blocks.0.attn1.to_q.weight.exp_avg" of @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param gradient blocks[12] @"blocks.12.attn1.to_q.weight.grad" of @"blocks.12.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param master blocks[12] @"blocks.12.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param master embeddings @"patch_embedding.bias" : tensor<64xf32>
megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>
megaslide.param master head @"proj_out.weight" : tensor<64x64xf32>
func.func @params() {
  return
}

// -----

// Tests that load, store and adamw round-trip, with adamw's default
// hyper-parameters elided and overridden ones printed.

megaslide.param master blocks[0] @w : tensor<64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<64xf32>

// CHECK-LABEL: func.func @load_store_adamw(
// CHECK-SAME:      %[[G:[a-z0-9_]+]]: tensor<64xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
func.func @load_store_adamw(%g: tensor<64xbf16>, %step: tensor<i64>) {
  // CHECK: %[[P:.*]] = megaslide.load @w : tensor<64xf32>
  // CHECK: %[[M:.*]] = megaslide.load @w.exp_avg : tensor<64xf32>
  // CHECK: %[[V:.*]] = megaslide.load @w.exp_avg_sq : tensor<64xf32>
  %p = megaslide.load @w : tensor<64xf32>
  %m = megaslide.load @w.exp_avg : tensor<64xf32>
  %v = megaslide.load @w.exp_avg_sq : tensor<64xf32>
  // CHECK: %[[P1:.*]], %[[M1:.*]], %[[V1:.*]] = megaslide.adamw %[[P]], %[[G]], %[[M]], %[[V]], %[[STEP]] :
  // CHECK-SAME: tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
  %p1, %m1, %v1 = megaslide.adamw %p, %g, %m, %v, %step
      : tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
  // CHECK: %[[P2:.*]], %[[M2:.*]], %[[V2:.*]] = megaslide.adamw %[[P1]], %[[G]], %[[M1]], %[[V1]], %[[STEP]]
  // CHECK-SAME: beta1 = 8.000000e-01 : f64
  // CHECK-SAME: beta2 = 0.94999999999999996 : f64
  // CHECK-SAME: eps = 9.9999999999999995E-7 : f64
  // CHECK-SAME: lr = 2.000000e-04 : f64
  // CHECK-SAME: weight_decay = 1.000000e-02 : f64
  %p2, %m2, %v2 = megaslide.adamw %p1, %g, %m1, %v1, %step
      {lr = 2.0e-04 : f64, beta1 = 0.8 : f64, beta2 = 0.95 : f64,
       eps = 1.0e-06 : f64, weight_decay = 0.01 : f64}
      : tensor<64xf32>, tensor<64xbf16>, tensor<64xf32>, tensor<64xf32>, tensor<i64>
  // CHECK: megaslide.store %[[P2]], @w : tensor<64xf32>
  // CHECK: megaslide.store %[[M2]], @w.exp_avg : tensor<64xf32>
  // CHECK: megaslide.store %[[V2]], @w.exp_avg_sq : tensor<64xf32>
  megaslide.store %p2, @w : tensor<64xf32>
  megaslide.store %m2, @w.exp_avg : tensor<64xf32>
  megaslide.store %v2, @w.exp_avg_sq : tensor<64xf32>
  return
}

// -----

// Tests that the structural ops cast, reshape, split, concat and zeros
// round-trip.

// CHECK-LABEL: func.func @structural(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x128xf32>)
func.func @structural(%x: tensor<1x128xf32>) -> tensor<1x128xbf16> {
  // CHECK: %[[C:.*]] = megaslide.cast %[[X]] : tensor<1x128xf32> -> tensor<1x128xbf16>
  %c = megaslide.cast %x : tensor<1x128xf32> -> tensor<1x128xbf16>
  // CHECK: %[[R:.*]] = megaslide.reshape %[[C]] : tensor<1x128xbf16> -> tensor<2x4x16xbf16>
  %r = megaslide.reshape %c : tensor<1x128xbf16> -> tensor<2x4x16xbf16>
  // CHECK: %[[S:.*]]:2 = megaslide.split %[[C]] : tensor<1x128xbf16> -> tensor<1x64xbf16>, tensor<1x64xbf16>
  %s:2 = megaslide.split %c : tensor<1x128xbf16> -> tensor<1x64xbf16>, tensor<1x64xbf16>
  // CHECK: %[[Z:.*]] = megaslide.zeros : tensor<1x32xbf16>
  %z = megaslide.zeros : tensor<1x32xbf16>
  // CHECK: %[[Y:.*]] = megaslide.concat %[[S]]#1, %[[Z]], %[[S]]#0 : tensor<1x64xbf16>, tensor<1x32xbf16>, tensor<1x64xbf16> -> tensor<1x160xbf16>
  %y = megaslide.concat %s#1, %z, %s#0 : tensor<1x64xbf16>, tensor<1x32xbf16>, tensor<1x64xbf16> -> tensor<1x160xbf16>
  // CHECK: %{{.*}}:2 = megaslide.split %[[R]] : tensor<2x4x16xbf16> -> tensor<2x4x8xbf16>, tensor<2x4x8xbf16>
  %s2:2 = megaslide.split %r : tensor<2x4x16xbf16> -> tensor<2x4x8xbf16>, tensor<2x4x8xbf16>
  // Pieces of unequal widths.
  // CHECK: %{{.*}}:2 = megaslide.split %[[R]] : tensor<2x4x16xbf16> -> tensor<2x4x3xbf16>, tensor<2x4x13xbf16>
  %s3:2 = megaslide.split %r : tensor<2x4x16xbf16> -> tensor<2x4x3xbf16>, tensor<2x4x13xbf16>
  // A split into one chunk has a single, unpacked result.
  // CHECK: %[[S1:.*]] = megaslide.split %[[C]] : tensor<1x128xbf16> -> tensor<1x128xbf16>
  %s1 = megaslide.split %c : tensor<1x128xbf16> -> tensor<1x128xbf16>
  // CHECK: return %[[S1]]
  return %s1 : tensor<1x128xbf16>
}

// -----

// Tests that the embedding ops patch_embed, patch_embed_grad, unpatchify,
// patchify, timestep_embedding, embedding and embedding_grad round-trip.

// CHECK-LABEL: func.func @embeddings(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x16x2x8x8xbf16>, %[[W:[a-z0-9_]+]]: tensor<64x16x1x2x2xbf16>, %[[B:[a-z0-9_]+]]: tensor<64xbf16>,
// CHECK-SAME:      %[[T:[a-z0-9_]+]]: tensor<2xf32>, %[[IDS:[a-z0-9_]+]]: tensor<2xi64>, %[[TABLE:[a-z0-9_]+]]: tensor<1001x64xbf16>)
func.func @embeddings(%x: tensor<1x16x2x8x8xbf16>, %w: tensor<64x16x1x2x2xbf16>, %b: tensor<64xbf16>,
                      %t: tensor<2xf32>, %ids: tensor<2xi64>, %table: tensor<1001x64xbf16>) {
  // CHECK: %[[TOK:.*]] = megaslide.patch_embed %[[X]], %[[W]], %[[B]] : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %tok = megaslide.patch_embed %x, %w, %b
      : (tensor<1x16x2x8x8xbf16>, tensor<64x16x1x2x2xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %[[DW:.*]], %[[DB:.*]] = megaslide.patch_embed_grad %[[X]], %[[TOK]] : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  %dw, %db = megaslide.patch_embed_grad %x, %tok
      : (tensor<1x16x2x8x8xbf16>, tensor<1x32x64xbf16>) -> (tensor<64x16x1x2x2xbf16>, tensor<64xbf16>)
  // CHECK: %[[LAT:.*]] = megaslide.unpatchify %[[TOK]] {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>} : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  %lat = megaslide.unpatchify %tok {grid = array<i64: 2, 4, 4>, patch = array<i64: 1, 2, 2>}
      : tensor<1x32x64xbf16> -> tensor<1x16x2x8x8xbf16>
  // CHECK: %{{.*}} = megaslide.patchify %[[LAT]] {patch = array<i64: 1, 2, 2>} : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  %tok2 = megaslide.patchify %lat {patch = array<i64: 1, 2, 2>}
      : tensor<1x16x2x8x8xbf16> -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}} = megaslide.timestep_embedding %[[T]] : tensor<2xf32> -> tensor<2x256xbf16>
  %e0 = megaslide.timestep_embedding %t : tensor<2xf32> -> tensor<2x256xbf16>
  // CHECK: %{{.*}} = megaslide.timestep_embedding %[[T]] {max_period = 5.000000e+03 : f64, time_scale = 1.000000e+03 : f64} : tensor<2xf32> -> tensor<2x256xf32>
  %e1 = megaslide.timestep_embedding %t {time_scale = 1000.0 : f64, max_period = 5000.0 : f64}
      : tensor<2xf32> -> tensor<2x256xf32>
  // CHECK: %[[ROWS:.*]] = megaslide.embedding %[[IDS]], %[[TABLE]] : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
  %rows = megaslide.embedding %ids, %table : (tensor<2xi64>, tensor<1001x64xbf16>) -> tensor<2x64xbf16>
  // CHECK: %{{.*}} = megaslide.embedding_grad %[[IDS]], %[[ROWS]] : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
  %dtable = megaslide.embedding_grad %ids, %rows : (tensor<2xi64>, tensor<2x64xbf16>) -> tensor<1001x64xbf16>
  return
}

// -----

// Tests that linear with and without a bias, linear_grad_data and
// linear_grad_params with and without a bias gradient round-trip.

// CHECK-LABEL: func.func @linear(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x32x64xbf16>, %[[W:[a-z0-9_]+]]: tensor<256x64xbf16>, %[[B:[a-z0-9_]+]]: tensor<256xbf16>)
func.func @linear(%x: tensor<1x32x64xbf16>, %w: tensor<256x64xbf16>, %b: tensor<256xbf16>) {
  // CHECK: %[[Y:.*]] = megaslide.linear %[[X]], %[[W]], %[[B]] : (tensor<1x32x64xbf16>, tensor<256x64xbf16>, tensor<256xbf16>) -> tensor<1x32x256xbf16>
  %y = megaslide.linear %x, %w, %b
      : (tensor<1x32x64xbf16>, tensor<256x64xbf16>, tensor<256xbf16>) -> tensor<1x32x256xbf16>
  // CHECK: %[[Y2:.*]] = megaslide.linear %[[X]], %[[W]] : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x256xbf16>
  %y2 = megaslide.linear %x, %w : (tensor<1x32x64xbf16>, tensor<256x64xbf16>) -> tensor<1x32x256xbf16>
  // CHECK: %{{.*}} = megaslide.linear_grad_data %[[Y]], %[[W]] : (tensor<1x32x256xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  %dx = megaslide.linear_grad_data %y, %w
      : (tensor<1x32x256xbf16>, tensor<256x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}}, %{{.*}} = megaslide.linear_grad_params %[[X]], %[[Y]] : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<256xbf16>)
  %dw, %db = megaslide.linear_grad_params %x, %y
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> (tensor<256x64xbf16>, tensor<256xbf16>)
  // CHECK: %{{.*}} = megaslide.linear_grad_params %[[X]], %[[Y2]] : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> tensor<256x64xbf16>
  %dw2 = megaslide.linear_grad_params %x, %y2
      : (tensor<1x32x64xbf16>, tensor<1x32x256xbf16>) -> tensor<256x64xbf16>
  return
}

// -----

// Tests that layer_norm and layer_norm_grad round-trip with and without
// the affine operands, and that eps prints only when not the default.

// CHECK-LABEL: func.func @layer_norm(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x32x64xbf16>, %[[G:[a-z0-9_]+]]: tensor<64xbf16>, %[[B:[a-z0-9_]+]]: tensor<64xbf16>)
func.func @layer_norm(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>, %b: tensor<64xbf16>) {
  // CHECK: %[[Y:.*]] = megaslide.layer_norm %[[X]] : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %y = megaslide.layer_norm %x {eps = 1.0e-06 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %[[Z:.*]] = megaslide.layer_norm %[[X]], %[[G]], %[[B]] {eps = 1.000000e-05 : f64} : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %z = megaslide.layer_norm %x, %g, %b {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}} = megaslide.layer_norm_grad %[[X]], %[[Y]] : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %dx = megaslide.layer_norm_grad %x, %y : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}}, %{{.*}}:2 = megaslide.layer_norm_grad %[[X]], %[[Z]], %[[G]], %[[B]] {eps = 1.000000e-05 : f64}
  // CHECK-SAME: : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
  %dx2, %dg, %db = megaslide.layer_norm_grad %x, %z, %g, %b {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<64xbf16>, tensor<64xbf16>)
  return
}

// -----

// Tests that rms_norm and rms_norm_grad round-trip with and without gamma.

// CHECK-LABEL: func.func @rms_norm(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x32x64xbf16>, %[[G:[a-z0-9_]+]]: tensor<64xbf16>)
func.func @rms_norm(%x: tensor<1x32x64xbf16>, %g: tensor<64xbf16>) {
  // CHECK: %[[Y:.*]] = megaslide.rms_norm %[[X]], %[[G]] : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  %y = megaslide.rms_norm %x, %g {eps = 1.0e-06 : f64}
      : (tensor<1x32x64xbf16>, tensor<64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %[[Z:.*]] = megaslide.rms_norm %[[X]] {eps = 1.000000e-05 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %z = megaslide.rms_norm %x {eps = 1.0e-05 : f64} : (tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}}, %{{.*}} = megaslide.rms_norm_grad %[[X]], %[[Y]], %[[G]] : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
  %dx, %dg = megaslide.rms_norm_grad %x, %y, %g
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>, tensor<64xbf16>) -> (tensor<1x32x64xbf16>, tensor<64xbf16>)
  // CHECK: %{{.*}} = megaslide.rms_norm_grad %[[X]], %[[Z]] {eps = 1.000000e-05 : f64} : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  %dx2 = megaslide.rms_norm_grad %x, %z {eps = 1.0e-05 : f64}
      : (tensor<1x32x64xbf16>, tensor<1x32x64xbf16>) -> tensor<1x32x64xbf16>
  return
}

// -----

// Tests that the adaLN ops modulate, modulate_grad, gate and gate_grad
// round-trip.

// CHECK-LABEL: func.func @adaln(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x32x64xbf16>, %[[SHIFT:[a-z0-9_]+]]: tensor<1x64xbf16>, %[[SCALE:[a-z0-9_]+]]: tensor<1x64xbf16>)
func.func @adaln(%x: tensor<1x32x64xbf16>, %shift: tensor<1x64xbf16>, %scale: tensor<1x64xbf16>) {
  // CHECK: %[[Y:.*]] = megaslide.modulate %[[X]], %[[SHIFT]], %[[SCALE]] : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %y = megaslide.modulate %x, %shift, %scale
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}}, %{{.*}}, %{{.*}} = megaslide.modulate_grad %[[X]], %[[SCALE]], %[[Y]]
  // CHECK-SAME: : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
  %dx, %dshift, %dscale = megaslide.modulate_grad %x, %scale, %y
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x64xbf16>)
  // CHECK: %[[G:.*]] = megaslide.gate %[[X]], %[[SHIFT]] : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  %g = megaslide.gate %x, %shift : (tensor<1x32x64xbf16>, tensor<1x64xbf16>) -> tensor<1x32x64xbf16>
  // CHECK: %{{.*}}, %{{.*}} = megaslide.gate_grad %[[X]], %[[SHIFT]], %[[G]]
  // CHECK-SAME: : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>) -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
  %dx2, %dgate = megaslide.gate_grad %x, %shift, %g
      : (tensor<1x32x64xbf16>, tensor<1x64xbf16>, tensor<1x32x64xbf16>)
        -> (tensor<1x32x64xbf16>, tensor<1x64xbf16>)
  return
}

// -----

// Tests that the activations gelu and silu, their gradients, add,
// bias_add and bias_add_grad round-trip.

// CHECK-LABEL: func.func @elementwise(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<2x384xbf16>, %[[T:[a-z0-9_]+]]: tensor<384xbf16>)
func.func @elementwise(%x: tensor<2x384xbf16>, %table: tensor<384xbf16>) -> tensor<384xbf16> {
  // CHECK: %[[G:.*]] = megaslide.gelu %[[X]] : tensor<2x384xbf16>
  %g = megaslide.gelu %x : tensor<2x384xbf16>
  // CHECK: %[[DG:.*]] = megaslide.gelu_grad %[[X]], %[[G]] : tensor<2x384xbf16>
  %dg = megaslide.gelu_grad %x, %g : tensor<2x384xbf16>
  // CHECK: %[[S:.*]] = megaslide.silu %[[DG]] : tensor<2x384xbf16>
  %s = megaslide.silu %dg : tensor<2x384xbf16>
  // CHECK: %[[DS:.*]] = megaslide.silu_grad %[[DG]], %[[S]] : tensor<2x384xbf16>
  %ds = megaslide.silu_grad %dg, %s : tensor<2x384xbf16>
  // CHECK: %[[A:.*]] = megaslide.add %[[DS]], %[[X]] : tensor<2x384xbf16>
  %a = megaslide.add %ds, %x : tensor<2x384xbf16>
  // CHECK: %[[BA:.*]] = megaslide.bias_add %[[A]], %[[T]] : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<2x384xbf16>
  %ba = megaslide.bias_add %a, %table : (tensor<2x384xbf16>, tensor<384xbf16>) -> tensor<2x384xbf16>
  // CHECK: %[[DB:.*]] = megaslide.bias_add_grad %[[BA]] : tensor<2x384xbf16> -> tensor<384xbf16>
  %db = megaslide.bias_add_grad %ba : tensor<2x384xbf16> -> tensor<384xbf16>
  // CHECK: return %[[DB]] : tensor<384xbf16>
  return %db : tensor<384xbf16>
}

// -----

// Tests that rope3d round-trips forward and `inverse` with a custom theta,
// and that global attention and its gradient round-trip with and without
// an explicit scale.

// CHECK-LABEL: func.func @attention(
// CHECK-SAME:      %[[Q:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[K:[a-z0-9_]+]]: tensor<1x8x4x16xbf16>, %[[V:[a-z0-9_]+]]: tensor<1x8x4x16xbf16>)
func.func @attention(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>, %v: tensor<1x8x4x16xbf16>) {
  // CHECK: %[[R:.*]] = megaslide.rope3d %[[Q]] {dims = array<i64: 8, 4, 4>, grid = array<i64: 2, 4, 4>} : tensor<1x32x4x16xbf16>
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>}
      : tensor<1x32x4x16xbf16>
  // CHECK: %[[RI:.*]] = megaslide.rope3d %[[R]] {dims = array<i64: 8, 4, 4>, grid = array<i64: 2, 4, 4>, inverse, theta = 5.000000e+05 : f64} : tensor<1x32x4x16xbf16>
  %ri = megaslide.rope3d %r {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, theta = 500000.0 : f64, inverse}
      : tensor<1x32x4x16xbf16>
  // CHECK: %[[O:.*]] = megaslide.attention %[[RI]], %[[K]], %[[V]] : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %o = megaslide.attention %ri, %k, %v
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  // CHECK: %[[O2:.*]] = megaslide.attention %[[Q]], %[[K]], %[[V]] {scale = 1.250000e-01 : f64} : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %o2 = megaslide.attention %q, %k, %v {scale = 0.125 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  // CHECK: %{{.*}}, %{{.*}}, %{{.*}} = megaslide.attention_grad %[[Q]], %[[K]], %[[V]], %[[O2]], %[[O]] {scale = 1.250000e-01 : f64}
  // CHECK-SAME: : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  // CHECK-SAME: -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %v, %o2, %o {scale = 0.125 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return
}

// -----

// Tests that the 3D-DSA ops dsa3d_offsets, dsa3d and dsa3d_grad round-trip
// with their grid, window, tile, radius and scale attributes, the forward's
// fp32 log-sum-exp [B, H, N] result and the backward's lse operand between
// the output and its gradient.

// CHECK-LABEL: func.func @dsa3d(
// CHECK-SAME:      %[[Q:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[K:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[V:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[DO:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>)
func.func @dsa3d(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>,
                 %do: tensor<1x32x4x16xbf16>) {
  // CHECK: %[[OFF:.*]] = megaslide.dsa3d_offsets %[[Q]], %[[K]] {grid = array<i64: 2, 4, 4>, radius = 1 : i64, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
  // CHECK-SAME: : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  %off = megaslide.dsa3d_offsets %q, %k {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  // CHECK: %[[O:[a-z0-9_]+]], %[[LSE:[a-z0-9_]+]] = megaslide.dsa3d %[[Q]], %[[K]], %[[V]], %[[OFF]] {grid = array<i64: 2, 4, 4>, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
  // CHECK-SAME: : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %o, %lse = megaslide.dsa3d %q, %k, %v, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  // CHECK: %{{.*}}, %{{.*}}, %{{.*}} = megaslide.dsa3d_grad %[[Q]], %[[K]], %[[V]], %[[OFF]], %[[O]], %[[LSE]], %[[DO]]
  // CHECK-SAME: {grid = array<i64: 2, 4, 4>, scale = 2.500000e-01 : f64, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
  // CHECK-SAME: : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>, tensor<1x32x4x16xbf16>)
  // CHECK-SAME: -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %k, %v, %off, %o, %lse, %do {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, scale = 0.25 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}

// -----

// Tests that the flow-matching ops round-trip, including a prediction with
// more channels than the latents (learned sigma).

// CHECK-LABEL: func.func @flow_matching(
// CHECK-SAME:      %[[X0:[a-z0-9_]+]]: tensor<1x16x2x8x8xbf16>, %[[N:[a-z0-9_]+]]: tensor<1x16x2x8x8xbf16>, %[[T:[a-z0-9_]+]]: tensor<1xf32>, %[[P:[a-z0-9_]+]]: tensor<1x32x2x8x8xbf16>)
func.func @flow_matching(%x0: tensor<1x16x2x8x8xbf16>, %noise: tensor<1x16x2x8x8xbf16>, %t: tensor<1xf32>,
                         %pred: tensor<1x32x2x8x8xbf16>) -> tensor<f32> {
  // CHECK: %[[XT:.*]] = megaslide.flow_interpolate %[[X0]], %[[N]], %[[T]] : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  %xt = megaslide.flow_interpolate %x0, %noise, %t
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1xf32>) -> tensor<1x16x2x8x8xbf16>
  // CHECK: %[[L:.*]] = megaslide.flow_matching_loss %[[XT]], %[[X0]], %[[N]] : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  %loss = megaslide.flow_matching_loss %xt, %x0, %noise
      : (tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<f32>
  // CHECK: %{{.*}} = megaslide.flow_matching_loss_grad %[[P]], %[[X0]], %[[N]] : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x32x2x8x8xbf16>
  %dp = megaslide.flow_matching_loss_grad %pred, %x0, %noise
      : (tensor<1x32x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>, tensor<1x16x2x8x8xbf16>) -> tensor<1x32x2x8x8xbf16>
  // CHECK: return %[[L]] : tensor<f32>
  return %loss : tensor<f32>
}

// -----

// Tests that the weighted loss round-trips: per-sample weights, and the
// unweighted loss as a second result (its results named only then).

// CHECK-LABEL: func.func @weighted_flow_matching(
// CHECK-SAME:      %[[X0:[a-z0-9_]+]]: tensor<2x16x2x8x8xbf16>, %[[N:[a-z0-9_]+]]: tensor<2x16x2x8x8xbf16>, %[[W:[a-z0-9_]+]]: tensor<2xf32>, %[[P:[a-z0-9_]+]]: tensor<2x32x2x8x8xbf16>)
func.func @weighted_flow_matching(%x0: tensor<2x16x2x8x8xbf16>, %noise: tensor<2x16x2x8x8xbf16>, %w: tensor<2xf32>,
                                  %pred: tensor<2x32x2x8x8xbf16>) -> (tensor<f32>, tensor<f32>) {
  // CHECK: %loss, %unweighted_loss = megaslide.flow_matching_loss %[[P]], %[[X0]], %[[N]] weights %[[W]] : (tensor<2x32x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> (tensor<f32>, tensor<f32>)
  %loss, %plain = megaslide.flow_matching_loss %pred, %x0, %noise weights %w
      : (tensor<2x32x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> (tensor<f32>, tensor<f32>)
  // CHECK: megaslide.flow_matching_loss_grad %[[P]], %[[X0]], %[[N]] weights %[[W]] : (tensor<2x32x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> tensor<2x32x2x8x8xbf16>
  %dp = megaslide.flow_matching_loss_grad %pred, %x0, %noise weights %w
      : (tensor<2x32x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2x16x2x8x8xbf16>, tensor<2xf32>) -> tensor<2x32x2x8x8xbf16>
  // CHECK: return %loss, %unweighted_loss : tensor<f32>, tensor<f32>
  return %loss, %plain : tensor<f32>, tensor<f32>
}
