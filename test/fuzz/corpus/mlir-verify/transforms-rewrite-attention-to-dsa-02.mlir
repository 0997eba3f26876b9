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
