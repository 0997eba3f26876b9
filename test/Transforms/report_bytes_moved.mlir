// RUN: megaslide-opt %s --split-input-file --megaslide-report-bytes-moved --verify-diagnostics | FileCheck %s
// RUN: not megaslide-opt %s --split-input-file --megaslide-report-bytes-moved=min-bytes=1KiB -o /dev/null 2>&1 | FileCheck %s --check-prefix=MIN
// RUN: not megaslide-opt %s --split-input-file --megaslide-report-bytes-moved=min-bytes=lots -o /dev/null 2>&1 | FileCheck %s --check-prefix=BADMIN
// RUN: megaslide-plan --model tiny --frames 5 --height 32 --width 32 --emit-mlir %t.tiny.mlir > %t.report
// RUN: megaslide-opt %t.tiny.mlir --megaslide-pipeline -o /dev/null 2>&1 | FileCheck %s --check-prefix=OFF
// RUN: not megaslide-opt %t.tiny.mlir --megaslide-pipeline="report-bytes-moved=true gpu-mem=1KB" -o /dev/null 2>&1 | FileCheck %s --check-prefix=OVER

// The pass only reads: every case prints its input unchanged. Sizes: a
// 16x16 bf16 shard or gradient is 512 B, a 16 bf16 bias 32 B, a 1x8x16
// bf16 activation 256 B, the f32 loss 4 B. The second RUN (the `not` is
// for the last case's error) keeps only groups moving at least 1 KiB.

// BADMIN: for the --min-bytes option: 'lots' is not a memory size

// Tests that a scheduled step (as schedule-overlap leaves it: streams,
// records and waits) gets one remark per block, on the block's first
// transfer, with host->device (fetch + h2d) and device->host (d2h) bytes
// and counts, and one remark for the transfers outside the blocks (the
// batch in, the loss out); events and compute are not transfers.

// CHECK-LABEL: module @scheduled
// CHECK:       func.func @train_step(
// CHECK-SAME:      %[[X:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[NOISE:[a-z0-9_]+]]: tensor<1x8x16xbf16>, %[[STEP:[a-z0-9_]+]]: tensor<i64>)
// CHECK-NEXT:    %[[DX:.*]] = msched.h2d %[[X]] {msched.stream = 1 : i32}
// CHECK-NEXT:    %[[TX:.*]] = msched.record h2d
// CHECK-NEXT:    %[[DN:.*]] = msched.h2d %[[NOISE]] {msched.stream = 1 : i32}
// CHECK:         %[[HLOSS:.*]] = msched.d2h %{{.*}} {msched.stream = 2 : i32} : tensor<f32>
// CHECK:         return {msched.stream = 3 : i32} %[[HLOSS]]

// Block 1 moves exactly 1 KiB and is kept; the outside group (516 B) is not.
// MIN:     remark: block 0 moves 544 B host->device in 2 transfers, 544 B device->host in 2 transfers
// MIN:     remark: block 1 moves 512 B host->device in 1 transfer, 512 B device->host in 1 transfer
// MIN-NOT: remark: ops outside

