// RUN: megaslide-opt %s --split-input-file --megaslide-schedule-overlap --verify-diagnostics | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-schedule-overlap=prefetch-distance=0 2>%t.d0 | FileCheck %s --check-prefix=NOPREFETCH
// RUN: FileCheck %s --check-prefix=NOPREFETCH-REMARK < %t.d0
// RUN: megaslide-opt %s --split-input-file --megaslide-schedule-overlap="prefetch-distance=2 buffers=2" 2>%t.buf | FileCheck %s --check-prefix=BUF
// RUN: FileCheck %s --check-prefix=BUF-REMARK < %t.buf
// RUN: not megaslide-opt %s --split-input-file --megaslide-schedule-overlap=buffers=0 2>&1 | FileCheck %s --check-prefix=RANGE
// RUN: megaslide-opt %s --split-input-file --megaslide-schedule-overlap=gradient-buffers=3 | FileCheck %s --check-prefix=RING
// RUN: not megaslide-opt %s --split-input-file --megaslide-schedule-overlap=gradient-buffers=0 2>&1 | FileCheck %s --check-prefix=RING-RANGE

// Inputs are training steps as insert-transfers leaves them. Streams print
// as their enum values: compute = 0, h2d = 1, d2h = 2, host = 3.

// RANGE: error: options 'buffers' (>= 1) and 'prefetch-distance' (>= 0) are out of range
// RING-RANGE: error: option 'gradient-buffers' is 0; it must be in [1, 64]

// BUF-REMARK: remark: prefetch-distance 2 needs 3 weight buffers; using 1 with buffers=2

// Tests that every op gets its stream (copies in on h2d, graph ops on
// compute, copies out on d2h, the optimizer and the return on host), that
// with prefetch-distance=1 block 1's fetch is issued before block 0's
// first compute op, that every cross-stream edge gets one record after the
// producer and one wait per consuming stream before the consumer, and that
// the pinned staging holds (distance + 1) shards of the largest block
// (block 0: 512 + 32 B) and two of its gradients, each in pinned bytes of
// its own rounded up to 256 B (512 + 256), as the cuda backend lays them
// out (exec::layoutHostPool); the module records the ring's buffers. Block 0's weights cannot
// hide behind earlier compute, and a remark says so (the remarks are
// matched on block, half and reason; their wording in between may vary).

