func.func @dsa_lse_type(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>) {
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xbf16>)
  return
}