module @scheduled {
  msched.resource @weight_staging pinned size(1088) category("pinned staging")
  msched.resource @gradient_staging pinned size(1088) category("pinned staging")
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  megaslide.param master blocks[0] @b0 : tensor<16xf32>
  megaslide.param master blocks[1] @w1 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    // expected-remark @below {{ops outside the blocks (embeddings, head, data batch, loss) move 512 B host->device in 2 transfers, 4 B device->host in 1 transfer}}
    %0 = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %1 = msched.record h2d
    %2 = msched.h2d %noise {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %3 = msched.record h2d
    // expected-remark @below {{block 0 moves 544 B host->device in 2 transfers, 544 B device->host in 2 transfers}}
    %4 = msched.fetch @w0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %5 = msched.record h2d
    %6 = msched.fetch @b0 {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16xbf16>
    %7 = msched.record h2d
    // expected-remark @below {{block 1 moves 512 B host->device in 1 transfer, 512 B device->host in 1 transfer}}
    %8 = msched.fetch @w1 {megaslide.layer = 1 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %9 = msched.record h2d
    msched.wait %1 compute
    msched.wait %5 compute
    msched.wait %7 compute
    %10 = megaslide.linear %0, %4, %6 {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>, tensor<16xbf16>) -> tensor<1x8x16xbf16>
    msched.wait %9 compute
    %11 = megaslide.linear %10, %8 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    msched.wait %3 compute
    %12 = megaslide.flow_matching_loss %11, %0, %2 {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %13 = msched.record compute
    %14 = megaslide.flow_matching_loss_grad %11, %0, %2 {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %15 = megaslide.linear_grad_data %14, %8 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dw1 = megaslide.linear_grad_params %10, %14 {megaslide.layer = 1 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %16 = msched.record compute
    msched.wait %16 d2h
    %17 = msched.d2h %dw1 {megaslide.layer = 1 : i64, msched.stream = 2 : i32} : tensor<16x16xbf16>
    %18 = msched.record d2h
    msched.wait %18 host
    msched.host_adamw @w1, %17, %step {lr = 1.000000e-05 : f64, megaslide.layer = 1 : i64, msched.stream = 3 : i32} : tensor<16x16xbf16>, tensor<i64>
    %dw0, %db0 = megaslide.linear_grad_params %0, %15 {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> (tensor<16x16xbf16>, tensor<16xbf16>)
    %19 = msched.record compute
    msched.wait %19 d2h
    %20 = msched.d2h %dw0 {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<16x16xbf16>
    %21 = msched.record d2h
    msched.wait %21 host
    msched.host_adamw @w0, %20, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64, msched.stream = 3 : i32} : tensor<16x16xbf16>, tensor<i64>
    %22 = msched.d2h %db0 {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<16xbf16>
    %23 = msched.record d2h
    msched.wait %23 host
    msched.host_adamw @b0, %22, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64, msched.stream = 3 : i32} : tensor<16xbf16>, tensor<i64>
    msched.wait %13 d2h
    %24 = msched.d2h %12 {msched.stream = 2 : i32} : tensor<f32>
    %25 = msched.record d2h
    msched.wait %25 host
    return {msched.stream = 3 : i32} %24 : tensor<f32>
  }
}

// -----

// Tests that the pass needs transfers but not streams (it runs right after
// insert-transfers too), and that an offloaded checkpoint counts for the
// block that reloads it: block 0 moves its shard in twice (forward and
// recomputation, 2 x 512 B) plus the 256 B reload, and its checkpoint
// (256 B) and gradient (512 B) out. 1,280 B print in decimal and binary
// kilobytes, like every size MegaSlide prints.

// CHECK-LABEL: module @offload
// CHECK:       func.func @train_step(
// CHECK:         %[[C0:.*]] = msched.d2h %{{.*}} {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
// CHECK:         %[[R0:.*]] = msched.h2d %[[C0]] {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>

// MIN:     remark: block 0 moves 1.28 KB (1.25 KiB) host->device in 3 transfers, 768 B device->host in 2 transfers
// MIN-NOT: remark: ops outside

module @offload {
  megaslide.param master blocks[0] @w0 : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    // expected-remark @below {{ops outside the blocks (embeddings, head, data batch, loss) move 512 B host->device in 2 transfers, 4 B device->host in 1 transfer}}
    %dx = msched.h2d %x : tensor<1x8x16xbf16>
    %dn = msched.h2d %noise : tensor<1x8x16xbf16>
    // expected-remark @below {{block 0 moves 1.28 KB (1.25 KiB) host->device in 3 transfers, 768 B device->host in 2 transfers}}
    %w0 = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0 = megaslide.linear %dx, %w0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %c0 = msched.d2h %dx {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h0, %dx, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %r0 = msched.h2d %c0 {megaslide.layer = 0 : i64} : tensor<1x8x16xbf16>
    %w0b = msched.fetch @w0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    %h0b = megaslide.linear %r0, %w0b {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %dh0 = megaslide.flow_matching_loss_grad %h0b, %r0, %dn : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dw0 = megaslide.linear_grad_params %r0, %dh0 {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %hdw0 = msched.d2h %dw0 {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
    msched.host_adamw @w0, %hdw0, %step {lr = 1.000000e-05 : f64, megaslide.layer = 0 : i64} : tensor<16x16xbf16>, tensor<i64>
    %hloss = msched.d2h %loss : tensor<f32>
    return %hloss : tensor<f32>
  }
}

// -----

// Tests that a step whose host state is still read in place (before
// insert-transfers) is an error on the first such op, not a report of
// 0 B.

// The failing case prints no module.
// CHECK-NOT:   module @unscheduled
// MIN:         error: 'megaslide.load' op reads or writes host state inside the step; run megaslide-insert-transfers before megaslide-report-bytes-moved

module @unscheduled {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    // expected-error @below {{'megaslide.load' op reads or writes host state inside the step; run megaslide-insert-transfers before megaslide-report-bytes-moved}}
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    return %h : tensor<1x8x16xbf16>
  }
}

// Tests that megaslide-pipeline leaves the report out by default, and that
// with report-bytes-moved=true it runs after check-budget: a plan over
// budget fails there, before any report.

// OFF:     remark: kept global attention
// OFF-NOT: host->device

// OVER:     error: device memory plan needs
// OVER-NOT: host->device
