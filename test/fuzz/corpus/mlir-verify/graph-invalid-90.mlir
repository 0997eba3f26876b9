func.func @rope_sum(%q: tensor<1x32x4x16xbf16>) {
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 4, 4, 4>} : tensor<1x32x4x16xbf16>
  return
}
