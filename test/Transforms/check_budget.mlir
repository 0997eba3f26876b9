// RUN: megaslide-opt %s --split-input-file --megaslide-check-budget="gpu-mem=1GB gpu-reserve=512MiB host-mem=2GB" --verify-diagnostics | FileCheck %s
// RUN: not megaslide-opt %s --split-input-file --megaslide-check-budget=gpu-mem=lots 2>&1 | FileCheck %s --check-prefix=BADUNIT
// RUN: megaslide-plan --model tiny --frames 5 --height 32 --width 32 --emit-mlir %t.tiny.mlir > %t.report
// RUN: not megaslide-opt %t.tiny.mlir --megaslide-plan-residency --megaslide-plan-activations=policy=keep --megaslide-insert-transfers --megaslide-schedule-overlap --megaslide-plan-memory --megaslide-check-budget="gpu-mem=1KB gpu-reserve=1B" 2>&1 | FileCheck %s --check-prefix=TINY

// All cases run under a 1 GB GPU with 512 MiB kept for the runtime (so the
// arena may use 463129088 B = 0.46 GB) and a 2 GB host. The inputs carry
// the arena that plan-memory would give them; buffers on the compute (0)
// and h2d (1) streams are device values.

// BADUNIT: for the --gpu-mem option: 'lots' is not a memory size

// Tests that a device plan over budget fails on the largest buffer live
// at the peak (op 2: the 512 MiB weight shard, next to the 256 MiB linear
// output and the 64 MiB batch: 832 MiB, the arena), with notes on what is
// live there by category, the largest consumers at their ops, and what
// would make it fit: the weights and the batch (604 MB) alone exceed the
// 463 MB the arena may use, so fewer tokens cannot help.

