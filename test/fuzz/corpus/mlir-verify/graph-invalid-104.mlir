func.func @dsa_offsets_ceil(%q: tensor<1x48x4x16xbf16>, %off: tensor<1x4x3x1x1x2x2xi32>) {
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 3, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 2, 4, 4>}
      : (tensor<1x48x4x16xbf16>, tensor<1x48x4x16xbf16>, tensor<1x48x4x16xbf16>,
         tensor<1x4x3x1x1x2x2xi32>) -> (tensor<1x48x4x16xbf16>, tensor<1x4x48xf32>)
  return
}
