// RUN: megaslide-opt %s --split-input-file --megaslide-plan-activations=policy=keep --verify-diagnostics | FileCheck %s --check-prefix=KEEP
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-activations=policy=recompute --verify-diagnostics | FileCheck %s --check-prefix=RECOMPUTE
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-activations=policy=offload --verify-diagnostics | FileCheck %s --check-prefix=OFFLOAD
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-activations --verify-diagnostics | FileCheck %s --check-prefix=AUTO
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-activations="gpu-mem=1KB gpu-reserve=1B" --verify-diagnostics | FileCheck %s --check-prefix=AUTO-1KB
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-activations=policy=sometimes 2>&1 | FileCheck %s --check-prefix=BADPOLICY
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-activations=gpu-mem=big 2>&1 | FileCheck %s --check-prefix=BADMEM
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-activations="policy=keep gpu-mem=big" 2>&1 | FileCheck %s --check-prefix=BADMEM

// RUN: megaslide-plan --model tiny --frames 5 --height 32 --width 32 --emit-mlir %t.tiny.mlir > %t.report
// RUN: megaslide-opt %t.tiny.mlir --megaslide-plan-residency --megaslide-plan-activations=policy=recompute | FileCheck %s --check-prefix=TINY-RECOMPUTE
// RUN: megaslide-opt %t.tiny.mlir --megaslide-plan-residency --megaslide-plan-activations=policy=offload | FileCheck %s --check-prefix=TINY-OFFLOAD
// RUN: megaslide-opt %t.tiny.mlir --megaslide-plan-residency --megaslide-plan-activations | FileCheck %s --check-prefix=TINY-AUTO
// BADPOLICY: for the --policy option: unknown value 'sometimes'; use one of keep, recompute, offload, auto
// A size is parsed where it is given, also when the policy is not auto
// and the pass would not read it.
// BADMEM: for the --gpu-mem option: 'big' is not a memory size

// Tests that each activation policy does what it says on a two-block step
// (linear + gelu per block). Block 1's checkpoint is block 0's output %a0:
// defined outside block 1 and read only by it. Block 0 reads only the
// batch argument, so it has no checkpoint to keep or offload.

// Keep changes nothing but records the policy and an empty checkpoint pool.
// KEEP-LABEL: module attributes {msched.activation_policy = ["keep", "keep"]}
// KEEP-NEXT:    msched.resource @checkpoint_pool host size(0) category("offloaded checkpoints")
// KEEP:         %[[H1:.*]] = megaslide.linear {{.*}}megaslide.layer = 1 : i64
// KEEP-NOT:     msched.checkpoint
// KEEP:         megaslide.flow_matching_loss
// KEEP-NEXT:    %[[G:.*]] = megaslide.flow_matching_loss_grad
// KEEP-NEXT:    megaslide.gelu_grad %[[H1]], %[[G]]

// Recompute: the checkpoint is marked with the block that reads it and
// stays on device; each block's forward (its loads and casts included) is
// cloned right before its first backward op and the backward reads the
// clones, including AdamW's master, which carry msched.recompute; clones
// nothing reads (the gelus) are dropped.
// RECOMPUTE-LABEL: module attributes {msched.activation_policy = ["recompute", "recompute"]}
// RECOMPUTE-NEXT:    msched.resource @checkpoint_pool host size(0) category("offloaded checkpoints")
// RECOMPUTE:         func.func @train_step(
// RECOMPUTE-SAME:        %[[X:[a-z0-9_]+]]: tensor<1x8x16xbf16>
// RECOMPUTE:         %[[H0:.*]] = megaslide.linear %[[X]], %{{.*}} {megaslide.layer = 0 : i64}
// RECOMPUTE-NEXT:    %[[A0:.*]] = megaslide.gelu %[[H0]] {megaslide.layer = 0 : i64, msched.checkpoint = 1 : i64}
// RECOMPUTE:         %[[H1:.*]] = megaslide.linear %[[A0]], %{{.*}} {megaslide.layer = 1 : i64}
// RECOMPUTE:         megaslide.flow_matching_loss
// RECOMPUTE-NEXT:    %[[G:.*]] = megaslide.flow_matching_loss_grad
// RECOMPUTE-NEXT:    %[[P1R:.*]] = megaslide.load @w1 {megaslide.layer = 1 : i64, msched.recompute}
// RECOMPUTE-NEXT:    %[[C1R:.*]] = megaslide.cast %[[P1R]] {megaslide.layer = 1 : i64, msched.recompute}
// RECOMPUTE-NEXT:    %[[H1R:.*]] = megaslide.linear %[[A0]], %[[C1R]] {megaslide.layer = 1 : i64, msched.recompute}
// RECOMPUTE-NEXT:    %[[GH1:.*]] = megaslide.gelu_grad %[[H1R]], %[[G]] {megaslide.layer = 1 : i64}
// RECOMPUTE-NEXT:    %[[DA0:.*]] = megaslide.linear_grad_data %[[GH1]], %[[C1R]]
// RECOMPUTE-NEXT:    %[[DW1:.*]] = megaslide.linear_grad_params %[[A0]], %[[GH1]]
// RECOMPUTE-NEXT:    %[[P0R:.*]] = megaslide.load @w0 {megaslide.layer = 0 : i64, msched.recompute}
// RECOMPUTE-NEXT:    %[[C0R:.*]] = megaslide.cast %[[P0R]] {megaslide.layer = 0 : i64, msched.recompute}
// RECOMPUTE-NEXT:    %[[H0R:.*]] = megaslide.linear %[[X]], %[[C0R]] {megaslide.layer = 0 : i64, msched.recompute}
// RECOMPUTE-NEXT:    megaslide.gelu_grad %[[H0R]], %[[DA0]] {megaslide.layer = 0 : i64}
// RECOMPUTE:         megaslide.adamw %[[P1R]], %[[DW1]]
// RECOMPUTE:         megaslide.adamw %[[P0R]],
// RECOMPUTE-NOT:     megaslide.gelu_grad %[[H1]]

