func.func @dsa_offsets_radius(%q: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = -1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  return
}
