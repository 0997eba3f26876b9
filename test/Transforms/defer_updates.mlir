// RUN: megaslide-opt %s --split-input-file --megaslide-defer-updates="update=deferred" | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-defer-updates="update=streaming" | FileCheck %s --check-prefix=STREAM
// RUN: megaslide-opt %s --split-input-file --megaslide-defer-updates="update=auto grad-accum=2 ema-dtype=bf16" | FileCheck %s --check-prefix=ACCUM
// RUN: megaslide-opt %s --split-input-file --megaslide-defer-updates="update=auto host-mem=4.1KB" | FileCheck %s --check-prefix=AUTO

// Tests that update=deferred marks every host_adamw `deferred` and the
// first fetch in the step of each parameter it updates `applies_update`
// (the forward's, not the backward's refetch, and not the fetch of a
// frozen buffer), and declares the retained gradients in their type:
// (256 + 16) bf16 elements, 544 B. With update=streaming nothing is
// marked or declared. grad-accum=2 under auto defers, with an fp32
// accumulator of 272 x 4 = 1088 B instead of the retained gradients,
// and a bf16 EMA of 272 x 2 = 544 B. Under auto with host-mem 4.1KB the
// 3520 B of state and the 544 B retained fit (4064 of 4100 B); with
// 4KB they would not (test/Tools/megaslide-plan/recipe.test).

// CHECK:      msched.resource @retained_gradients host size(544) category("retained gradients")
// CHECK-LABEL: func.func @train_step(
// CHECK:        msched.fetch @w0 {applies_update, megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:   msched.fetch @b0 {applies_update, megaslide.layer = 0 : i64} : tensor<16xbf16>
// CHECK-NEXT:   msched.fetch @pos_embed : tensor<1x8x16xbf16>
// CHECK:        msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// CHECK:        msched.host_adamw @w0, %{{.*}}, %{{.*}} {deferred, lr = 1.000000e-05 : f64} : tensor<16x16xbf16>, tensor<i64>
// CHECK:        msched.host_adamw @b0, %{{.*}}, %{{.*}} {deferred} : tensor<16xbf16>, tensor<i64>

// STREAM-NOT:  msched.resource
// STREAM-NOT:  applies_update
// STREAM-NOT:  deferred

// ACCUM:       msched.resource @gradient_accumulator host size(1088) category("gradient accumulator (fp32)")
// ACCUM-NEXT:  msched.resource @ema_weights host size(544) category("EMA weights (bf16)")
// ACCUM:       msched.fetch @w0 {applies_update,

// AUTO:        msched.update = "deferred", msched.update_auto
// AUTO:        msched.fetch @w0 {applies_update,

megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
megaslide.param master blocks[0] @b0 : tensor<16xf32>
megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
megaslide.param moment blocks[0] @w0.exp_avg of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg_sq of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @b0.exp_avg of @b0 : tensor<16xf32>
megaslide.param moment blocks[0] @b0.exp_avg_sq of @b0 : tensor<16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
  %b0 = msched.fetch @b0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
  %pos = msched.fetch @pos_embed : tensor<1x8x16xbf16>
  %h0 = megaslide.linear %x, %w0, %b0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  %loss = megaslide.flow_matching_loss %h0, %pos, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
  %dh0 = megaslide.flow_matching_loss_grad %h0, %pos, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
  %w0r = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
  %dx = megaslide.linear_grad_data %dh0, %w0r {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %dw0, %db0 = megaslide.linear_grad_params %x, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
  %gw = msched.d2h %dw0 : tensor<16x16xbf16>
  msched.host_adamw @w0, %gw, %step {lr = 1.0e-05 : f64} : tensor<16x16xbf16>, tensor<i64>
  %gb = msched.d2h %db0 : tensor<16xbf16>
  msched.host_adamw @b0, %gb, %step : tensor<16xbf16>, tensor<i64>
  return %loss : tensor<f32>
}

// -----

// Tests that under a persistent bf16 copy the fetch of the copy applies
// the update of its master (the update refreshes the copy).

// CHECK-LABEL: func.func @train_step(
// CHECK:        msched.fetch @w.bf16 {applies_update} : tensor<16x16xbf16>
// CHECK:        msched.host_adamw @w, %{{.*}}, %{{.*}} {deferred}

megaslide.param master blocks[0] @w : tensor<16x16xf32>
megaslide.param weight blocks[0] @w.bf16 of @w : tensor<16x16xbf16>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<1x8x16xbf16> {
  %w = msched.fetch @w.bf16 : tensor<16x16xbf16>
  %h = megaslide.linear %x, %w : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %dw = megaslide.linear_grad_params %x, %h : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
  %g = msched.d2h %dw : tensor<16x16xbf16>
  msched.host_adamw @w, %g, %step : tensor<16x16xbf16>, tensor<i64>
  return %h : tensor<1x8x16xbf16>
}
