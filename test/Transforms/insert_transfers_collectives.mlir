// RUN: megaslide-opt %s --split-input-file --megaslide-insert-transfers="gpus-per-node=4 nodes=2" --verify-diagnostics | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-insert-transfers | FileCheck %s --check-prefix=ONE
// RUN: megaslide-opt %s --split-input-file --megaslide-insert-transfers="gpus-per-node=4 nodes=2" --megaslide-schedule-overlap | FileCheck %s --check-prefix=STREAMS
// RUN: not megaslide-opt %s --split-input-file --megaslide-insert-transfers="gpus-per-node=0" 2>&1 | FileCheck %s --check-prefix=ZERO
// RUN: not megaslide-opt %s --split-input-file --megaslide-insert-transfers="nodes=-1" 2>&1 | FileCheck %s --check-prefix=NEGATIVE

// Tests that a job of 8 ranks (4 GPUs on each of 2 nodes) shards the
// transfers: each fetch is marked `ranks` (it copies its rank's shard) and
// is followed at once by an all_gather of the whole tensor in place, which
// every device use reads; each gradient is reduce-scattered before its
// d2h, marked `ranks` (it copies its rank's shard of the sum). send_bytes
// is 7 shards: w's 256 bf16 elements in shards of 32 (dist::shardRange,
// 16-element aligned) are 64 bytes each, b's 16 elements one shard of 16
// for rank 0, 32 bytes. The loss and the batch are every rank's own. The
// module records the job.

// CHECK:         module attributes {msched.gpus_per_node = 4 : i64, msched.nodes = 2 : i64}
// CHECK-LABEL: func.func @train_step(
// CHECK-NEXT:    %[[DX:.*]] = msched.h2d %{{.*}} : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[DN:.*]] = msched.h2d %{{.*}} : tensor<1x8x16xbf16>
// CHECK-NEXT:    %[[W:.*]] = msched.fetch @w {megaslide.layer = 0 : i64, ranks = 8 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    %[[WA:.*]] = msched.all_gather %[[W]] {megaslide.layer = 0 : i64, nodes = 2 : i64, ranks = 8 : i64, send_bytes = 448 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    %[[B:.*]] = msched.fetch @b {megaslide.layer = 0 : i64, ranks = 8 : i64} : tensor<16xbf16>
// CHECK-NEXT:    %[[BA:.*]] = msched.all_gather %[[B]] {megaslide.layer = 0 : i64, nodes = 2 : i64, ranks = 8 : i64, send_bytes = 224 : i64} : tensor<16xbf16>
// CHECK-NEXT:    %[[H:.*]] = megaslide.linear %[[DX]], %[[WA]], %[[BA]] {megaslide.layer = 0 : i64}
// CHECK-NEXT:    %[[LOSS:.*]] = megaslide.flow_matching_loss %[[H]]
// CHECK-NEXT:    %[[DH:.*]] = megaslide.flow_matching_loss_grad %[[H]]
// CHECK-NEXT:    %[[DW:.*]], %[[DB:.*]] = megaslide.linear_grad_params %[[DX]], %[[DH]]
// CHECK-NEXT:    %[[SW:.*]] = msched.reduce_scatter %[[DW]] {megaslide.layer = 0 : i64, nodes = 2 : i64, ranks = 8 : i64, send_bytes = 448 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    %[[HW:.*]] = msched.d2h %[[SW]] {megaslide.layer = 0 : i64, ranks = 8 : i64} : tensor<16x16xbf16>
// CHECK-NEXT:    msched.host_adamw @w, %[[HW]]
// CHECK-NEXT:    %[[SB:.*]] = msched.reduce_scatter %[[DB]] {megaslide.layer = 0 : i64, nodes = 2 : i64, ranks = 8 : i64, send_bytes = 224 : i64} : tensor<16xbf16>
// CHECK-NEXT:    %[[HB:.*]] = msched.d2h %[[SB]] {megaslide.layer = 0 : i64, ranks = 8 : i64} : tensor<16xbf16>
// CHECK-NEXT:    msched.host_adamw @b, %[[HB]]
// CHECK-NEXT:    %[[HL:.*]] = msched.d2h %[[LOSS]] : tensor<f32>
// CHECK-NEXT:    return %[[HL]]

// With the defaults (one GPU) nothing of the job appears.
// ONE-NOT:       msched.gpus_per_node
// ONE-NOT:       ranks
// ONE-NOT:       all_gather
// ONE-NOT:       reduce_scatter

// The collectives run on the comm stream (4), and the events order them
// against the copies and the compute: the all-gather waits for its fetch
// (h2d, 1), the linear for the all-gather, the d2h (2) for the
// reduce-scatter, which waits for the gradient (compute, 0).
// STREAMS:       %[[W:.*]] = msched.fetch @w {{{.*}}msched.stream = 1 : i32
// STREAMS-NEXT:  %[[TW:.*]] = msched.record h2d
// STREAMS-NEXT:  msched.wait %[[TW]] comm
// STREAMS-NEXT:  %[[WA:.*]] = msched.all_gather %[[W]] {{{.*}}msched.stream = 4 : i32
// STREAMS:       msched.wait %{{.*}} compute
// STREAMS:       megaslide.linear %{{.*}}, %[[WA]]
// STREAMS:       %[[DW:.*]], %{{.*}} = megaslide.linear_grad_params
// STREAMS-NEXT:  %[[TG:.*]] = msched.record compute
// STREAMS-NEXT:  msched.wait %[[TG]] comm
// STREAMS-NEXT:  %[[SW:.*]] = msched.reduce_scatter %[[DW]] {{{.*}}msched.stream = 4 : i32
// STREAMS-NEXT:  %[[TS:.*]] = msched.record comm
// STREAMS-NEXT:  msched.wait %[[TS]] d2h
// STREAMS-NEXT:  msched.d2h %[[SW]] {{{.*}}msched.stream = 2 : i32

// ZERO: option 'gpus-per-node' is 0; it must be at least 1
// NEGATIVE: option 'nodes' is -1; it must be at least 1

megaslide.param master blocks[0] @w : tensor<16x16xf32>
megaslide.param master blocks[0] @b : tensor<16xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
megaslide.param moment blocks[0] @b.exp_avg of @b : tensor<16xf32>
megaslide.param moment blocks[0] @b.exp_avg_sq of @b : tensor<16xf32>
func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
  %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
  %q = megaslide.load @b {megaslide.layer = 0 : i64} : tensor<16xf32>
  %e = megaslide.cast %q {megaslide.layer = 0 : i64} : tensor<16xf32> -> tensor<16xbf16>
  %h = megaslide.linear %x, %c, %e {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
  %loss = megaslide.flow_matching_loss %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
  %dh = megaslide.flow_matching_loss_grad %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
  %dw, %db = megaslide.linear_grad_params %x, %dh {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
  %m = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %v = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %np, %nm, %nv = megaslide.adamw %p, %dw, %m, %v, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
      : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
  megaslide.store %np, @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nm, @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  megaslide.store %nv, @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
  %mb = megaslide.load @b.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  %vb = megaslide.load @b.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  %nb, %nmb, %nvb = megaslide.adamw %q, %db, %mb, %vb, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
      : tensor<16xf32>, tensor<16xbf16>, tensor<16xf32>, tensor<16xf32>, tensor<i64>
  megaslide.store %nb, @b {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nmb, @b.exp_avg {megaslide.layer = 0 : i64} : tensor<16xf32>
  megaslide.store %nvb, @b.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16xf32>
  return %loss : tensor<f32>
}
