// RUN: megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa="window=2,2,2 tile=1,2,2 radius=1" --verify-diagnostics | FileCheck %s
// RUN: megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa="window=2,2,2 tile=1,2,2 layers=1" 2>%t.layers | FileCheck %s --check-prefix=LAYERS
// RUN: megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa 2>%t.default | FileCheck %s --check-prefix=DEFAULT
// RUN: FileCheck %s --check-prefix=DEFAULT-REMARK < %t.default
// RUN: not megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa="window=2,2" 2>&1 | FileCheck %s --check-prefix=BADOPT
// RUN: not megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa="tile=1,0,2" 2>&1 | FileCheck %s --check-prefix=BADOPT
// RUN: not megaslide-opt %s --split-input-file --megaslide-rewrite-attention-to-dsa="radius=-1" 2>&1 | FileCheck %s --check-prefix=BADOPT

// BADOPT: error: options 'window' and 'tile' need three positive extents (t,y,x) and 'radius' must be non-negative

// Tests that self-attention whose queries and keys carry 3D RoPE over a
// (2, 4, 4) grid becomes dsa3d_offsets + dsa3d with the window, tile and
// radius options (offsets [B, H, T/tt, Y/ty, X/tx, kt, 2] =
// [1, 4, 2, 2, 2, 2, 2]), keeping the block and the softmax scale; that
// dsa3d also yields its fp32 log-sum-exp [B, H, N] = [1, 4, 32]; that the
// attention's uses (the cross-attention) read the dsa3d output; that its
// gradient becomes dsa3d_grad reading the same offsets, output and lse;
// and that cross-attention to text (keys without RoPE) and its gradient
// are left alone.

// CHECK-LABEL: func.func @self_and_cross(
// CHECK-SAME:      %[[Q:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[K:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>, %[[V:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>,
// CHECK-SAME:      %[[TK:[a-z0-9_]+]]: tensor<1x8x4x16xbf16>, %[[TV:[a-z0-9_]+]]: tensor<1x8x4x16xbf16>, %[[DO:[a-z0-9_]+]]: tensor<1x32x4x16xbf16>)
// CHECK:         %[[RQ:.*]] = megaslide.rope3d %[[Q]]
// CHECK:         %[[RK:.*]] = megaslide.rope3d %[[K]]
// CHECK-NEXT:    %[[OFF:.*]] = megaslide.dsa3d_offsets %[[RQ]], %[[RK]] {grid = array<i64: 2, 4, 4>, megaslide.layer = 0 : i64, radius = 1 : i64, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
// CHECK-SAME:      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
// CHECK-NEXT:    %[[O:[a-z0-9_]+]], %[[LSE:[a-z0-9_]+]] = megaslide.dsa3d %[[RQ]], %[[RK]], %[[V]], %[[OFF]] {grid = array<i64: 2, 4, 4>, megaslide.layer = 0 : i64, scale = 2.500000e-01 : f64, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
// CHECK-SAME:      -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
// CHECK-NEXT:    %[[C:.*]] = megaslide.attention %[[O]], %[[TK]], %[[TV]] {megaslide.layer = 0 : i64}
// CHECK-NEXT:    %[[DQ:.*]], %[[DK:.*]], %[[DV:.*]] = megaslide.dsa3d_grad %[[RQ]], %[[RK]], %[[V]], %[[OFF]], %[[O]], %[[LSE]], %[[DO]] {grid = array<i64: 2, 4, 4>, megaslide.layer = 0 : i64, scale = 2.500000e-01 : f64, tile = array<i64: 1, 2, 2>, window = array<i64: 2, 2, 2>}
// CHECK-NEXT:    %{{.*}}, %{{.*}}, %{{.*}} = megaslide.attention_grad %[[O]], %[[TK]], %[[TV]], %[[C]], %[[DO]] {megaslide.layer = 0 : i64}
// CHECK-NEXT:    return %[[C]], %[[DQ]], %[[DK]], %[[DV]]
// CHECK-NOT:     megaslide.attention_grad %[[RQ]]

// Only the listed blocks are rewritten: block 0 here stays global.
// LAYERS-LABEL: func.func @self_and_cross(
// LAYERS-NOT:     megaslide.dsa3d
// LAYERS:         megaslide.attention_grad

// DEFAULT-LABEL: func.func @self_and_cross(
// DEFAULT-NOT:     megaslide.dsa3d
// DEFAULT:         megaslide.attention_grad