// Offload: like recompute, and the checkpoint leaves for the host right
// after its last forward use (block 1's linear) and comes back right
// before block 1's recomputation, which reads the copy, as does the
// backward. The pool holds the one 1x8x16 bf16 checkpoint (256 B).
// OFFLOAD-LABEL: module attributes {msched.activation_policy = ["offload", "offload"]}
// OFFLOAD-NEXT:    msched.resource @checkpoint_pool host size(256) category("offloaded checkpoints")
// OFFLOAD:         %[[A0:.*]] = megaslide.gelu %{{.*}} {megaslide.layer = 0 : i64, msched.checkpoint = 1 : i64}
// OFFLOAD:         megaslide.linear %[[A0]], %{{.*}} {megaslide.layer = 1 : i64}
// OFFLOAD-NEXT:    %[[OUT:.*]] = msched.d2h %[[A0]] {megaslide.layer = 1 : i64} : tensor<1x8x16xbf16>
// OFFLOAD:         megaslide.flow_matching_loss
// OFFLOAD-NEXT:    %[[G:.*]] = megaslide.flow_matching_loss_grad
// OFFLOAD-NEXT:    %[[BACK:.*]] = msched.h2d %[[OUT]] {megaslide.layer = 1 : i64} : tensor<1x8x16xbf16>
// OFFLOAD-NEXT:    megaslide.load @w1
// OFFLOAD-NEXT:    %[[C1R:.*]] = megaslide.cast
// OFFLOAD-NEXT:    %[[H1R:.*]] = megaslide.linear %[[BACK]], %[[C1R]]
// OFFLOAD-NEXT:    %[[GH1:.*]] = megaslide.gelu_grad %[[H1R]], %[[G]]
// OFFLOAD-NEXT:    megaslide.linear_grad_data %[[GH1]], %[[C1R]]
// OFFLOAD-NEXT:    megaslide.linear_grad_params %[[BACK]], %[[GH1]]
// OFFLOAD-NOT:     msched.h2d

// Auto keeps everything when that fits the (default 141 GB) budget...
// AUTO-LABEL: module attributes {msched.activation_policy = ["keep", "keep"]}
// AUTO-NOT:     msched.checkpoint
// ...and offloads every checkpoint when even recomputation does not fit.
// AUTO-1KB-LABEL: module attributes {msched.activation_policy = ["offload", "offload"]}
// AUTO-1KB-NEXT:    msched.resource @checkpoint_pool host size(256)

// The same on the `tiny` model as megaslide-plan builds it (2 blocks).
// Block 0's checkpoint is the patch embedding, block 1's the output of
// block 0's second residual add.

// Recompute: after the loss, block 0's forward is cloned (its first norm
// reads the checkpoint again) and its backward reads the clone, never the
// forward original.
// TINY-RECOMPUTE-LABEL: module @tiny attributes {{.*}}msched.activation_policy = ["recompute", "recompute"]
// TINY-RECOMPUTE:         msched.resource @checkpoint_pool host size(0)
// TINY-RECOMPUTE:         %[[IN0:.*]] = megaslide.patch_embed {{.*}}msched.checkpoint = 0 : i64
// TINY-RECOMPUTE:         %[[LN0:.*]] = megaslide.layer_norm %[[IN0]] {megaslide.layer = 0 : i64}
// TINY-RECOMPUTE:         megaslide.add {{.*}}{megaslide.layer = 0 : i64, msched.checkpoint = 1 : i64}
// TINY-RECOMPUTE:         megaslide.flow_matching_loss
// TINY-RECOMPUTE:         megaslide.load @blocks.0.scale_shift_table {megaslide.layer = 0 : i64, msched.recompute}
// TINY-RECOMPUTE:         %[[LN0R:.*]] = megaslide.layer_norm %[[IN0]] {megaslide.layer = 0 : i64, msched.recompute}
// TINY-RECOMPUTE-NOT:     megaslide.modulate_grad %[[LN0]],
// TINY-RECOMPUTE:         megaslide.modulate_grad %[[LN0R]], {{.*}}{megaslide.layer = 0 : i64}

