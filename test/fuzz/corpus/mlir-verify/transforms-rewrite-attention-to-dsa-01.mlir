func.func @small_grid(%q: tensor<1x4x4x16xbf16>, %k: tensor<1x4x4x16xbf16>, %v: tensor<1x4x4x16xbf16>) -> tensor<1x4x4x16xbf16> {
  %rq = megaslide.rope3d %q {grid = array<i64: 2, 1, 2>, dims = array<i64: 8, 4, 4>} : tensor<1x4x4x16xbf16>
  %rk = megaslide.rope3d %k {grid = array<i64: 2, 1, 2>, dims = array<i64: 8, 4, 4>} : tensor<1x4x4x16xbf16>
  %o = megaslide.attention %rq, %rk, %v : (tensor<1x4x4x16xbf16>, tensor<1x4x4x16xbf16>, tensor<1x4x4x16xbf16>) -> tensor<1x4x4x16xbf16>
  return %o : tensor<1x4x4x16xbf16>
}
