// RUN: megaslide-opt %s --split-input-file --megaslide-plan-residency --verify-diagnostics | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-residency=host-state-policy=bf16-moments --verify-diagnostics | FileCheck %s --check-prefix=BF16
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-residency=host-state-policy=persistent-bf16 --verify-diagnostics | FileCheck %s --check-prefix=PBF16
// RUN: megaslide-opt %s --split-input-file --megaslide-plan-residency=os-allowance=1.5GiB --verify-diagnostics | FileCheck %s --check-prefix=OS
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-residency=host-state-policy=nope 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: not megaslide-opt %s --split-input-file --megaslide-plan-residency=os-allowance=lots 2>&1 | FileCheck %s --check-prefix=BADOS

// Every planning pass works on `@train_step`, so the cases are told apart
// by their module names, which the CHECK-LABELs anchor on.

// Tests that the default policy (master-moments) records itself on the
// module, leaves the persistent state and the step alone, and declares the
// pinned data batch (the bytes of the step's arguments: 2 x 1x8x16 bf16 +
// an i64 = 520 B) and the OS allowance (64 GB by default).

// CHECK-LABEL: module @master_moments attributes {msched.host_state_policy = "master-moments"}
// CHECK-NEXT:    msched.resource @data_batch pinned size(520) category("data batch")
// CHECK-NEXT:    msched.resource @os_allowance host size(64000000000) category("OS and runtime allowance")
// CHECK-NEXT:    megaslide.param master blocks[0] @w : tensor<16x16xf32>
// CHECK-NEXT:    megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
// CHECK-NEXT:    megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
// CHECK-NEXT:    megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
// CHECK-NEXT:    megaslide.param master head @proj.weight : tensor<16x16xf32>
// CHECK:       func.func @train_step(
// CHECK:         %[[W:.*]] = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
// CHECK:         %[[M:.*]] = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
// CHECK:         %[[V:.*]] = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
// CHECK:         megaslide.adamw %[[W]], %{{.*}}, %[[M]], %[[V]], %{{.*}} {{.*}}: tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>

// The allowance is an option, in decimal or binary units.
// OS-LABEL: module @master_moments
// OS:         msched.resource @os_allowance host size(1610612736) category("OS and runtime allowance")

// BAD: for the --host-state-policy option: unknown value 'nope'; use one of master-moments, persistent-bf16, bf16-moments
// BADOS: for the --os-allowance option: 'lots' is not a memory size

module @master_moments {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
  megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
  megaslide.param master head @proj.weight : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dh = megaslide.flow_matching_loss_grad %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dw = megaslide.linear_grad_params %x, %dh {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %m = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %v = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %p1, %m1, %v1 = megaslide.adamw %p, %dw, %m, %v, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
        : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
    megaslide.store %p1, @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %m1, @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %v1, @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    return %loss : tensor<f32>
  }
}

// -----

// Tests that bf16-moments narrows the moment declarations, their loads,
// the moment results of AdamW and the stores of those results to bf16, and
// leaves the fp32 master alone.

// BF16-LABEL: module @bf16_moments attributes {msched.host_state_policy = "bf16-moments"}
// BF16:         megaslide.param master blocks[0] @w : tensor<16x16xf32>
// BF16-NEXT:    megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xbf16>
// BF16-NEXT:    megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xbf16>
// BF16:         func.func @train_step(
// BF16:         %[[W:.*]] = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
// BF16:         %[[M:.*]] = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// BF16:         %[[V:.*]] = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xbf16>
// BF16:         %[[P1:.*]], %[[M1:.*]], %[[V1:.*]] = megaslide.adamw %[[W]], %{{.*}}, %[[M]], %[[V]], %{{.*}} {{.*}}: tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xbf16>, tensor<16x16xbf16>, tensor<i64>
// BF16:         megaslide.store %[[P1]], @w {{.*}}: tensor<16x16xf32>
// BF16:         megaslide.store %[[M1]], @w.exp_avg {{.*}}: tensor<16x16xbf16>
// BF16:         megaslide.store %[[V1]], @w.exp_avg_sq {{.*}}: tensor<16x16xbf16>

module @bf16_moments {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>, %noise: tensor<1x8x16xbf16>, %step: tensor<i64>) -> tensor<f32> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    %loss = megaslide.flow_matching_loss %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<f32>
    %dh = megaslide.flow_matching_loss_grad %h, %x, %noise : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16>
    %dw = megaslide.linear_grad_params %x, %dh {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<1x8x16xbf16>) -> tensor<16x16xbf16>
    %m = megaslide.load @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %v = megaslide.load @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %p1, %m1, %v1 = megaslide.adamw %p, %dw, %m, %v, %step {lr = 1.0e-05 : f64, megaslide.layer = 0 : i64}
        : tensor<16x16xf32>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<i64>
    megaslide.store %p1, @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %m1, @w.exp_avg {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    megaslide.store %v1, @w.exp_avg_sq {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    return %loss : tensor<f32>
  }
}

// -----

// Tests that persistent-bf16 declares a bf16 working copy `<name>.bf16`
// right after every trainable (master) parameter, in the same group and
// block and linked to its master, and none for frozen buffers or moments.
// The step itself is left to insert-transfers, which fetches the copies.

// PBF16-LABEL: module @persistent_bf16 attributes {msched.host_state_policy = "persistent-bf16"}
// PBF16:         megaslide.param master blocks[0] @w : tensor<16x16xf32>
// PBF16-NEXT:    megaslide.param weight blocks[0] @w.bf16 of @w : tensor<16x16xbf16>
// PBF16-NEXT:    megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
// PBF16-NEXT:    megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
// PBF16-NEXT:    megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
// PBF16-NEXT:    megaslide.param master head @proj.weight : tensor<16x16xf32>
// PBF16-NEXT:    megaslide.param weight head @proj.weight.bf16 of @proj.weight : tensor<16x16xbf16>
// PBF16-NEXT:    func.func @train_step(
// PBF16:         megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>

module @persistent_bf16 {
  megaslide.param master blocks[0] @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg of @w : tensor<16x16xf32>
  megaslide.param moment blocks[0] @w.exp_avg_sq of @w : tensor<16x16xf32>
  megaslide.param frozen embeddings @pos_embed : tensor<1x8x16xbf16>
  megaslide.param master head @proj.weight : tensor<16x16xf32>
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    %p = megaslide.load @w {megaslide.layer = 0 : i64} : tensor<16x16xf32>
    %c = megaslide.cast %p {megaslide.layer = 0 : i64} : tensor<16x16xf32> -> tensor<16x16xbf16>
    %h = megaslide.linear %x, %c {megaslide.layer = 0 : i64} : (tensor<1x8x16xbf16>, tensor<16x16xbf16>) -> tensor<1x8x16xbf16>
    return %h : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that residency is planned once: a module that already records a
// policy is rejected rather than narrowed or copied twice.

// expected-error @below {{residency is already planned ("master-moments")}}
module @planned attributes {msched.host_state_policy = "master-moments"} {
  func.func @train_step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    return %x : tensor<1x8x16xbf16>
  }
}

// -----

// Tests that a module without the training step is rejected.

// expected-error @below {{planning needs a '@train_step' function (as built by megaslide-plan --emit-mlir)}}
module @no_step {
  func.func @step(%x: tensor<1x8x16xbf16>) -> tensor<1x8x16xbf16> {
    return %x : tensor<1x8x16xbf16>
  }
}