// The default window (9, 15, 24) is larger than this grid along t.
// DEFAULT-REMARK: remark: kept global attention: the token grid (2, 4, 4) is smaller than the 3D-DSA window along t (9)
// DEFAULT-REMARK-NEXT: %o = megaslide.attention %rq, %rk, %v

func.func @self_and_cross(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>,
                          %tk: tensor<1x8x4x16xbf16>, %tv: tensor<1x8x4x16xbf16>, %do: tensor<1x32x4x16xbf16>)
    -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 0 : i64} : tensor<1x32x4x16xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 0 : i64} : tensor<1x32x4x16xbf16>
  %o = megaslide.attention %rq, %rk, %v {scale = 0.25 : f64, megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %c = megaslide.attention %o, %tk, %tv {megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %rq, %rk, %v, %o, %do {scale = 0.25 : f64, megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  %cq, %ck, %cv = megaslide.attention_grad %o, %tk, %tv, %c, %do {megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return %c, %dq, %dk, %dv : tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>
}

// -----

// Tests that a grid smaller than the window along some axis keeps global
// attention, with a remark naming the grid, the axis and the window; the
// first axis that is too small is named (here y: 1 < 2; t is large enough).

// CHECK-LABEL: func.func @small_grid(
// CHECK-NOT:     megaslide.dsa3d
// CHECK:         megaslide.attention

func.func @small_grid(%q: tensor<1x4x4x16xbf16>, %k: tensor<1x4x4x16xbf16>, %v: tensor<1x4x4x16xbf16>) -> tensor<1x4x4x16xbf16> {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 1, 2>, dims = array<i64: 8, 4, 4>} : tensor<1x4x4x16xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 1, 2>, dims = array<i64: 8, 4, 4>} : tensor<1x4x4x16xbf16>
  // expected-remark @below {{kept global attention: the token grid (2, 1, 2) is smaller than the 3D-DSA window along y (2)}}
  %o = megaslide.attention %rq, %rk, %v : (tensor<1x4x4x16xbf16>, tensor<1x4x4x16xbf16>, tensor<1x4x4x16xbf16>) -> tensor<1x4x4x16xbf16>
  return %o : tensor<1x4x4x16xbf16>
}

// -----

// Tests that `layers` selects blocks: with layers=1 only block 1's
// attention is rewritten; without it, both are. Attention outside any
// block (no megaslide.layer) is rewritten only when no list is given.

// CHECK-LABEL: func.func @two_blocks(
// CHECK:         megaslide.dsa3d_offsets {{.*}}megaslide.layer = 0 : i64
// CHECK:         megaslide.dsa3d {{.*}}megaslide.layer = 0 : i64
// CHECK:         megaslide.dsa3d_offsets {{.*}}megaslide.layer = 1 : i64
// CHECK:         megaslide.dsa3d {{.*}}megaslide.layer = 1 : i64
// CHECK:         megaslide.dsa3d_offsets
// CHECK-NOT:       megaslide.layer
// CHECK-SAME:      -> tensor<1x4x2x2x2x2x2xi32>
// CHECK:         megaslide.dsa3d

// LAYERS-LABEL: func.func @two_blocks(
// LAYERS:         megaslide.attention {{.*}}megaslide.layer = 0 : i64
// LAYERS:         megaslide.dsa3d_offsets {{.*}}megaslide.layer = 1 : i64
// LAYERS-NEXT:    megaslide.dsa3d {{.*}}megaslide.layer = 1 : i64
// LAYERS:         megaslide.attention %
// LAYERS-NOT:     megaslide.dsa3d

func.func @two_blocks(%q: tensor<1x32x4x16xbf16>, %v: tensor<1x32x4x16xbf16>)
    -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) {
  %r0 = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 0 : i64} : tensor<1x32x4x16xbf16>
  %o0 = megaslide.attention %r0, %r0, %v {megaslide.layer = 0 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %r1 = megaslide.rope3d %o0 {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, megaslide.layer = 1 : i64} : tensor<1x32x4x16xbf16>
  %o1 = megaslide.attention %r1, %r1, %v {megaslide.layer = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %r2 = megaslide.rope3d %o1 {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>} : tensor<1x32x4x16xbf16>
  %o2 = megaslide.attention %r2, %r2, %v
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  return %o0, %o1, %o2 : tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>
}
