// RUN: megaslide-opt %s --split-input-file --megaslide-insert-transfers --verify-diagnostics | FileCheck %s

// Tests that a two-block step (as the model builder emits it for `tiny`,
// shrunk to one linear per block) gets explicit crossings: the batch
// arguments the device reads are copied in with h2d, each load + cast of a
// master becomes one fetch in the working type (keeping its block), each
// AdamW becomes a d2h of its gradient followed at once by a host_adamw,
// placed right after the op producing the gradient (so the update overlaps
// the rest of the backward), moments are no longer loaded, nothing is
// stored, and the loss leaves through a d2h before the return.

// CHECK-LABEL: func.func @train_step(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[NOISE:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
// CHECK-NEXT:    %[[DX:.*]] = msched.h2d %[[X]] : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[DNOISE:.*]] = msched.h2d %[[NOISE]] : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[W0:.*]] = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    %[[B0:.*]] = msched.fetch @b0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
// CHECK-NEXT:    %[[H0:.*]] = megaslide.linear %[[DX]], %[[W0]], %[[B0]] {megaslide.layer = 0 : i64}
// CHECK-NEXT:    %[[W1:.*]] = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    %[[H1:.*]] = megaslide.linear %[[H0]], %[[W1]] {megaslide.layer = 1 : i64}
// CHECK-NEXT:    %[[LOSS:.*]] = megaslide.flow_matching_loss %[[H1]], %[[DX]], %[[DNOISE]]
// CHECK-NEXT:    %[[DH1:.*]] = megaslide.flow_matching_loss_grad %[[H1]], %[[DX]], %[[DNOISE]]
// CHECK-NEXT:    %[[DH0:.*]] = megaslide.linear_grad_data %[[DH1]], %[[W1]] {megaslide.layer = 1 : i64}
// CHECK-NEXT:    %[[DW1:.*]] = megaslide.linear_grad_params %[[H0]], %[[DH1]] {megaslide.layer = 1 : i64}
// CHECK-NEXT:    %[[HDW1:.*]] = msched.d2h %[[DW1]] {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    msched.host_adamw @w1, %[[HDW1]], %[[STEP]] {lr = 1.000000e-05 : f64, megaslide.layer = 1 : i64} : tensor<16x16xbf16>, tensor<i64>
// CHECK-NEXT:    %[[DW0:.*]], %[[DB0:.*]] = megaslide.linear_grad_params %[[DX]], %[[DH0]] {megaslide.layer = 0 : i64}
// Two updates of gradients of one op follow each other, in program order.
// CHECK-NEXT:    %[[HDW0:.*]] = msched.d2h %[[DW0]] {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    msched.host_adamw @w0, %[[HDW0]], %[[STEP]] {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64, weight_decay = 1.000000e-02 : f64} : tensor<16x16xbf16>, tensor<i64>
// CHECK-NEXT:    %[[HDB0:.*]] = msched.d2h %[[DB0]] {megaslide.layer = 0 : i64} : tensor<16xbf16>
// CHECK-NEXT:    msched.host_adamw @b0, %[[HDB0]], %[[STEP]] {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64} : tensor<16xbf16>, tensor<i64>
// CHECK-NEXT:    %[[HLOSS:.*]] = msched.d2h %[[LOSS]] : tensor<f32>
// CHECK-NEXT:    return %[[HLOSS]] : tensor<f32>
// CHECK-NOT:     megaslide.load
// CHECK-NOT:     megaslide.store
// CHECK-NOT:     megaslide.adamw

megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
megaslide.param master blocks[0] @b0 : tensor<16xf32>
megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg_sq of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @b0.exp_avg of @b0 : tensor<16xf32>
megaslide.param moment blocks[0] @b0.exp_avg_sq of @b0 : tensor<16xf32>
megaslide.param moment blocks[1] @w1.exp_avg of @w1 : tensor<16x16xf32>
megaslide.param moment blocks[1] @w1.exp_avg_sq of @w1 : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %p0 = megaslide.load @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %c0 = megaslide.cast %p0 {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %q0 = megaslide.load @b0 {megaslide.layer = 0 : i64} : tensor<16xf32>
  %e0 = megaslide.cast %q0 {megaslide.layer = 0 : i64} : tensor<16xf32> -> tensor<16xbf16>
  %h0 = megaslide.linear %x, %c0, %e0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  %p1 = megaslide.load @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %c1 = megaslide.cast %p1 {megaslide.layer = 1 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %h1 = megaslide.linear %h0, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %loss = megaslide.flow_matching_loss %h1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
  %dh1 = megaslide.flow_matching_loss_grad %h1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
  %dh0 = megaslide.linear_grad_data %dh1, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %dw1 = megaslide.linear_grad_params %h0, %dh1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
  %dw0, %db0 = megaslide.linear_grad_params %x, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
  %m1 = megaslide.load @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %v1 = megaslide.load @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %np1, %nm1, %nv1 = megaslide.adamw %p1, %dw1, %m1, %v1, %step {lr = 1.0e-05 : f64, megaslide.layer = 1 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np1, @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nm1, @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nv1, @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %m0 = megaslide.load @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %v0 = megaslide.load @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %np0, %nm0, %nv0 = megaslide.adamw %p0, %dw0, %m0, %v0, %step {lr = 1.0e-05 : f64, weight_decay = 0.01 : f64, megaslide.layer = 0 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np0, @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nm0, @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nv0, @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %mb = megaslide.load @b0.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  %vb = megaslide.load @b0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  %nb, %nmb, %nvb = megaslide.adamw %q0, %db0, %mb, %vb, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
      : tensor<16xf32>, tensor<16xbf16>, tensor<16xf32>, tensor<16xf32>, tensor<i64>
  megaslide.store %nb, @b0 {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nmb, @b0.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nvb, @b0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  return %loss : tensor<f32>
}

// -----

// Tests that a load used without a cast (a frozen bf16 buffer) becomes a
// fetch in the loaded type, that a load with both a cast use and a direct
// use gets one fetch per use in its type, and that arguments only the host
// reads (the step counter) are not copied in.

// CHECK-LABEL: func.func @train_step(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
// CHECK-NEXT:    %[[DX:.*]] = msched.h2d %[[X]] : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[POS:.*]] = msched.fetch @pos_embed : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[A:.*]] = megaslide.add %[[DX]], %[[POS]] : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[A32:.*]] = megaslide.cast %[[A]]
// Fetches are issued right before their use (schedule-overlap hoists them).
// CHECK-NEXT:    %[[G32:.*]] = msched.fetch @gamma : tensor<16xf32>
// CHECK-NEXT:    %{{.*}} = megaslide.rms_norm %[[A32]], %[[G32]]
// CHECK-NEXT:    %[[G16:.*]] = msched.fetch @gamma : tensor<16xbf16>
// CHECK-NEXT:    %[[M:.*]] = megaslide.rms_norm %[[A]], %[[G16]]
// Every returned value leaves the device, not only a scalar loss.
// CHECK-NEXT:    %[[HM:.*]] = msched.d2h %[[M]] : tensor<1x8x16xbf16>
// CHECK-NEXT:    return %[[HM]]
// CHECK-NOT:     megaslide.load

megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
megaslide.param master head @gamma : tensor<16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<1x8x16xbf16> {
  %pos = megaslide.load @pos_embed : tensor<1x8x16xbf16>
  %a = megaslide.add %x, %pos : tensor<1x8x16xbf16>
  %g = megaslide.load @gamma : tensor<16xf32>
  %a32 = megaslide.cast %a : tensor<1x8x16xbf16> -> tensor<1x8x16xf32>
  %n = megaslide.rms_norm %a32, %g : (tensor<1x8x16xf32>, tensor<16xf32>) -> tensor<1x8x16xf32>
  %gb = megaslide.cast %g : tensor<16xf32> -> tensor<16xbf16>
  %m = megaslide.rms_norm %a, %gb : (tensor<1x8x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  return %m : tensor<1x8x16xbf16>
}

// -----

// Tests that under persistent-bf16 a bf16 use of a master fetches its
// persistent copy `<name>.bf16` (no cast on the way), while an fp32 use
// still fetches the master.

// CHECK-LABEL: func.func @train_step(
// CHECK:         %[[W:.*]] = msched.fetch @w.bf16 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    megaslide.linear %{{.*}}, %[[W]] {megaslide.layer = 0 : i64}
// CHECK:         %[[G:.*]] = msched.fetch @gamma : tensor<16xf32>
// CHECK-NEXT:    megaslide.rms_norm %{{.*}}, %[[G]]

module attributes {msched.host_state_policy = "persistent-bf16"} {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param weight blocks[0] @w.bf16 of @w : tensor<16x16xbf16>
  megaslide.param master head @gamma : tensor<16xf32>
  megaslide.param weight head @gamma.bf16 of @gamma : tensor<16xbf16>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xf32> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %h32 = megaslide.cast %h : tensor<1x8x16xbf16> -> tensor<1x8x16xf32>
    %g = megaslide.load @gamma : tensor<16xf32>
    %n = megaslide.rms_norm %h32, %g : (tensor<1x8x16xf32>, tensor<16xf32>) -> tensor<1x8x16xf32>
    return %n : tensor<1x8x16xf32>
  }
}

// -----

// Tests that without the training step the pass fails with a pointer to
// the builder.

// expected-error @below {{planning needs a '@train_step' function}}
module {
  func.func @step() {
    return
  }
}