// Offload: each checkpoint goes to the host after its last forward use in
// its block (block 0: the first residual add) and comes back right before
// the block's recomputation, which reads the copy; the pool holds both
// 1x8x64 bf16 checkpoints.
// TINY-OFFLOAD-LABEL: module @tiny attributes {{.*}}msched.activation_policy = ["offload", "offload"]
// TINY-OFFLOAD:         msched.resource @checkpoint_pool host size(2048)
// TINY-OFFLOAD:         %[[IN0:.*]] = megaslide.patch_embed
// TINY-OFFLOAD:         megaslide.add %[[IN0]], %{{.*}} {megaslide.layer = 0 : i64}
// TINY-OFFLOAD-NEXT:    %[[OUT0:.*]] = msched.d2h %[[IN0]] {megaslide.layer = 0 : i64} : tensor<1x8x64xbf16>
// TINY-OFFLOAD:         %[[IN1:.*]] = megaslide.add {{.*}}msched.checkpoint = 1 : i64
// TINY-OFFLOAD:         %[[OUT1:.*]] = msched.d2h %[[IN1]] {megaslide.layer = 1 : i64}
// TINY-OFFLOAD:         megaslide.flow_matching_loss
// TINY-OFFLOAD:         %[[BACK1:.*]] = msched.h2d %[[OUT1]] {megaslide.layer = 1 : i64}
// TINY-OFFLOAD-NEXT:    megaslide.load @blocks.1.scale_shift_table
// TINY-OFFLOAD:         megaslide.layer_norm %[[BACK1]] {megaslide.layer = 1 : i64, msched.recompute}
// TINY-OFFLOAD:         %[[BACK0:.*]] = msched.h2d %[[OUT0]] {megaslide.layer = 0 : i64}
// TINY-OFFLOAD-NEXT:    megaslide.load @blocks.0.scale_shift_table
// TINY-OFFLOAD:         megaslide.layer_norm %[[BACK0]] {megaslide.layer = 0 : i64, msched.recompute}

// Auto: the tiny step fits 141 GB with everything kept.
// TINY-AUTO-LABEL: module @tiny attributes {{.*}}msched.activation_policy = ["keep", "keep"]
// TINY-AUTO-NOT:     msched.checkpoint

megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[0] @w0.exp_avg_sq of @w0 : tensor<16x16xf32>
megaslide.param moment blocks[1] @w1.exp_avg of @w1 : tensor<16x16xf32>
megaslide.param moment blocks[1] @w1.exp_avg_sq of @w1 : tensor<16x16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %p0 = megaslide.load @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %c0 = megaslide.cast %p0 {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %h0 = megaslide.linear %x, %c0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %a0 = megaslide.gelu %h0 {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
  %p1 = megaslide.load @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %c1 = megaslide.cast %p1 {megaslide.layer = 1 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %h1 = megaslide.linear %a0, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %a1 = megaslide.gelu %h1 {megaslide.layer = 1 : i64} : tensor<1x8x16xbf16>
  %loss = megaslide.flow_matching_loss %a1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
  %g = megaslide.flow_matching_loss_grad %a1, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
  %gh1 = megaslide.gelu_grad %h1, %g {megaslide.layer = 1 : i64} : tensor<1x8x16xbf16>
  %da0 = megaslide.linear_grad_data %gh1, %c1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
  %dw1 = megaslide.linear_grad_params %a0, %gh1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
  %gh0 = megaslide.gelu_grad %h0, %da0 {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
  %dw0 = megaslide.linear_grad_params %x, %gh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
  %m1 = megaslide.load @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %v1 = megaslide.load @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %np1, %nm1, %nv1 = megaslide.adamw %p1, %dw1, %m1, %v1, %step {megaslide.layer = 1 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np1, @w1 {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nm1, @w1.exp_avg {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  megaslide.store %nv1, @w1.exp_avg_sq {megaslide.layer = 1 : i64} : tensor<16x16xf32>
  %m0 = megaslide.load @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %v0 = megaslide.load @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %np0, %nm0, %nv0 = megaslide.adamw %p0, %dw0, %m0, %v0, %step {megaslide.layer = 0 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np0, @w0 {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nm0, @w0.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nv0, @w0.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  return %loss : tensor<f32>
}

// -----

// Tests that the step needs a loss to tell forward from backward.

func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  // expected-error @above {{the training step has no loss}}
  %y = megaslide.gelu %x {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
  return %y : tensor<1x8x16xbf16>
}