module @over_device {
  msched.resource @device_arena device size(872415232) category("device arena")
  megaslide.param master blocks[0] @w : tensor<32768x8192xf32>
  func.func @train_step(%x: tensor<4096x8192xbf16>) -> tensor<4096x32768xbf16> {
    // expected-note @below {{largest consumer: 67.11 MB (64.00 MiB) data batch h2d output [4096, 8192] bf16}}
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<4096x8192xbf16>
    // expected-error @below {{device memory plan needs 872.42 MB (832.00 MiB) at its peak but the GPU budget of 1.00 GB (0.93 GiB) leaves 463.13 MB (441.67 MiB) after the runtime reserve of 536.87 MB (512.00 MiB)}}
    // expected-note @below {{live at the peak: activations 268.44 MB (256.00 MiB), data batch 67.11 MB (64.00 MiB), weights 536.87 MB (512.00 MiB)}}
    // expected-note @below {{largest consumer: 536.87 MB (512.00 MiB) weights w of block 0 [32768, 8192] bf16}}
    // expected-note @below {{to fit: recompute blocks from checkpoints instead of keeping their activations (--activation-policy auto); weights and gradients in flight alone exceed the budget: use fewer weight buffers (--buffers 1) or a GPU with more memory}}
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<32768x8192xbf16>
    // expected-note @below {{largest consumer: 268.44 MB (256.00 MiB) activations linear output of block 0 [4096, 32768] bf16}}
    %h = megaslide.linear %dx, %w {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<4096x8192xbf16>, tensor<32768x8192xbf16>) -> tensor<4096x32768xbf16>
    %g = megaslide.gelu %h {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : tensor<4096x32768xbf16>
    %out = msched.d2h %g {msched.stream = 2 : i32} : tensor<4096x32768xbf16>
    return {msched.stream = 3 : i32} %out : tensor<4096x32768xbf16>
  }
}

// -----

// Tests that when every block already offloads its checkpoints the advice
// no longer suggests offloading.

module @over_device_offloaded attributes {msched.activation_policy = ["offload"]} {
  msched.resource @device_arena device size(872415232) category("device arena")
  megaslide.param master blocks[0] @w : tensor<32768x8192xf32>
  func.func @train_step(%x: tensor<4096x8192xbf16>) -> tensor<4096x32768xbf16> {
    // expected-note @below {{largest consumer}}
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<4096x8192xbf16>
    // expected-error @below {{device memory plan needs 872.42 MB (832.00 MiB) at its peak}}
    // expected-note @below {{live at the peak}}
    // expected-note @below {{largest consumer}}
    // expected-note-re @below {{to fit: weights and gradients in flight alone exceed the budget: use fewer weight buffers (--buffers 1) or a GPU with more memory{{$}}}}
    %w = msched.fetch @w {megaslide.layer = 0 : i64, msched.stream = 1 : i32} : tensor<32768x8192xbf16>
    // expected-note @below {{largest consumer}}
    %h = megaslide.linear %dx, %w {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : (tensor<4096x8192xbf16>, tensor<32768x8192xbf16>) -> tensor<4096x32768xbf16>
    %g = megaslide.gelu %h {megaslide.layer = 0 : i64, msched.stream = 0 : i32} : tensor<4096x32768xbf16>
    %out = msched.d2h %g {msched.stream = 2 : i32} : tensor<4096x32768xbf16>
    return {msched.stream = 3 : i32} %out : tensor<4096x32768xbf16>
  }
}

// -----

// Tests that a host plan over budget fails on the module with one note per
// category (persistent state by role, host and pinned resources; the
// device arena does not count) and the advice to narrow the moments:
// 2 GiB master + 2 x 64 MiB moments + 64 MiB batch + 1 GB allowance.

// expected-error @below {{host memory plan needs 3.35 GB (3.12 GiB) but the host budget is 2.00 GB (1.86 GiB)}}
// expected-note @below {{OS and runtime allowance: 1.00 GB (0.93 GiB)}}
// expected-note @below {{data batch: 67.11 MB (64.00 MiB)}}
// expected-note @below {{fp32 master weights: 2.15 GB (2.00 GiB)}}
// expected-note @below {{AdamW moments: 134.22 MB (128.00 MiB)}}
// expected-note @below {{megaslide-plan's report lists what would fit, each change planned again ("To fit")}}
module @over_host {
  msched.resource @device_arena device size(4096) category("device arena")
  msched.resource @data_batch pinned size(67108864) category("data batch")
  msched.resource @os_allowance host size(1000000000) category("OS and runtime allowance")
  megaslide.param master blocks[0] @w : tensor<32768x16384xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<4096x4096xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<4096x4096xf32>
  func.func @train_step(%x: tensor<32xbf16>) -> tensor<32xbf16> {
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<32xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<32xbf16>
    return {msched.stream = 3 : i32} %out : tensor<32xbf16>
  }
}

// -----

// Tests that a plan within budget gets a runtime guard at the start of
// the step, sized to the arena's share of the GPU (1 GB - 512 MiB), and
// that checking again replaces a guard rather than adding one.

// CHECK-LABEL: module @fits
// CHECK:       func.func @train_step(
// CHECK-NEXT:    msched.budget_check @device_arena budget(463129088)
// CHECK-NOT:     msched.budget_check
// CHECK-NEXT:    msched.h2d

module @fits {
  msched.resource @device_arena device size(463129088) category("device arena")
  megaslide.param master blocks[0] @w : tensor<1024xf32>
  func.func @train_step(%x: tensor<32xbf16>) -> tensor<32xbf16> {
    msched.budget_check @device_arena budget(141000000000)
    %dx = msched.h2d %x {msched.stream = 1 : i32} : tensor<32xbf16>
    %out = msched.d2h %dx {msched.stream = 2 : i32} : tensor<32xbf16>
    return {msched.stream = 3 : i32} %out : tensor<32xbf16>
  }
}

// -----

// Tests that budgets are checked only after memory is planned.

// expected-error @below {{no device arena: run megaslide-plan-memory first}}
module @unplanned {
  func.func @train_step(%x: tensor<32xbf16>) -> tensor<32xbf16> {
    return %x : tensor<32xbf16>
  }
}

// Tests that, on the tiny model as built by megaslide-plan, a 1 KB GPU
// fails the device check with its explanation and that nothing else is
// reported (the 64 GB OS allowance fits the default 1.5 TB host).

// TINY:     error: device memory plan needs {{[0-9.]+}} KB ({{[0-9.]+}} KiB) at its peak but the GPU budget of 1.00 KB (0.98 KiB) leaves 999 B after the runtime reserve of 1 B
// TINY:     note: live at the peak: activations {{.*}}, weights
// TINY:     note: largest consumer: {{.*}} weights
// TINY:     note: to fit: recompute blocks from checkpoints instead of keeping their activations (--activation-policy auto); weights and gradients in flight alone exceed the budget
// TINY-NOT: host memory plan needs
