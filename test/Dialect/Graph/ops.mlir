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
  // CHECK-SAME: eps = 1.000000e-06 : f64
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
  // CHECK: %[[S6:.*]]:6 = megaslide.split %[[R]] : tensor<2x4x16xbf16> -> tensor<2x4x{{.*}}bf16>, tensor<2x4x{{.*}}bf16>
  // A split into one chunk is the identity.
  // CHECK: %[[S1:.*]] = megaslide.split %[[C]] : tensor<1x128xbf16> -> tensor<1x128xbf16>
  %s6:2 = megaslide.split %r : tensor<2x4x16xbf16> -> tensor<2x4x8xbf16>, tensor<2x4x8xbf16>
  %s1 = megaslide.split %c : tensor<1x128xbf16> -> tensor<1x128xbf16>
  // CHECK: return %[[S1]]
  return %s1 : tensor<1x128xbf16>
}