// CHECK-LABEL: module @keep attributes {msched.gradient_buffers = 2 : i64}
// CHECK-NEXT:    msched.resource @weight_staging pinned size(1088) category("pinned staging")
// CHECK-NEXT:    msched.resource @gradient_staging pinned size(1536) category("pinned staging")
// CHECK:       func.func @train_step(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[NOISE:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
// CHECK-NEXT:    %[[DX:.*]] = msched.h2d %[[X]] {msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TX:.*]] = msched.record h2d
// CHECK-NEXT:    %[[DN:.*]] = msched.h2d %[[NOISE]] {msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TN:.*]] = msched.record h2d
// CHECK-NEXT:    %[[W0:.*]] = msched.fetch @w0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TW0:.*]] = msched.record h2d
// CHECK-NEXT:    %[[B0:.*]] = msched.fetch @b0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TB0:.*]] = msched.record h2d
// Prefetched: block 1's shard streams while block 0 computes.
// CHECK-NEXT:    %[[W1:.*]] = msched.fetch @w1 {megaslide.layer = 1 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TW1:.*]] = msched.record h2d
// CHECK-NEXT:    msched.wait %[[TX]] compute
// CHECK-NEXT:    msched.wait %[[TW0]] compute
// CHECK-NEXT:    msched.wait %[[TB0]] compute
// CHECK-NEXT:    %[[H0:.*]] = megaslide.linear %[[DX]], %[[W0]], %[[B0]] {megaslide.layer = 0 : i64, msched.stream = 0 : i32}
// CHECK-NEXT:    msched.wait %[[TW1]] compute
// CHECK-NEXT:    %[[H1:.*]] = megaslide.linear %[[H0]], %[[W1]] {megaslide.layer = 1 : i64, msched.stream = 0 : i32}
// The noise is waited for only where compute first reads it.
// CHECK-NEXT:    msched.wait %[[TN]] compute
// CHECK-NEXT:    %[[LOSS:.*]] = megaslide.flow_matching_loss %[[H1]], %[[DX]], %[[DN]] {msched.stream = 0 : i32}
// CHECK-NEXT:    %[[TLOSS:.*]] = msched.record compute
// CHECK-NEXT:    %[[DH1:.*]] = megaslide.flow_matching_loss_grad %[[H1]], %[[DX]], %[[DN]] {msched.stream = 0 : i32}
// CHECK-NEXT:    %[[DH0:.*]] = megaslide.linear_grad_data %[[DH1]], %[[W1]] {megaslide.layer = 1 : i64, msched.stream = 0 : i32}
// CHECK-NEXT:    %[[DW1:.*]] = megaslide.linear_grad_params %[[H0]], %[[DH1]] {megaslide.layer = 1 : i64, msched.stream = 0 : i32}
// CHECK-NEXT:    %[[TDW1:.*]] = msched.record compute
// CHECK-NEXT:    msched.wait %[[TDW1]] d2h
// CHECK-NEXT:    %[[HDW1:.*]] = msched.d2h %[[DW1]] {megaslide.layer = 1 : i64, msched.stream = 2 : i32}
// CHECK-NEXT:    %[[THDW1:.*]] = msched.record d2h
// CHECK-NEXT:    msched.wait %[[THDW1]] host
// CHECK-NEXT:    msched.host_adamw @w1, %[[HDW1]], %[[STEP]] {{{.*}}msched.stream = 3 : i32}
// CHECK-NEXT:    %[[DW0:.*]], %[[DB0:.*]] = megaslide.linear_grad_params %[[DX]], %[[DH0]] {megaslide.layer = 0 : i64, msched.stream = 0 : i32}
// CHECK-NEXT:    %[[TG0:.*]] = msched.record compute
// CHECK-NEXT:    msched.wait %[[TG0]] d2h
// CHECK-NEXT:    %[[HDW0:.*]] = msched.d2h %[[DW0]] {{.*}}msched.stream = 2 : i32}
// CHECK-NEXT:    %[[THDW0:.*]] = msched.record d2h
// CHECK-NEXT:    msched.wait %[[THDW0]] host
// CHECK-NEXT:    msched.host_adamw @w0, %[[HDW0]], %[[STEP]]
// The d2h stream already waited for this producer: no second wait.
// CHECK-NEXT:    %[[HDB0:.*]] = msched.d2h %[[DB0]] {{.*}}msched.stream = 2 : i32}
// CHECK-NEXT:    %[[THDB0:.*]] = msched.record d2h
// CHECK-NEXT:    msched.wait %[[THDB0]] host
// CHECK-NEXT:    msched.host_adamw @b0, %[[HDB0]], %[[STEP]]
// CHECK-NEXT:    msched.wait %[[TLOSS]] d2h
// CHECK-NEXT:    %[[HLOSS:.*]] = msched.d2h %[[LOSS]] {msched.stream = 2 : i32}
// CHECK-NEXT:    %[[THLOSS:.*]] = msched.record d2h
// CHECK-NEXT:    msched.wait %[[THLOSS]] host
// CHECK-NEXT:    return {msched.stream = 3 : i32} %[[HLOSS]]

// Without prefetch, block 1's fetch stays in front of its use, both blocks
// get a remark, and one shard is staged.
// NOPREFETCH-LABEL: module @keep
// NOPREFETCH-NEXT:    msched.resource @weight_staging pinned size(544) category("pinned staging")
// NOPREFETCH:         %[[H0:.*]] = megaslide.linear {{.*}}megaslide.layer = 0 : i64
// NOPREFETCH-NEXT:    %[[W1:.*]] = msched.fetch @w1
// NOPREFETCH-NEXT:    msched.record h2d
// NOPREFETCH-NEXT:    msched.wait
// NOPREFETCH-NEXT:    megaslide.linear %[[H0]], %[[W1]]
// NOPREFETCH-REMARK: remark: weights of block 0 (forward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w0 = msched.fetch @w0
// NOPREFETCH-REMARK: remark: weights of block 1 (forward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w1 = msched.fetch @w1

// Clamped to the buffers there are, prefetch-distance 2 acts as 1.
// Tests that gradient-buffers sizes the gradient ring: three blocks' worth.
// RING-LABEL: module @keep attributes {msched.gradient_buffers = 3 : i64}
// RING:         msched.resource @gradient_staging pinned size(2304) category("pinned staging")

// BUF-LABEL: module @keep
// BUF-NEXT:    msched.resource @weight_staging pinned size(1088) category("pinned staging")

