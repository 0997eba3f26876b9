// RUN: megaslide-opt %s --megaslide-rewrite-attention-to-dsa="window=2,2,2 tile=1,2,2" | FileCheck %s

// Tests that an attention_grad right after its attention is rewritten too
// (the rewrite erases ops the IR walk would visit next).
// CHECK-LABEL: func.func @adjacent
// CHECK: %[[OFF:.*]] = megaslide.dsa3d_offsets
// CHECK: %[[O:[a-z0-9_]+]], %[[LSE:[a-z0-9_]+]] = megaslide.dsa3d {{.*}}, %[[OFF]]
// CHECK-NEXT: megaslide.dsa3d_grad {{.*}}, %[[OFF]], %[[O]], %[[LSE]],
// CHECK-NOT: megaslide.attention
func.func @adjacent(%q: tensor<1x32x2x8xbf16>, %k: tensor<1x32x2x8xbf16>, %v: tensor<1x32x2x8xbf16>,
                    %do: tensor<1x32x2x8xbf16>) -> tensor<1x32x2x8xbf16> {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 2, 2>} : tensor<1x32x2x8xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 2, 2>} : tensor<1x32x2x8xbf16>
  %o = megaslide.attention %rq, %rk, %v
      : (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>) -> tensor<1x32x2x8xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %rq, %rk, %v, %o, %do
      : (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>,
         tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>)
        -> (tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>, tensor<1x32x2x8xbf16>)
  return %dq : tensor<1x32x2x8xbf16>
}
