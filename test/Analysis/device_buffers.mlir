// RUN: megaslide-opt %s --split-input-file --megaslide-plan-memory --test-megaslide-print-device-buffers -o /dev/null | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --test-megaslide-print-device-buffers -o /dev/null | FileCheck %s --check-prefix=UNPLANNED

// Pins collectDeviceBuffers (lib/Analysis/DeviceBuffers.cpp), the input of
// plan-memory, check-budget and the memory report, through
// --test-megaslide-print-device-buffers: one line per buffer with its
// category, size, live range in program order (every op of the step,
// the return too, from 0) and the arena offset plan-memory gave it (-1
// before it ran).

// Tests that each category is told apart: a copied-in batch argument is
// the data batch, a fetch is weights, a value with msched.checkpoint and a
// device copy of a host value are checkpoints, a value whose d2h copy
// feeds host_adamw is a gradient, the rest are activations; host values
// (d2h results) are no buffers.
// Packing (256-byte alignment, best fit in start order):
//   0 batch 256 [0, 7] @0; 1 w 512 [1, 2] @256; 2 h 256 [2, 3] @768;
//   3 a 256 [3, 4] @256 (w's hole); 4 a_d 256 [5, 7] @256 (h and a died,
//   the holes merge); 5 loss 4 -> 256 [6, 10] @512; 6 dw 512 [7, 8]: the
//   free [768, 1024) is too small but ends at the top -> @768, arena 1280.

// CHECK:      buffer 0: data batch h2d output [1, 8, 16] bf16 size 256 live [0, 7] offset 0
// CHECK-NEXT: buffer 1: weights w of block 0 [16, 16] bf16 size 512 live [1, 2] offset 256
// CHECK-NEXT: buffer 2: activations linear output of block 0 [1, 8, 16] bf16 size 256 live [2, 3] offset 768
// CHECK-NEXT: buffer 3: checkpoints gelu output of block 0 [1, 8, 16] bf16 size 256 live [3, 4] offset 256
// CHECK-NEXT: buffer 4: checkpoints h2d output of block 0 [1, 8, 16] bf16 size 256 live [5, 7] offset 256
// CHECK-NEXT: buffer 5: activations flow_matching_loss output [] f32 size 4 live [6, 10] offset 512
// CHECK-NEXT: buffer 6: gradients linear_grad_params output of block 0 [16, 16] bf16 size 512 live [7, 8] offset 768
// CHECK-NEXT: arena 1280

// UNPLANNED:      buffer 0: data batch h2d output [1, 8, 16] bf16 size 256 live [0, 7] offset -1
// UNPLANNED:      buffer 6: gradients linear_grad_params output of block 0 [16, 16] bf16 size 512 live [7, 8] offset -1
// UNPLANNED-NOT:  arena

module @categories {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %x_d = msched.h2d %x {msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<16x16xbf16>
    %h = megaslide.linear %x_d, %w {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %a = megaslide.gelu %h {megaslide.layer = 0 : i64, msched.checkpoint = 1 : i64, msched.stream = 0 : i32} : tensor<1x8x16xbf16>
    %a_h = msched.d2h %a {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<1x8x16xbf16>
    %a_d = msched.h2d %a_h {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %a_d, %x_d, %x_d {msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dw = megaslide.linear_grad_params %x_d, %a_d {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %dw_h = msched.d2h %dw {megaslide.layer = 0 : i64, msched.stream = 2 : i32} : tensor<16x16xbf16>
    msched.host_adamw @w, %dw_h, %step {megaslide.layer = 0 : i64, msched.stream = 3 : i32} : tensor<16x16xbf16>, tensor<i64>
    %loss_h = msched.d2h %loss {msched.stream = 2 : i32} : tensor<f32>
    return {msched.stream = 3 : i32} %loss_h : tensor<f32>
  }
}

// -----

// Tests that a reshape is a view, not a buffer: the silu's buffer lives
// until the view's last reader, the attention at 5; and that attention
// adds a workspace (fp32 log-sum-exp per batch, token and head: 4 * 1 * 8
// * 2 = 64 B) live during the op, listed after the values.

// CHECK:      buffer 0: data batch h2d output [1, 8, 32] bf16 size 512 live [0, 3] offset 0
// CHECK-NEXT: buffer 1: activations silu output [1, 8, 32] bf16 size 512 live [1, 5] offset 512
// CHECK-NEXT: buffer 2: activations silu output [1, 8, 32] bf16 size 512 live [3, 3] offset 1024
// CHECK-NEXT: buffer 3: activations attention output [1, 8, 2, 16] bf16 size 512 live [5, 6] offset 0
// CHECK-NEXT: buffer 4: attention workspace attention size 64 live [5, 5] offset 1024
// CHECK-NEXT: arena 1536

// UNPLANNED:      buffer 4: attention workspace attention size 64 live [5, 5] offset -1

module @views {
  func.func @train_step(%arg0: tensor<1x8x32xbf16>) -> tensor<1x8x2x16xbf16> {
    %in = msched.h2d %arg0 {msched.stream = 1 : i32} : tensor<1x8x32xbf16>
    %x = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %r = megaslide.reshape %x {msched.stream = 0 : i32} : tensor<1x8x32xbf16> -> tensor<1x8x2x16xbf16>
    %y = megaslide.silu %in {msched.stream = 0 : i32} : tensor<1x8x32xbf16>
    %0 = msched.d2h %r {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    %o = megaslide.attention %r, %r, %r {msched.stream = 0 : i32} : (tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>, tensor<1x8x2x16xbf16>) -> tensor<1x8x2x16xbf16>
    %1 = msched.d2h %o {msched.stream = 2 : i32} : tensor<1x8x2x16xbf16>
    return {msched.stream = 3 : i32} %1 : tensor<1x8x2x16xbf16>
  }
}
