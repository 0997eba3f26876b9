func.func @rope_rank(%q: tensor<1x32x64xbf16>) {
  %r = megaslide.rope3d %q {grid = array<i64: 2, 4, 4>, dims = array<i64: 8, 4, 4>} : tensor<1x32x64xbf16>
  return
}
