func.func @rope_odd(%q: tensor<1x32x4x16xbf16>) {
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 6, 5, 5>} : tensor<1x32x4x16xbf16>
  return
}
