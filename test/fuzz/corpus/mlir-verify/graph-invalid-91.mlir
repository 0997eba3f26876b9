func.func @rope_theta(%q: tensor<1x32x4x16xbf16>) {
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>, theta = 0.5 : f64} : tensor<1x32x4x16xbf16>
  return
}
