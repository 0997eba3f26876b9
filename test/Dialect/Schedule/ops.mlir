// RUN: megaslide-opt %s --split-input-file | megaslide-opt --split-input-file | FileCheck %s

// Round-trip of every op of the schedule dialect (`msched`): the printed
// form parses back to the same op, with enum keywords, symbol operands and
// attributes with defaults.

// Tests that resources of every residency and budget checks round-trip.

// CHECK: msched.resource @device_arena device size(1048576) category("device arena")
// CHECK: msched.resource @weight_staging pinned size(8388608) category("pinned staging")
// CHECK: msched.resource @os_allowance host size(64000000000) category("OS and runtime allowance")
// CHECK: msched.resource @scratch transient size(0) category("scratch")
// CHECK-LABEL: func.func @resources()
// CHECK: msched.budget_check @device_arena budget(141000000000)
msched.resource @device_arena device size(1048576) category("device arena")
msched.resource @weight_staging pinned size(8388608) category("pinned staging")
msched.resource @os_allowance host size(64000000000) category("OS and runtime allowance")
msched.resource @scratch transient size(0) category("scratch")
func.func @resources() {
  msched.budget_check @device_arena budget(141000000000)
  return
}

// -----

// Tests that an unsolved pack (a problem) and a solved pack (with offsets
// and arena size) round-trip.

// CHECK-LABEL: func.func @pack()
func.func @pack() {
  // CHECK: msched.pack {alignment = 256 : i64, ends = array<i64: 2, 3>, sizes = array<i64: 1024, 512>, starts = array<i64: 0, 1>}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>}
  // CHECK: msched.pack {alignment = 256 : i64, arena_size = 1536 : i64, ends = array<i64: 2, 3>, offsets = array<i64: 0, 1024>, sizes = array<i64: 1024, 512>, starts = array<i64: 0, 1>}
  msched.pack {alignment = 256 : i64, sizes = array<i64: 1024, 512>,
               starts = array<i64: 0, 1>, ends = array<i64: 2, 3>,
               offsets = array<i64: 0, 1024>, arena_size = 1536 : i64}
  // An empty problem is valid.
  // CHECK: msched.pack {alignment = 64 : i64, ends = array<i64>, sizes = array<i64>, starts = array<i64>}
  msched.pack {alignment = 64 : i64, sizes = array<i64>, starts = array<i64>, ends = array<i64>}
  return
}

// -----

// Tests that fetch (of a master, a frozen buffer and a persistent bf16
// copy), h2d and d2h round-trip.

megaslide.param master blocks[0] @"blocks.0.attn1.to_q.weight" : tensor<64x64xf32>
megaslide.param weight blocks[0] @"blocks.0.attn1.to_q.weight.bf16" of @"blocks.0.attn1.to_q.weight" : tensor<64x64xbf16>
megaslide.param frozen embeddings @pos_embed : tensor<1x32x64xbf16>

// CHECK-LABEL: func.func @transfers(
// CHECK-SAME:      %[[H:[a-z0-9_]+]]: tensor<1x16x64xbf16>)
func.func @transfers(%h: tensor<1x16x64xbf16>) -> tensor<64x64xbf16> {
  // CHECK: %[[W:.*]] = msched.fetch @blocks.0.attn1.to_q.weight : tensor<64x64xbf16>
  %w = msched.fetch @"blocks.0.attn1.to_q.weight" : tensor<64x64xbf16>
  // CHECK: %{{.*}} = msched.fetch @blocks.0.attn1.to_q.weight {megaslide.layer = 0 : i64} : tensor<64x64xf32>
  %w32 = msched.fetch @"blocks.0.attn1.to_q.weight" {megaslide.layer = 0 : i64} : tensor<64x64xf32>
  // CHECK: %{{.*}} = msched.fetch @blocks.0.attn1.to_q.weight.bf16 : tensor<64x64xbf16>
  %wb = msched.fetch @"blocks.0.attn1.to_q.weight.bf16" : tensor<64x64xbf16>
  // CHECK: %{{.*}} = msched.fetch @pos_embed : tensor<1x32x64xf16>
  %p = msched.fetch @pos_embed : tensor<1x32x64xf16>
  // CHECK: %[[D:.*]] = msched.h2d %[[H]] : tensor<1x16x64xbf16>
  %d = msched.h2d %h : tensor<1x16x64xbf16>
  // CHECK: %{{.*}} = msched.d2h %[[D]] : tensor<1x16x64xbf16>
  %back = msched.d2h %d : tensor<1x16x64xbf16>
  // CHECK: %[[G:.*]] = msched.d2h %[[W]] : tensor<64x64xbf16>
  %g = msched.d2h %w : tensor<64x64xbf16>
  // CHECK: return %[[G]]
  return %g : tensor<64x64xbf16>
}

