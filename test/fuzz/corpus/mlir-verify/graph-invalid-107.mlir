func.func @dsa_grad_dv(%q: tensor<1x32x4x16xbf16>, %off: tensor<1x4x2x2x2x2x2xi32>,
                        %lse: tensor<1x4x32xf32>, %bad: tensor<1x32x4x8xbf16>) {
  %dq, %dk, %dv = megaslide.dsa3d_grad %q, %q, %q, %off, %q, %lse, %q {grid = array<i64: 2, 4, 4>,
      window = array<i64: 2, 2, 2>, tile = array<i64: 1, 2, 2>}
      : (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>,
         tensor<1x4x2x2x2x2x2xi32>, tensor<1x32x4x16xbf16>, tensor<1x4x32xf32>,
         tensor<1x32x4x16xbf16>)
        -> (tensor<1x32x4x16xbf16>, tensor<1x32x4x16xbf16>, tensor<1x32x4x8xbf16>)
  return
}
