func.func @dsa3d_offsets_partial(%q: tensor<2x48x2x8xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 3, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 4, 4>, radius = 0 : i64}
      : (tensor<2x48x2x8xbf16>, tensor<2x48x2x8xbf16>) -> tensor<2x2x2x1x1x2x2xi32>
  return
}