// -----

// Tests that host_adamw round-trips with its default hyper-parameters
// elided and overridden ones printed.

megaslide.param master blocks[0] @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<64x64xf32>
megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<64x64xf32>

// CHECK-LABEL: func.func @host_adamw(
// CHECK-SAME:      %[[G:[a-z0-9_]+]]: tensor<64x64xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
func.func @host_adamw(%g: tensor<64x64xbf16>, %step: tensor<i64>) {
  // CHECK: msched.host_adamw @w, %[[G]], %[[STEP]] : tensor<64x64xbf16>, tensor<i64>
  msched.host_adamw @w, %g, %step : tensor<64x64xbf16>, tensor<i64>
  // CHECK: msched.host_adamw @w, %[[G]], %[[STEP]]
  // CHECK-SAME: beta1 = 8.000000e-01 : f64
  // CHECK-SAME: beta2 = 0.94999999999999996 : f64
  // CHECK-SAME: eps = 9.9999999999999995E-7 : f64
  // CHECK-SAME: lr = 1.000000e-05 : f64
  // CHECK-SAME: weight_decay = 1.000000e-02 : f64
  // CHECK-SAME: : tensor<64x64xbf16>, tensor<i64>
  msched.host_adamw @w, %g, %step {lr = 1.0e-05 : f64, beta1 = 0.8 : f64,
      beta2 = 0.95 : f64, eps = 1.0e-06 : f64, weight_decay = 0.01 : f64}
      : tensor<64x64xbf16>, tensor<i64>
  // Defaults written out are elided.
  // CHECK: msched.host_adamw @w, %[[G]], %[[STEP]] : tensor<64x64xbf16>, tensor<i64>
  msched.host_adamw @w, %g, %step {lr = 1.0e-04 : f64, beta1 = 0.9 : f64}
      : tensor<64x64xbf16>, tensor<i64>
  return
}

// -----

// Tests that record on every stream, wait and join (of one and of several
// timepoints) round-trip.

// CHECK-LABEL: func.func @timepoints()
func.func @timepoints() -> !msched.timepoint {
  // CHECK: %[[A:.*]] = msched.record compute
  // CHECK: %[[B:.*]] = msched.record h2d
  // CHECK: %[[C:.*]] = msched.record d2h
  // CHECK: %[[D:.*]] = msched.record host
  %a = msched.record compute
  %b = msched.record h2d
  %c = msched.record d2h
  %d = msched.record host
  // CHECK: msched.wait %[[B]] compute
  // CHECK: msched.wait %[[A]] d2h
  // CHECK: msched.wait %[[C]] host
  // CHECK: msched.wait %[[D]] h2d
  msched.wait %b compute
  msched.wait %a d2h
  msched.wait %c host
  msched.wait %d h2d
  // CHECK: %{{.*}} = msched.join %[[A]]
  %one = msched.join %a
  // CHECK: %[[ALL:.*]] = msched.join %[[A]], %[[B]], %[[C]], %[[D]]
  %all = msched.join %a, %b, %c, %d
  // CHECK: return %[[ALL]] : !msched.timepoint
  return %all : !msched.timepoint
}

// -----

// Tests that the planning passes' discardable attributes (streams as
// their enum values, offsets, workspaces, checkpoints) are kept.

// CHECK-LABEL: func.func @annotations(
func.func @annotations(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
  // CHECK: msched.h2d %{{.*}} {msched.offsets = array<i64: 0>, msched.stream = 1 : i32}
  %d = msched.h2d %x {msched.stream = 1 : i32, msched.offsets = array<i64: 0>} : tensor<1x8x16xbf16>
  // CHECK: megaslide.silu %{{.*}} {msched.checkpoint = 0 : i64, msched.offsets = array<i64: 256>, msched.stream = 0 : i32}
  %s = megaslide.silu %d {msched.stream = 0 : i32, msched.offsets = array<i64: 256>, msched.checkpoint = 0 : i64} : tensor<1x8x16xbf16>
  return %s : tensor<1x8x16xbf16>
}
