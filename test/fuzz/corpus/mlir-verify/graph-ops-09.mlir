func.func @attention(%q: tensor<1x32x4x16xbf16>, %k: tensor<1x8x4x16xbf16>, %v: tensor<1x8x4x16xbf16>) {
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>}
      : tensor<1x32x4x16xbf16>
  %ri = megaslide.rope3d %r {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, theta = 500000.0 : f64, inverse}
      : tensor<1x32x4x16xbf16>
  %o = megaslide.attention %ri, %k, %v
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %o2 = megaslide.attention %q, %k, %v {scale = 0.125 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>) -> tensor<1x32x4x16xbf16>
  %dq, %dk, %dv = megaslide.attention_grad %q, %k, %v, %o2, %o {scale = 0.125 : f64}
      : (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>,
         tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x8x4x16xbf16>, tensor<1x8x4x16xbf16>)
  return
}