module @keep {
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[0] @b0 : tensor<16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    // expected-remark-re @below {{weights of block 0 (forward) are not {{.*}}: no earlier compute in this half of the step}}
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %b0 = msched.fetch @b0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
    %h0 = megaslide.linear %dx, %w0, %b0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
    %w1 = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %h1 = megaslide.linear %h0, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dh1 = megaslide.flow_matching_loss_grad %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dh0 = megaslide.linear_grad_data %dh1, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dw1 = megaslide.linear_grad_params %h0, %dh1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %hdw1 = msched.d2h %dw1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w1, %hdw1, %step {lr = 1.0e-05 : f64, megaslide.layer = 1 : i64} : tensor<16x16xbf16>, tensor<i64>
    %dw0, %db0 = megaslide.linear_grad_params %dx, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
    %hdw0 = msched.d2h %dw0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w0, %hdw0, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64} : tensor<16x16xbf16>, tensor<i64>
    %hdb0 = msched.d2h %db0 {megaslide.layer = 0 : i64} : tensor<16xbf16>
    msched.host_adamw @b0, %hdb0, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64} : tensor<16xbf16>, tensor<i64>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}

// -----

// Tests that prefetch works in both halves of a recomputed step. Forward
// (ascending blocks): block 0's fetch moves before the first compute op of
// the half (the embedding, which has no block) and block 1's before block
// 0's first op. Backward (descending blocks): block 1's refetch moves
// before the first compute op after the loss, block 0's before block 1's
// first backward op. Every shard then overlaps compute: no remark.

// CHECK-LABEL: module @recompute
// CHECK:         msched.resource @weight_staging pinned size(1024)
// CHECK:       func.func @train_step(
// CHECK:         %[[E:.*]] = msched.fetch @emb {msched.stream = 1 : i32}
// CHECK-NEXT:    msched.record h2d
// CHECK-NEXT:    %[[W0:.*]] = msched.fetch @w0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    msched.record h2d
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    %[[H:.*]] = megaslide.linear %{{.*}}, %[[E]] {msched.stream = 0 : i32}
// CHECK-NEXT:    %[[W1:.*]] = msched.fetch @w1 {megaslide.layer = 1 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    msched.record h2d
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    %[[H0:.*]] = megaslide.linear %[[H]], %[[W0]]
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    %[[H1:.*]] = megaslide.linear %[[H0]], %[[W1]]
// CHECK:         %[[LOSS:.*]] = megaslide.flow_matching_loss
// CHECK-NEXT:    msched.record compute
// CHECK-NEXT:    %[[W1B:.*]] = msched.fetch @w1 {megaslide.layer = 1 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    msched.record h2d
// CHECK-NEXT:    %[[G:.*]] = megaslide.flow_matching_loss_grad
// CHECK-NEXT:    %[[W0B:.*]] = msched.fetch @w0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32}
// CHECK-NEXT:    msched.record h2d
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    %[[DG1:.*]] = megaslide.linear_grad_data %[[G]], %[[W1B]]
// CHECK-NEXT:    msched.wait
// CHECK-NEXT:    megaslide.linear_grad_data %[[DG1]], %[[W0B]]

// NOPREFETCH-LABEL: module @recompute
// NOPREFETCH-REMARK: remark: weights of block 0 (forward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w0 = msched.fetch @w0
// NOPREFETCH-REMARK: remark: weights of block 1 (forward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w1 = msched.fetch @w1
// NOPREFETCH-REMARK: remark: weights of block 1 (backward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w1b = msched.fetch @w1
// NOPREFETCH-REMARK: remark: weights of block 0 (backward) are not {{.*}}: prefetch-distance is 0
// NOPREFETCH-REMARK-NEXT: %w0b = msched.fetch @w0

module @recompute {
  megaslide.param master embeddings @emb : tensor<16x16xf32>
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>) -> tensor<f32> {
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    %e = msched.fetch @emb : tensor<16x16xbf16>
    %h = megaslide.linear %dx, %e : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0 = megaslide.linear %h, %w0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w1 = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %h1 = megaslide.linear %h0, %w1 {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %g = megaslide.flow_matching_loss_grad %h1, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %w1b = msched.fetch @w1 {megaslide.layer = 1 : i64} : tensor<16x16xbf16>
    %d0 = megaslide.linear_grad_data %g, %w1b {megaslide.layer = 1 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %w0b = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %d = megaslide.linear_grad_data %d0, %w0b {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}
