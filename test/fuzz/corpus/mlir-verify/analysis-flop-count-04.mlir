func.func @dsa3d(%q: tensor<1x32x4x16xbf16>) {
  %off = megaslide.dsa3d_offsets %q, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>, radius = 1 : i64}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>) -> tensor<1x4x2x2x2x2x2xi32>
  %o, %lse = megaslide.dsa3d %q, %q, %q, %off {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>) -> (tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>)
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %o, %lse, %o {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>)
  return
}
